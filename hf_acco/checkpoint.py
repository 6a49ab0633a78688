"""ACCO's optimizer shards on disk: ``save_optimizer_state`` / ``load_optimizer_state`` (one atomic file per rank; a
checkpoint of N ranks loads on M), and ``python -m hf_acco.checkpoint gather`` for per-node checkpoints. They live in
``hf_acco/engine/checkpoint.py``."""

from hf_acco.engine.checkpoint import gather_shards, load_optimizer_state, main, save_optimizer_state

__all__ = ["gather_shards", "load_optimizer_state", "save_optimizer_state"]

if __name__ == "__main__":
    main()
