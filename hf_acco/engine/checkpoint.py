"""Per-rank optimizer shard files: written atomically, loaded with ``weights_only=True``, re-sharded on load.

One file per rank, ``acco_optimizer_rank{r}_of_{n}.pt``, holding that rank's ``ACCOOptimizer.state_dict()``
(master shard, optimizer state shard, the model's in-flight estimate shard, counters and the layout). A file is
written under a temporary name, flushed to disk and renamed, so a crash mid-write never leaves a truncated file
under the real name.
"""

from __future__ import annotations

import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hf_acco.engine.core import ACCOOptimizer
from hf_acco.engine.shard_state import reshard, with_empty_groups
from hf_acco.engine.torch_format import optimizer_keys, shard_from_torch_state

_PART_RE = re.compile(r"fsdp_shard(\d+)_of_(\d+)$")
_SHARD_RE = re.compile(r"^acco_optimizer_rank(\d+)_of_(\d+)\.pt$")


def shard_filename(rank: int, world_size: int) -> str:
    return f"acco_optimizer_rank{rank}_of_{world_size}.pt"


def atomic_save(obj: Any, path: str | os.PathLike) -> None:
    """``torch.save`` to ``path`` so that ``path`` holds either the old or the complete new file."""
    _atomic_write(Path(path), lambda f: torch.save(obj, f))


def atomic_copy(source: str | os.PathLike, target: str | os.PathLike) -> None:
    """Copy ``source`` to ``target`` so that ``target`` holds either the old or the complete new file."""
    with open(source, "rb") as src:
        _atomic_write(Path(target), lambda f: shutil.copyfileobj(src, f))


def _atomic_write(path: Path, write: Any) -> None:
    """``write(file)`` into a temporary name beside ``path``, flushed to disk, then renamed over ``path``; the
    directory entry is flushed too. A crash mid-write never leaves a truncated file under the real name."""
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


def shards_directory(optimizer: ACCOOptimizer, directory: str | os.PathLike) -> Path:
    """Where this rank's shard file goes: ``directory``, or, when the engine's ranks hold one FSDP shard of the model
    (a part of the world, see ``Communicator.part``), its part's own folder ``fsdp_shard{k}_of_{K}``: the parts'
    ranks are numbered alike, and each part re-shards on its own."""
    part = optimizer.comm.part
    return Path(directory) if part is None else Path(directory) / f"fsdp_shard{part[0]}_of_{part[1]}"


def save_optimizer_state(optimizer: ACCOOptimizer, directory: str | os.PathLike) -> Path:
    """Write this rank's shard into ``directory`` (every rank calls it). Returns the file written."""
    directory = shards_directory(optimizer, directory)
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / shard_filename(optimizer.comm.rank, optimizer.comm.world_size)
    atomic_save(optimizer.state_dict(), path)
    return path


def load_optimizer_state(optimizer: ACCOOptimizer, directory: str | os.PathLike) -> None:
    """Load the shards in ``directory`` into ``optimizer`` (collective), re-sharding if the layout changed (another
    world size, or a checkpoint of an older chunk size): each rank then reads only its own ranges of the files."""
    layout, rank = optimizer.layout, optimizer.comm.rank
    try:
        part = optimizer.comm.part
        mismatch = fsdp_sharding_mismatch(directory, None if part is None else part[1])
        if mismatch:
            raise ValueError(mismatch)
        states = _read_shards(shards_directory(optimizer, directory), rank, layout.world_size, layout.chunk)
        settings = [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in optimizer.param_groups]
        states = [with_empty_groups(s, layout, settings) for s in states]  # hf_acco 0.1.0's ACCOTrainer shards
        meta = states[0]["layout"]
        same = meta["world_size"] == layout.world_size and meta["chunk"] == layout.chunk
        state = states[0] if same else reshard(states, layout, rank)
    except (ValueError, FileNotFoundError) as e:
        optimizer.raise_if_any_rank_failed(e)  # every rank raises, none waits in a collective
        raise
    optimizer.load_state_dict(state)


