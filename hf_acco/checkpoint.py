"""ACCO's optimizer shards on disk: ``save_optimizer_state`` / ``load_optimizer_state`` (one atomic file per rank; a
checkpoint of N ranks loads on M), and ``python -m hf_acco.checkpoint gather`` / ``rebuild`` for per-node
checkpoints (copy every machine's shards into one directory; write the shards a replaced machine lost), and
``to-trainer`` (an ``optimizer.pt`` beside the shards, for plain Trainer). They live in
``hf_acco/engine/checkpoint.py``, ``hf_acco/engine/rebuild.py``, ``hf_acco/engine/torch_format.py`` and
``hf_acco/tools/checkpoint_cli.py``."""

from hf_acco.engine.checkpoint import gather_shards, load_optimizer_state, save_optimizer_state
from hf_acco.engine.rebuild import rebuild_shards
from hf_acco.tools.checkpoint_cli import export_for_trainer, main

__all__ = ["export_for_trainer", "gather_shards", "load_optimizer_state", "rebuild_shards", "save_optimizer_state"]


def cli() -> None:
    """The console script (``hf-acco-checkpoint``)."""
    main()


if __name__ == "__main__":
    cli()
