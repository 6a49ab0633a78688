"""The engine's checkpoint files on disk: their names, how a set of them is found, how one is read, and the one
atomic writer every checkpoint file of the package goes through (torch only).

A run of ``n`` ranks writes one file per rank, ``acco_optimizer_rank{r}_of_{n}.pt`` (that rank's
``ACCOOptimizer.state_dict()``). Where the engine's ranks hold one FSDP shard of the model each (FSDP inside
machines), each FSDP shard index ``k`` of ``K`` has its own folder ``fsdp_shard{k}_of_{K}`` holding such a set.
Files are loaded memory-mapped with ``weights_only=True``.

Written atomically: under a temporary name beside the target, flushed to disk, renamed over the target, and the
directory entry flushed, so a crash at any moment leaves the old file or the complete new one, never half of one.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

import torch

_SHARD_RE = re.compile(r"^acco_optimizer_rank(\d+)_of_(\d+)\.pt$")
_PART_RE = re.compile(r"fsdp_shard(\d+)_of_(\d+)$")


def shard_filename(rank: int, world_size: int) -> str:
    return f"acco_optimizer_rank{rank}_of_{world_size}.pt"


def part_folder(directory: str | os.PathLike, part: tuple[int, int] | None) -> Path:
    """The folder of FSDP shard ``part`` = (k, K) in ``directory`` (``directory`` itself without FSDP: None)."""
    return Path(directory) if part is None else Path(directory) / f"fsdp_shard{part[0]}_of_{part[1]}"


def shard_files(directory: str | os.PathLike) -> dict[int, dict[int, Path]]:
    """The optimizer shard files in ``directory``: {world size: {rank: path}}."""
    return _numbered(Path(directory), "acco_optimizer_rank*_of_*.pt", _SHARD_RE, Path.is_file)


def part_folders(directory: str | os.PathLike) -> dict[int, dict[int, Path]]:
    """The ``fsdp_shard{k}_of_{K}`` folders in ``directory`` (``part_folder``): {K: {k: path}}."""
    return _numbered(Path(directory), "fsdp_shard*_of_*", _PART_RE, Path.is_dir)


def _numbered(directory: Path, pattern: str, name: re.Pattern, kind: Callable[[Path], bool]) -> dict:
    found: dict[int, dict[int, Path]] = {}
    for f in directory.glob(pattern) if directory.is_dir() else []:
        m = name.match(f.name)
        if m and kind(f):
            found.setdefault(int(m.group(2)), {})[int(m.group(1))] = f
    return found


def read_shard(path: Path) -> dict[str, Any]:
    """One shard file's state, memory-mapped (only what is used is read); a damaged file says what to do."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - turned into an actionable message
        raise ValueError(
            f"Could not read the ACCO optimizer shard {path} ({type(e).__name__}: {e}). The file is damaged; "
            "resume from an earlier checkpoint."
        ) from e


def atomic_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to ``path`` so that ``path`` holds either the old or the complete new file."""
    atomic_write(path, lambda f: torch.save(obj, f))


def atomic_copy(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """Copy ``source`` to ``target`` so that ``target`` holds either the old or the complete new file."""
    with open(source, "rb") as src:
        atomic_write(target, lambda f: shutil.copyfileobj(src, f))


def atomic_write_json(obj: Any, path: str | os.PathLike) -> None:
    """``obj`` as JSON in ``path``, which holds either the old or the complete new file."""
    atomic_write(path, lambda f: f.write(json.dumps(obj).encode("utf-8")))


def atomic_write(path: str | os.PathLike, write: Callable[[IO[bytes]], Any]) -> None:
    """``write(file)`` (a binary file) into a temporary name beside ``path``, flushed to disk, then renamed over
    ``path``; the directory entry is flushed too. A crash mid-write never leaves a truncated file under the name."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            write(f)
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