def import_torch_state(
    optimizer: ACCOOptimizer,
    read: Callable[[], tuple[dict[str, Any], int]],
    explain: Callable[[Exception], Exception],
) -> int:
    """A torch optimizer's ``state_dict()`` over the same parameters and groups into ``optimizer`` (collective):
    ``read()`` gives it and the optimizer steps it has done; each rank keeps its own ranges of the moments, each
    parameter's step count, the groups' hyper-parameters (as torch's ``load_state_dict``: the saved ones, ``betas``
    and ``eps`` too); the master weights are the model's parameters as they
    are now (the checkpoint's, loaded just before). A failure on any rank (``read`` or the state not this model's or
    optimizer's) raises ``explain(error)`` here and an explanation on every other rank; nothing is loaded.
    Returns the step count loaded."""
    error, state = None, None
    try:
        saved, steps = read()
        try:  # the keys this run's optimizer keeps (a custom one that cannot be probed: the ones it has)
            keys = optimizer_keys(optimizer.shard.inner, optimizer.shard.defaults, optimizer.device)
        except Exception:  # noqa: BLE001
            keys = None
        settings = {k for g in optimizer.shard.inner.param_groups for k in g}  # the inner optimizer's own (betas)
        state = shard_from_torch_state(
            optimizer.state_dict(), optimizer.layout, optimizer.comm.rank, saved, steps, keys, settings
        )
    except Exception as e:  # noqa: BLE001 - any failure (a damaged file too) on every rank, with what to do
        error = explain(e)
    optimizer.raise_if_any_rank_failed(error)
    assert state is not None  # (raised above otherwise)
    optimizer.load_state_dict(state)
    return int(state["step_count"])


def fsdp_sharding_mismatch(directory: str | os.PathLike, shards: int | None) -> str | None:
    """Why a run whose model FSDP shards over ``shards`` ranks per machine (None: no FSDP) cannot load the engine
    state in ``directory``, or None. The shards cover FSDP's local shards of the run that wrote them (a folder per
    FSDP shard index): another FSDP sharding (or none) has other local shapes. Another number of machines re-shards
    within each folder."""
    written = sorted(_part_folders(Path(directory)))
    if written == ([] if shards is None else [shards]):
        return None
    before = f"with FSDP over {written[0]} ranks per machine" if written else "without FSDP"
    now = f"FSDP over {shards} ranks per machine" if shards is not None else "no FSDP"
    return (
        f"The checkpoint {directory} was written {before}; this run has {now}, so each rank holds other pieces of "
        "the model. Resume with the FSDP configuration it was written with (dp_shard_size), on any number of "
        "machines; or start from its model files (from_pretrained) without the optimizer state."
    )


def shard_files(directory: str | os.PathLike) -> dict[int, dict[int, Path]]:
    """The optimizer shard files in ``directory``: {world size: {rank: path}}."""
    directory = Path(directory)
    found: dict[int, dict[int, Path]] = {}
    for f in directory.glob("acco_optimizer_rank*_of_*.pt") if directory.is_dir() else []:
        m = _SHARD_RE.match(f.name)
        if m:
            found.setdefault(int(m.group(2)), {})[int(m.group(1))] = f
    return found


def missing_shards(
    directory: str | os.PathLike, world_size: int | None = None, ranks: list[int] | None = None
) -> str | None:
    """Why the shard set in ``directory`` is incomplete for ``ranks`` of a run on ``world_size`` ranks (every rank's
    shard when they are not given, or when the checkpoint has another world size: re-sharding reads them all), or
    None. A per-node checkpoint (``save_on_each_node``, no shared file system) holds only its node's ranks."""
    parts = _part_folders(Path(directory))
    if parts:  # FSDP inside machines: a set of shards per FSDP shard index, each complete on its own
        return _missing_parts(parts)
    found = shard_files(directory)
    if not found:
        return "the ACCO optimizer shards acco_optimizer_rank*_of_*.pt (save_only_model?)"
    if len(found) > 1:
        return f"a single set of optimizer shards (it has several world sizes {sorted(found)})"
    ((world, files),) = found.items()
    needed = set(range(world)) if ranks is None or world != world_size else set(ranks)
    missing = sorted(needed - set(files))
    if missing and world_size is not None and world != world_size:
        return (
            f"the optimizer shards of ranks {missing} (of {world}), which a resume on {world_size} ranks needs: a "
            "per-node checkpoint (save_on_each_node=True)? Gather every node's shards into one directory first "
            "(python -m hf_acco.checkpoint gather --into DIR NODE_DIRS...), or resume on the same number of ranks"
        )
    return f"the optimizer shards of ranks {missing} (of {world})" if missing else None


