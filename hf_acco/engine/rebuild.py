"""Rebuild the optimizer shards a checkpoint lost with a machine (per-node checkpoints on local disks, a machine
replaced after a pre-emption): from the shards that survive and the model's parameters.

Each rank's shard is the only copy of its part of the optimizer state, so what is lost cannot be recovered exactly.
What can be rebuilt, and how:

* the fp32 master of the lost shard: the checkpoint's model weights (what ``save_model`` wrote: the committed
  parameters). Exact for an fp32 model; for a bf16 model the master's bits below bf16's are lost (the master
  restarts from the bf16 weights).
* the per-element optimizer state (Adam's moments): zero, and each of the lost shard's parameters marked as never
  stepped, so that torch's optimizer starts them afresh on the next step (its step count from 0: Adam's bias
  correction makes the first update a normal one, not a jump).
* the model held at the boundary (for ``acco``, the estimate): the committed parameters.
* everything global (the schedule, the step count, the hyper-parameters, whether a commit was pending): the
  survivors'.

The ranks whose shards survive resume exactly; the rebuilt ones resume like a restart of the optimizer for their
elements. Resume a rebuilt checkpoint on the same number of ranks: a re-sharding resume takes each parameter's step
count from a rank that holds a piece of it, and would give the rebuilt pieces a survivor's count beside zero moments.

Torch only: the weights come in as a mapping of parameter name to tensor (``hf_acco/tools/checkpoint_cli.py`` reads
them from a Trainer checkpoint's model files).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from hf_acco.comm.sharding import FlatLayout
from hf_acco.engine.shard_files import atomic_save, part_folders, read_shard, shard_filename, shard_files


def _flat_weights(layout: FlatLayout, weights: Mapping[str, torch.Tensor]) -> torch.Tensor:
    """The trainable parameters of ``layout`` from ``weights``, flattened in its order (fp32, padded)."""
    missing = [n for n in layout.names if n not in weights]
    if missing:
        raise KeyError(
            f"The model weights lack {len(missing)} of the checkpoint's trainable parameters (first: {missing[0]!r}). "
            "Rebuild from the checkpoint's own model files (the committed parameters save_model wrote)."
        )
    flat = torch.zeros(layout.padded_numel, dtype=torch.float32)
    for name, shape, offset, numel in zip(layout.names, layout.shapes, layout.offsets, layout.numels):
        value = weights[name]
        if tuple(value.shape) != tuple(shape):
            raise ValueError(f"{name}: the model weights have shape {tuple(value.shape)}, the checkpoint {shape}")
        flat[offset : offset + numel] = value.reshape(-1).to(torch.float32)
    return flat


def rebuild_shards(
    directory: str | os.PathLike, weights: Mapping[str, torch.Tensor], ranks: list[int] | None = None
) -> list[Path]:
    """Write into ``directory`` the optimizer shards of ``ranks`` (default: every rank whose shard is not there),
    rebuilt from a surviving shard's record and ``weights`` (name -> the committed parameter); returns the files
    written. The surviving shards are not touched."""
    directory = Path(directory)
    if part_folders(directory):
        raise ValueError(
            "This checkpoint was written with FSDP inside each machine, whose checkpoints need a shared file system "
            "(save_on_each_node is refused there): nothing to rebuild."
        )
    found = shard_files(directory)
    if len(found) != 1:
        raise FileNotFoundError(
            f"Rebuilding needs at least one surviving optimizer shard of one run in {directory} (found world sizes "
            f"{sorted(found)}): copy the checkpoint directory of a machine that kept its disk here first."
        )
    ((world, files),) = found.items()
    targets = sorted(set(range(world)) - set(files)) if ranks is None else sorted(ranks)
    if any(not 0 <= r < world for r in targets):
        raise ValueError(f"ranks must be in 0..{world - 1}, got {targets}")
    kept = [str(files[r]) for r in targets if r in files]
    if kept:  # checked before anything is written
        raise FileExistsError(f"{', '.join(kept)} survive(s): rebuild only the ranks whose shards are lost")
    survivor = read_shard(files[min(files)])
    layout = FlatLayout.from_meta(survivor["layout"])
    flat = _flat_weights(layout, weights)
    model_dtype = survivor["model"].dtype
    written = []
    for rank in targets:
        master = layout.shard_of(flat, rank).clone()
        state = {k: v for k, v in survivor.items() if k not in ("rank", "master", "model", "optim_state")}
        state.update(
            rank=rank,
            master=master,
            model=master.to(model_dtype),
            optim_state={k: torch.zeros_like(master, dtype=v.dtype) for k, v in survivor["optim_state"].items()},
            # every parameter this shard holds a piece of starts its optimizer state afresh (never stepped)
            optim_param_scalars={k: torch.full_like(v, math.nan) for k, v in survivor["optim_param_scalars"].items()},
            rebuilt=True,
        )
        state.pop("int8_residual", None)  # that rank's own rounding: none after a rebuild
        path = directory / shard_filename(rank, world)
        atomic_save(state, path)
        written.append(path)
    return written
