"""Per-rank optimizer shard files: written atomically, loaded with ``weights_only=True``, re-sharded on load.

One file per rank, ``acco_optimizer_rank{r}_of_{n}.pt``, holding that rank's ``ACCOOptimizer.state_dict()``
(master shard, optimizer state shard, the model's in-flight estimate shard, counters and the layout). A file is
written under a temporary name, flushed to disk and renamed, so a crash mid-write never leaves a truncated file
under the real name.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from .core import ACCOOptimizer
from .shard_state import reshard

_SHARD_RE = re.compile(r"^acco_optimizer_rank(\d+)_of_(\d+)\.pt$")


def shard_filename(rank: int, world_size: int) -> str:
    return f"acco_optimizer_rank{rank}_of_{world_size}.pt"


def atomic_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to ``path`` so that ``path`` holds either the old or the complete new file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def save_optimizer_state(optimizer: ACCOOptimizer, directory: str | os.PathLike) -> Path:
    """Write this rank's shard into ``directory`` (every rank calls it). Returns the file written."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / shard_filename(optimizer.comm.rank, optimizer.comm.world_size)
    atomic_save(optimizer.state_dict(), path)
    return path


def load_optimizer_state(optimizer: ACCOOptimizer, directory: str | os.PathLike) -> None:
    """Load the shards in ``directory`` into ``optimizer`` (collective), re-sharding if the layout changed (another
    world size, or a checkpoint of an older chunk size): each rank then reads only its own ranges of the files."""
    layout, rank = optimizer.layout, optimizer.comm.rank
    try:
        states = _read_shards(Path(directory), rank, layout.world_size, layout.chunk)
        meta = states[0]["layout"]
        same = meta["world_size"] == layout.world_size and meta["chunk"] == layout.chunk
        state = states[0] if same else reshard(states, layout, rank)
    except (ValueError, FileNotFoundError) as e:
        optimizer.raise_if_any_rank_failed(e)  # every rank raises, none waits in a collective
        raise
    optimizer.load_state_dict(state)


def shard_files(directory: str | os.PathLike) -> dict[int, dict[int, Path]]:
    """The optimizer shard files in ``directory``: {world size: {rank: path}}."""
    directory = Path(directory)
    found: dict[int, dict[int, Path]] = {}
    for f in directory.glob("acco_optimizer_rank*_of_*.pt") if directory.is_dir() else []:
        m = _SHARD_RE.match(f.name)
        if m:
            found.setdefault(int(m.group(2)), {})[int(m.group(1))] = f
    return found


def missing_shards(directory: str | os.PathLike) -> str | None:
    """Why the shard set in ``directory`` is incomplete, or None if one world size has all its ranks."""
    found = shard_files(directory)
    if not found:
        return "the ACCO optimizer shards acco_optimizer_rank*_of_*.pt (written by plain Trainer, or save_only_model?)"
    if len(found) > 1:
        return f"a single set of optimizer shards (it has several world sizes {sorted(found)})"
    ((world, files),) = found.items()
    missing = sorted(set(range(world)) - set(files))
    return f"the optimizer shards of ranks {missing} (of {world})" if missing else None


def _read_shards(directory: Path, rank: int, world_size: int, chunk: int) -> list[dict[str, Any]]:
    """This rank's shard (same layout) or every shard (re-sharding), memory-mapped: only what is used is read."""
    found = shard_files(directory)
    if not found:
        raise FileNotFoundError(
            f"No ACCO optimizer shards (acco_optimizer_rank*_of_*.pt) in {directory}. Was the checkpoint written "
            "by an ACCO run? Resume from another checkpoint, or start without resuming."
        )
    if len(found) > 1:
        raise ValueError(f"{directory} holds optimizer shards of several world sizes {sorted(found)}; keep one set.")
    ((saved_world, files),) = found.items()
    missing = sorted(set(range(saved_world)) - set(files))
    if missing:
        raise FileNotFoundError(
            f"The checkpoint {directory} lacks the optimizer shards of ranks {missing} (of {saved_world}): it is "
            "incomplete. Resume from an earlier checkpoint."
        )
    if saved_world == world_size:  # the same ranks: this rank's own file (all of them if the chunk size changed)
        own = _read(files[rank])
        if own["layout"]["chunk"] == chunk:
            return [own]
    return [_read(files[r]) for r in range(saved_world)]


def _read(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - turned into an actionable message
        raise ValueError(
            f"Could not read the ACCO optimizer shard {path} ({type(e).__name__}: {e}). The file is damaged; "
            "resume from an earlier checkpoint."
        ) from e