def _part_folders(directory: Path) -> dict[int, dict[int, Path]]:
    """The ``fsdp_shard{k}_of_{K}`` folders in ``directory`` (see ``shards_directory``): {K: {k: path}}."""
    found: dict[int, dict[int, Path]] = {}
    for f in directory.glob("fsdp_shard*_of_*") if directory.is_dir() else []:
        m = _PART_RE.match(f.name)
        if m and f.is_dir():
            found.setdefault(int(m.group(2)), {})[int(m.group(1))] = f
    return found


def _missing_parts(parts: dict[int, dict[int, Path]]) -> str | None:
    if len(parts) > 1:
        return f"a single set of FSDP shard folders (it has several counts {sorted(parts)})"
    ((count, folders),) = parts.items()
    missing = sorted(set(range(count)) - set(folders))
    if missing:
        return f"the folders of FSDP shards {missing} (of {count})"
    for k in sorted(folders):
        why = missing_shards(folders[k])
        if why:
            return f"{why} in {folders[k].name}"
    return None


def gather_shards(sources: list[str | os.PathLike], into: str | os.PathLike) -> list[Path]:
    """Copy the optimizer shards of per-node checkpoints (``save_on_each_node``) into one directory, which then
    resumes on any number of ranks. Refuses sources of several world sizes, or a set that still lacks a rank."""
    into = Path(into)
    found: dict[int, dict[int, Path]] = {}
    for source in [into, *sources]:  # what ``into`` holds already (one node's own) counts; the sources add theirs
        for world, files in shard_files(source).items():
            found.setdefault(world, {}).update(files)
    if len(found) != 1:
        raise ValueError(
            f"Need the shards of one run: found world sizes {sorted(found)} in {[str(s) for s in sources]}."
        )
    ((world, files),) = found.items()
    missing = sorted(set(range(world)) - set(files))
    if missing:
        raise FileNotFoundError(f"The sources lack the optimizer shards of ranks {missing} (of {world}).")
    into.mkdir(parents=True, exist_ok=True)
    out = []
    for _, path in sorted(files.items()):
        target = into / path.name
        if path.resolve() != target.resolve():
            atomic_copy(path, target)
        out.append(target)
    return out


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
    if saved_world == world_size and rank in files:  # the same ranks: this rank's own file (all if the chunk changed)
        own = _read(files[rank])
        if own["layout"]["chunk"] == chunk:
            return [own]
    missing = sorted(set(range(saved_world)) - set(files))
    if missing and saved_world != world_size and files:
        raise FileNotFoundError(
            f"Resuming on {world_size} ranks from a checkpoint of {saved_world} needs every rank's optimizer shard; "
            f"{directory} lacks ranks {missing} (a per-node checkpoint, save_on_each_node=True?). Copy every node's "
            f"shards into one directory (python -m hf_acco.checkpoint gather --into DIR NODE_DIRS...) and resume "
            "from it, or resume on the same number of ranks."
        )
    if missing:
        raise FileNotFoundError(
            f"The checkpoint {directory} lacks the optimizer shards of ranks {missing} (of {saved_world}): it is "
            "incomplete. Resume from an earlier checkpoint."
        )
    return [_read(files[r]) for r in range(saved_world)]


def _read(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:  # noqa: BLE001 - turned into an actionable message
        raise ValueError(
            f"Could not read the ACCO optimizer shard {path} ({type(e).__name__}: {e}). The file is damaged; "
            "resume from an earlier checkpoint."
        ) from e
