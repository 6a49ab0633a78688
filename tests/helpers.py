"""Helpers the tests share (one definition each)."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_acco.comm.sharding import FlatLayout
from hf_acco.tools.multiprocess import free_port

ROOT = Path(__file__).resolve().parents[1]


def rel(a: torch.Tensor | Sequence[torch.Tensor], b: torch.Tensor | Sequence[torch.Tensor]) -> float:
    """Relative error ``|a - b| / |b|`` of two tensors, or of two lists of tensors taken as one vector, in float64."""
    flat = lambda x: x.flatten().double() if torch.is_tensor(x) else torch.cat([t.flatten().double() for t in x])  # noqa: E731
    fa, fb = flat(a), flat(b)
    return float((fa - fb).norm() / fb.norm())


def clones(model: torch.nn.Module) -> list[torch.Tensor]:
    """Detached copies of a model's parameters, in order: what it holds now."""
    return [p.detach().clone() for p in model.parameters()]


def load_script(path: Path):  # noqa: ANN201 - the script's module
    """A script that is no package's module (benchmarks/*.py), imported from its path."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"script_{path.stem}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # where dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def accelerate_launch(
    script: Path | str,
    *args: str,
    config: str = "accelerate_configs/cpu_2proc.yaml",
    timeout: float = 240,
    env: dict[str, str] | None = None,
    launcher_args: tuple[str, ...] = (),
) -> subprocess.CompletedProcess:
    """``accelerate launch --config_file CONFIG SCRIPT ARGS`` from the project root, on a port of its own, asserted
    to exit 0. A run still going after ``timeout`` seconds is a hang: every process of the launch (the launcher
    and its ranks) gets SIGABRT, which makes faulthandler print each thread's stack, and the assertion shows
    them. The timeout stays under pytest's own (setup.cfg) so that this report, not pytest's, is the one seen."""
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(ROOT / config)]
    cmd = [*launcher, *launcher_args, "--main_process_port", str(free_port()), str(script), *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1", **(env or {})}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        # torchrun starts each rank in a session of its own: signal the launcher's whole tree, ranks first
        tree = [*descendants(proc.pid), proc.pid]
        native = "\n".join(native_stacks(pid) for pid in tree)  # where C++ waits (a destructor, a lock, the GIL)
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGABRT)
        time.sleep(10)  # faulthandler writes the stacks; torchrun reports its ranks' ends
        for pid in tree:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(
            f"`{' '.join(cmd)}` still ran after {timeout:.0f} s; its stacks:\n{err[-12000:]}\n{native[-12000:]}"
        ) from None
    done = subprocess.CompletedProcess(cmd, proc.returncode, out, err)
    assert done.returncode == 0, out[-3000:] + err[-3000:]
    return done


def descendants(pid: int) -> list[int]:
    """Every living process below ``pid`` (children first, then theirs), read from /proc."""
    parents = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, ValueError, IndexError):
            parents[int(stat.parent.name)] = int(stat.read_text().rsplit(")", 1)[1].split()[1])
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for child, parent in parents.items() if parent in frontier]
        found += frontier
    return found


# ---- a one-rank communicator, for the round's body alone (its signatures: tests/test_parts.py) ----------------


class _Done:
    def wait(self) -> None:
        pass


class FakeComm:
    """The collectives of one rank alone: sums over one rank are the rank's own values."""

    rank, world_size, part = 0, 1, None

    def __init__(self) -> None:
        self.calls: list[str] = []

    def guard(self, what: str) -> contextlib.AbstractContextManager:
        return contextlib.nullcontext()

    def all_reduce(self, tensor: torch.Tensor, op=None, async_op: bool = False):
        self.calls.append("all_reduce")
        return _Done() if async_op else None

    def all_reduce_norms(self, tensor: torch.Tensor) -> None:
        self.calls.append("all_reduce_norms")

    def all_reduce_counts(self, counts: list[float]) -> list[float]:
        self.calls.append("all_reduce_counts")
        return list(counts)

    def reduce_scatter(self, layout: FlatLayout, flat: torch.Tensor, shard: torch.Tensor, feedback=None) -> None:
        self.calls.append("reduce_scatter")
        shard.copy_(flat.view(layout.num_buckets, 1, layout.chunk)[:, 0])  # shard: (num_buckets, chunk)

    def all_gather(self, layout: FlatLayout, shard: torch.Tensor | None, flat: torch.Tensor) -> None:
        self.calls.append("all_gather")  # one rank: its pieces are already in place


def native_stacks(pid: int) -> str:
    """Each thread's C/C++ stack of a living process, function names only (gdb, where the machine has it and may
    attach): what faulthandler cannot show, such as a destructor waiting on a thread that waits for the GIL."""
    gdb = shutil.which("gdb")
    if gdb is None:
        return f"[process {pid}: no gdb on this machine for its native stacks]"
    try:
        text = subprocess.run(
            [gdb, "-p", str(pid), "-batch", "-ex", "thread apply all bt 16"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout
    except subprocess.TimeoutExpired:
        return f"[process {pid}: gdb did not answer in 20 s]"
    frame = re.compile(r"^(#\d+)\s+(?:0x[0-9a-f]+ in )?([^ (]+)")
    lines = []
    for line in text.splitlines():
        if line.startswith("Thread "):
            lines.append(line)
        elif m := frame.match(line):
            lines.append(f"  {m.group(1)} {m.group(2)}")
    return f"[process {pid}: native stacks]\n" + "\n".join(lines)


class HostReads(TorchDispatchMode):
    """Counts, into ``counts[-1]``, every tensor read on the host in its scope (``.item()``, ``float()``:
    aten._local_scalar_dense, a device sync on a GPU) of the thread it is entered on, except while ``ignore()``."""

    def __init__(self, counts: list[int], ignore=lambda: False) -> None:  # noqa: ANN001
        super().__init__()
        self.counts, self.ignore = counts, ignore

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if func is torch.ops.aten._local_scalar_dense.default and not self.ignore():
            self.counts[-1] += 1
        return func(*args, **(kwargs or {}))
