"""Saving and loading the engine's state as per-rank optimizer shard files, re-sharded on load (the files'
names, reading and atomic writing: ``shard_files.py``).

One file per rank holds that rank's ``ACCOOptimizer.state_dict()`` (master shard, optimizer state shard, the
model's in-flight estimate shard, counters and the layout).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from hf_acco.engine.core import ACCOOptimizer
from hf_acco.engine.shard_files import (
    atomic_copy,
    atomic_save,
    part_folder,
    part_folders,
    read_shard,
    shard_filename,
    shard_files,
)
from hf_acco.engine.shard_state import reshard, with_empty_groups
from hf_acco.engine.torch_format import optimizer_keys, shard_from_torch_state


def shards_directory(optimizer: ACCOOptimizer, directory: str | os.PathLike) -> Path:
    """Where this rank's shard file goes: ``directory``, or, when the engine's ranks hold one FSDP shard of the model
    (a part of the world, see ``Communicator.part``), its part's own folder ``fsdp_shard{k}_of_{K}``: the parts'
    ranks are numbered alike, and each part re-shards on its own."""
    return part_folder(directory, optimizer.comm.part)


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
    written = sorted(part_folders(Path(directory)))
    if written == ([] if shards is None else [shards]):
        return None
    before = f"with FSDP over {written[0]} ranks per machine" if written else "without FSDP"
    now = f"FSDP over {shards} ranks per machine" if shards is not None else "no FSDP"
    return (
        f"The checkpoint {directory} was written {before}; this run has {now}, so each rank holds other pieces of "
        "the model. Resume with the FSDP configuration it was written with (dp_shard_size), on any number of "
        "machines; or start from its model files (from_pretrained) without the optimizer state."
    )


def missing_shards(
    directory: str | os.PathLike, world_size: int | None = None, ranks: list[int] | None = None
) -> str | None:
    """Why the shard set in ``directory`` is incomplete for ``ranks`` of a run on ``world_size`` ranks (every rank's
    shard when they are not given, or when the checkpoint has another world size: re-sharding reads them all), or
    None. A per-node checkpoint (``save_on_each_node``, no shared file system) holds only its node's ranks."""
    parts = part_folders(Path(directory))
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
        own = read_shard(files[rank])
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
    return [read_shard(files[r]) for r in range(saved_world)]
