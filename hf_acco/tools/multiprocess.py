"""Run a function on N forked gloo ranks on this machine and collect what each returns (tests, benchmarks).

Like ``accelerate.debug_launcher`` but returning results: each rank writes its result (or its traceback) to a
file; the parent kills every rank as soon as one fails or the timeout passes, so a mismatched collective fails
instead of hanging. Fork start: set ``OMP_NUM_THREADS=1`` before torch is imported in the parent.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist


def _entry(
    fn: Callable, rank: int, world_size: int, backend: str | None, store_path: str, out_path: str, kwargs: dict
) -> None:
    try:
        torch.set_num_threads(1)
        state = sys.modules.get("accelerate.state")
        if state is not None:  # a launcher state the parent set up (e.g. by building TrainingArguments) is not ours
            state.AcceleratorState._reset_state(reset_partial_state=True)
        if backend is None:  # the launcher's environment; the function (e.g. Accelerate) initialises the group
            os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size))
            os.environ.update(LOCAL_WORLD_SIZE=str(world_size))
        else:
            if backend == "nccl":
                torch.cuda.set_device(rank % torch.cuda.device_count())
            store = dist.FileStore(store_path, world_size)
            dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
        result = fn(rank, world_size, **kwargs)
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
        _write(out_path, {"ok": True, "result": result})
    except BaseException:  # noqa: BLE001 - report everything to the parent
        _write(out_path, {"ok": False, "error": traceback.format_exc()})
        os._exit(1)
    os._exit(0)


def _write(path: str, obj: dict) -> None:
    """Write then rename: the parent may kill this process at any moment, and must never read half a file."""
    torch.save(obj, path + ".tmp")
    os.replace(path + ".tmp", path)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (for a rendezvous store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(
    fn: Callable[..., Any],
    world_size: int = 2,
    timeout: float = 240.0,
    backend: str = "gloo",
    start_method: str = "fork",
    fail_fast: bool = True,
    **kwargs: Any,
) -> list[Any]:
    """``fn(rank, world_size, **kwargs)`` on ``world_size`` processes; returns their results by rank.

    ``fail_fast=False`` lets the other ranks run on when one fails (to watch how they react), until the timeout.
    ``backend=None`` sets the environment a launcher would (RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...) and leaves
    initialising the process group to ``fn`` (e.g. to Accelerate). Use ``start_method="spawn"`` (and a
    module-level ``fn``) once CUDA may be initialised: CUDA does not survive a fork.
    """
    ctx: Any = mp.get_context(start_method)  # fork or spawn (the base type declares no Process)
    if backend is None:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ["MASTER_PORT"] = str(free_port())
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        outs = [os.path.join(tmp, f"rank{r}.pt") for r in range(world_size)]
        procs = [
            ctx.Process(target=_entry, args=(fn, r, world_size, backend, store, outs[r], kwargs))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        try:
            while any(p.is_alive() for p in procs):
                failed = fail_fast and any(p.exitcode not in (None, 0) for p in procs)
                if failed or time.monotonic() > deadline:
                    break
                time.sleep(0.02)
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
                p.join()
        results, errors = [], []
        for r, path in enumerate(outs):
            if not os.path.exists(path):
                errors.append(f"rank {r}: no result (exit code {procs[r].exitcode}; killed after timeout?)")
                continue
            data = torch.load(path, weights_only=False)
            if data["ok"]:
                results.append(data["result"])
            else:
                errors.append(f"rank {r}:\n{data['error']}")
        if errors:
            raise RuntimeError("\n".join(errors))
        return results
