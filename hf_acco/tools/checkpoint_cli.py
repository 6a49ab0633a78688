"""``python -m hf_acco.checkpoint``: ACCO's optimizer shards on disk, for per-node checkpoints and for plain Trainer.

gather --into DIR NODE_DIRS...   copy every machine's shards into one directory (it then resumes on any number
                                 of ranks)
rebuild CHECKPOINT_DIR [--ranks R ...]
                                 a machine was replaced and its disk is lost: write the shards no machine has
                                 any more, from the surviving shards and the checkpoint's model weights
                                 (``hf_acco.engine.rebuild``: exact master for an fp32 model, their optimizer
                                 moments restart)
to-trainer CHECKPOINT_DIR        write the optimizer state as plain Trainer's optimizer.pt (torch's state dict
                                 of its AdamW), so that plain Trainer resumes the checkpoint with it
                                 (ACCOTrainer goes on reading its shards)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hf_acco.engine.checkpoint import gather_shards, missing_shards
from hf_acco.engine.rebuild import rebuild_shards
from hf_acco.engine.shard_files import atomic_save, part_folders, read_shard, shard_files
from hf_acco.engine.torch_format import torch_state_from_shards

TRAINER_OPTIMIZER = "optimizer.pt"
WEIGHT_FILES = ("model.safetensors", "adapter_model.safetensors", "pytorch_model.bin", "adapter_model.bin")


def trainer_checkpoint_weights(directory: str | Path) -> dict[str, torch.Tensor]:
    """The parameters a Trainer checkpoint's model files hold (``save_model``'s: the committed ones), by name: one
    safetensors or bin file, or the shards its index names. A PEFT adapter's names (saved without the adapter's
    name) are given both ways, with and without ``.default``."""
    directory = Path(directory)
    index = next((directory / f"{w}.index.json" for w in WEIGHT_FILES if (directory / f"{w}.index.json").is_file()),
                 None)  # fmt: skip
    if index is not None:
        files = sorted({directory / f for f in json.loads(index.read_text())["weight_map"].values()})
    else:
        files = [directory / w for w in WEIGHT_FILES if (directory / w).is_file()][:1]
    if not files:
        raise FileNotFoundError(
            f"No model weights in {directory} ({', '.join(WEIGHT_FILES)}): copy the checkpoint directory of a "
            "machine that kept its disk (its model files are the same on every machine)."
        )
    weights: dict[str, torch.Tensor] = {}
    for f in files:
        if f.suffix == ".safetensors":
            from safetensors.torch import load_file

            weights.update(load_file(str(f)))
        else:
            weights.update(torch.load(f, map_location="cpu", weights_only=True))
    if any(f.name.startswith("adapter_model") for f in files):  # PEFT drops the adapter's name from its keys
        for name, value in list(weights.items()):
            for part in ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B"):
                weights.setdefault(name.replace(f".{part}.", f".{part}.default."), value)
    return weights


def export_for_trainer(directory: str | Path) -> Path:
    """Write ``optimizer.pt`` into the ACCO checkpoint ``directory``: torch's state dict of plain Trainer's optimizer,
    from every rank's shard, parameter by parameter (the shards memory-mapped). Returns the file."""
    directory = Path(directory)
    if part_folders(directory):
        raise ValueError(
            f"{directory} was written with FSDP inside each machine: its optimizer state covers FSDP's local shards, "
            "which plain Trainer's FSDP checkpoint stores otherwise. Resume it with ACCOTrainer."
        )
    why = missing_shards(directory)  # every rank's shard of one run, as a resume on another world size needs
    if why:
        raise FileNotFoundError(
            f"{directory} lacks {why}: point at a checkpoint-N directory that ACCOTrainer wrote, with every rank's "
            "shard in it (per-node checkpoints: gather them first, python -m hf_acco.checkpoint gather --into DIR "
            "NODE_DIRS...)."
        )
    ((world, files),) = shard_files(directory).items()
    shards = [read_shard(files[r]) for r in range(world)]
    if not shards[0].get("empty_groups_kept") and len(shards[0]["hparams"]) == 1:
        raise ValueError(
            f"{directory} was written by hf_acco 0.1.0, whose ACCOTrainer left out an empty parameter group that "
            "plain Trainer's optimizer has: resume it once with ACCOTrainer of this version, let it save a "
            "checkpoint, and run to-trainer on that one."
        )
    target = directory / TRAINER_OPTIMIZER
    atomic_save(torch_state_from_shards(shards), target)
    return target


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hf_acco.checkpoint", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("gather", help="copy every node's optimizer shards into one directory")
    g.add_argument("--into", required=True, help="the directory to resume from (e.g. one node's checkpoint-N)")
    g.add_argument("sources", nargs="+", help="the nodes' checkpoint-N directories (copied here first)")
    r = sub.add_parser("rebuild", help="write the optimizer shards a replaced machine lost")
    r.add_argument("checkpoint", help="a checkpoint-N directory copied from a machine that kept its disk")
    r.add_argument("--ranks", type=int, nargs="+", default=None,
                   help="the ranks to rebuild (default: every rank whose shard is not in the directory)")  # fmt: skip
    t = sub.add_parser("to-trainer", help="write optimizer.pt, as plain Trainer saves it, beside the shards")
    t.add_argument("checkpoint", help="a checkpoint-N directory ACCOTrainer wrote (every rank's shard in it)")
    return p


def main(argv: list[str] | None = None) -> None:
    p = make_parser()
    args = p.parse_args(argv)
    try:
        if args.command == "gather":
            written = gather_shards(args.sources, args.into)
            print(f"{len(written)} optimizer shards in {args.into}")
            return
        if args.command == "to-trainer":
            target = export_for_trainer(args.checkpoint)
            print(
                f"Wrote {target}: plain Trainer resumes {args.checkpoint} with this optimizer state "
                "(resume_from_checkpoint); ACCOTrainer goes on reading the shards."
            )
            return
        written = rebuild_shards(args.checkpoint, trainer_checkpoint_weights(args.checkpoint), args.ranks)
    except (ValueError, FileNotFoundError, FileExistsError, KeyError) as e:
        p.error(str(e))
    print(
        f"Rebuilt {len(written)} optimizer shard(s) in {args.checkpoint}: {', '.join(w.name for w in written)}. "
        "Their master weights come from the model files (exact for an fp32 model), their optimizer moments restart "
        "from zero; the other ranks resume exactly."
    )
