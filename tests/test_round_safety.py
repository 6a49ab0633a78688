"""Rounds that stay safe when ranks fail or are out of step (2 gloo ranks): what NCCL would hang or misreport.

The order a round keeps on every backend: its counts go first, on the host group; only then its device
collectives. A rank's own error (out of memory) surfaces as itself; a peer's death as PeerFailure. A process
that fails while its round waits on a hung peer exits at once. Loading a state waits for the round in flight
before any collective of the main thread.
"""

from __future__ import annotations

import datetime
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

from hf_acco import ACCOOptimizer
from hf_acco.comm.communicator import Communicator
from hf_acco.tools.multiprocess import run_ranks

from .helpers import clones
from .models import batch, decay_groups, mean_loss, tiny_llama

ROOT = Path(__file__).resolve().parents[1]


def _steps(model, opt, rank: int, start: int, count: int) -> None:
    for t in range(start, start + count):
        for i in range(2):
            mean_loss(model, batch(rank, 2 * t + i))[0].backward()
            opt.after_backward()
        opt.step()


class LateRank1(Communicator):
    """Rank 1 starts each round 0.3 s late: its main thread runs ahead of its round thread."""

    def all_reduce_counts(self, counts):
        if self.rank == 1:
            time.sleep(0.3)
        return super().all_reduce_counts(counts)


def _load_with_a_round_in_flight(rank: int, world_size: int) -> bool:
    model = tiny_llama()
    opt = ACCOOptimizer(decay_groups(model, 0.1), micro_batches=2, lr=1e-3, communicator=LateRank1())
    _steps(model, opt, rank, 0, 4)
    with opt.committed_parameters():
        straight = clones(model)
    opt.close()
    model = tiny_llama()
    opt = ACCOOptimizer(decay_groups(model, 0.1), micro_batches=2, lr=1e-3, communicator=LateRank1())
    _steps(model, opt, rank, 0, 2)
    saved = opt.state_dict()
    _steps(model, opt, rank, 2, 2)
    opt.load_state_dict(saved)  # the commit round of step 4 is in flight, and on rank 1 it has not started yet
    _steps(model, opt, rank, 2, 2)
    with opt.committed_parameters():
        resumed = clones(model)
    opt.close()
    return all(torch.equal(a, b) for a, b in zip(straight, resumed))


def test_loading_a_state_while_a_round_is_in_flight_waits_for_it() -> None:
    """Without the wait, rank 0's round and rank 1's main thread each issue the next collective on the round's
    group, and the two ranks pair different collectives (an error or a hang)."""
    assert run_ranks(_load_with_a_round_in_flight, timeout=120) == [True, True]


class OutOfMemoryOnRank0(Communicator):
    """Rank 0 runs out of memory in the reduce-scatter of its second round."""

    rounds = 0

    def reduce_scatter(self, layout, flat, shard):
        self.rounds += 1
        if self.rank == 0 and self.rounds == 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (injected)")
        super().reduce_scatter(layout, flat, shard)


def _train_until_failure(rank: int, world_size: int) -> None:
    model = tiny_llama()
    comm = OutOfMemoryOnRank0(timeout=datetime.timedelta(seconds=120))
    opt = ACCOOptimizer(decay_groups(model, 0.1), micro_batches=2, lr=1e-3, communicator=comm)
    start = time.monotonic()
    try:
        _steps(model, opt, rank, 0, 6)
    except Exception as e:  # report what each rank saw, and when
        raise RuntimeError(
            f"rank {rank} stopped after {time.monotonic() - start:.1f} s with {type(e).__name__}"
        ) from e


def test_out_of_memory_in_a_round_surfaces_as_itself_and_the_peer_stops_in_bounded_time() -> None:
    try:
        run_ranks(_train_until_failure, fail_fast=False, timeout=100)
    except RuntimeError as e:
        report = str(e)
    else:
        raise AssertionError("both ranks trained on")
    rank0, rank1 = report.split("rank 1:\n")
    assert "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB (injected)" in rank0
    assert "(in ACCO's commit round 0, on rank 0 of 2, " in rank0  # where it happened
    assert "PeerFailure" not in rank0
    assert "PeerFailure: ACCO" in rank1 and "peer rank(s) [0] died or did not answer" in rank1
    seconds = float(rank1.split("rank 1 stopped after ")[1].split(" s")[0])
    assert seconds < 60, seconds  # the dead peer's closed connection, not the 120 s timeout


def test_a_rank_that_fails_while_its_round_waits_on_a_hung_peer_exits_at_once(tmp_path: Path) -> None:
    """Before, exiting joined the round's thread until its collective timed out (acco_comm_timeout_s, 30 min by
    default; 60 s here)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    script = str(ROOT / "tests/scripts/stuck_round.py")
    store = str(tmp_path / "store")
    hung = subprocess.Popen([sys.executable, script, "1", store, "60"], env=env, stdout=subprocess.DEVNULL)
    try:
        failing = subprocess.run(
            [sys.executable, script, "0", store, "60"], env=env, capture_output=True, text=True, timeout=120
        )
        exited = time.time()
    finally:
        hung.kill()
        hung.wait()
    assert failing.returncode == 1, failing.stderr[-2000:]
    assert "RuntimeError: the training loop failed" in failing.stderr
    raised = float(failing.stdout.split("raising at ")[1])
    assert exited - raised < 30, exited - raised  # measured 1.4 s; the old thread join: the 60 s timeout
