"""Failures lose nothing and hang nothing: dead peers, crashes while saving, pre-emption, non-finite gradients."""

from __future__ import annotations

import json
import os
import random
import socket
import time
from pathlib import Path

import pytest
import torch
from transformers.trainer_utils import get_last_checkpoint

from hf_acco import ACCOOptimizer
from hf_acco.integrations.trainer import checkpoint_incomplete
from hf_acco.tools.multiprocess import run_ranks

from .doubles import DelayedCommunicator
from .models import batch, decay_groups, mean_loss, tiny_llama
from .test_trainer import flat, train

FAULT_TIMEOUTS = {"acco_comm_timeout_s": 20, "ddp_timeout": 20, "logging_steps": 100}


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> list[dict]:
    """12 steps without a fault: what every resumed run must equal."""
    return train(tmp_path_factory.mktemp("straight"), acco=True)


def test_killed_peer_gives_a_clear_error_in_bounded_time_and_the_last_checkpoint_resumes(
    tmp_path: Path, straight: list[dict]
) -> None:
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        train(tmp_path, acco=True, save_steps=2, kill_rank1_at_step=5, extra=FAULT_TIMEOUTS, fail_fast=False)
    elapsed = time.monotonic() - start
    text = str(info.value)
    assert "rank 1: no result (exit code -9" in text  # SIGKILL
    host = socket.gethostname()  # the message names the machine: which one to look at in a multi-node job
    assert f"PeerFailure: Training stopped on rank 0 ({host}): peer rank(s) [1] died or stopped answering" in text
    assert "checkpoint-4; restart all ranks with resume_from_checkpoint=True" in text
    assert elapsed < 60, elapsed  # not the 20 s timeout plus a hang: gloo sees the closed connection at once
    assert checkpoint_incomplete(str(tmp_path / "checkpoint-4")) is None
    resumed = train(tmp_path, acco=True, resume="last")
    for r in range(2):
        assert torch.equal(flat(resumed[r]["params"]), flat(straight[r]["params"]))


def test_hung_peer_is_reported_after_the_timeout(tmp_path: Path) -> None:
    """Rank 1 stops answering (SIGSTOP) but its sockets stay open: rank 0 gives up after the 5 s timeouts."""
    timeouts = {**FAULT_TIMEOUTS, "acco_comm_timeout_s": 5, "ddp_timeout": 5}
    start = time.monotonic()
    with pytest.raises(RuntimeError) as info:
        train(tmp_path, acco=True, stop_rank1_at_step=3, extra=timeouts)  # fail_fast: rank 0's error ends the run
    elapsed = time.monotonic() - start
    host = socket.gethostname()
    assert f"Training stopped on rank 0 ({host}): peer rank(s) [1] died or stopped answering" in str(info.value)
    assert 5 <= elapsed < 45, elapsed


def test_crash_while_saving_leaves_the_previous_checkpoint_as_the_latest(tmp_path: Path, straight: list[dict]) -> None:
    with pytest.raises(RuntimeError):
        train(tmp_path, acco=True, save_steps=2, kill_rank1_in_checkpoint=4, extra=FAULT_TIMEOUTS, fail_fast=False)
    partial = tmp_path / "checkpoint-4"
    assert partial.is_dir() and "no trainer_state.json" in checkpoint_incomplete(str(partial))
    assert get_last_checkpoint(str(tmp_path)) == str(partial)  # what plain Trainer would resume from
    with pytest.raises(
        RuntimeError, match="Can't find a valid checkpoint at .*checkpoint-4: it has no trainer_state.json"
    ):
        train(tmp_path / "explicit", acco=True, resume=str(partial))
    resumed = train(tmp_path, acco=True, resume="last")  # skips checkpoint-4, resumes checkpoint-2
    for r in range(2):
        assert torch.equal(flat(resumed[r]["params"]), flat(straight[r]["params"]))


def test_sigterm_preemption_checkpoint_is_consistent_and_resumes_exactly(tmp_path: Path) -> None:
    """transformers' JIT checkpoint: SIGTERM, a 3 s grace, then every rank saves at the same step and stops."""
    extra = {"enable_jit_checkpoint": True}
    reference = train(tmp_path / "reference", acco=True, max_steps=40, extra=extra)
    stopped = train(tmp_path, acco=True, max_steps=40, sigterm_at_step=2, step_sleep=0.25, extra=extra)
    steps = [h["step"] for h in stopped[0]["log_history"] if "loss" in h]
    assert 2 < steps[-1] < 40  # stopped early
    checkpoint = get_last_checkpoint(str(tmp_path))
    assert checkpoint_incomplete(checkpoint) is None
    shards = [torch.load(Path(checkpoint) / f"acco_optimizer_rank{r}_of_2.pt", weights_only=True) for r in range(2)]
    assert shards[0]["step_count"] == shards[1]["step_count"] == int(checkpoint.rsplit("-", 1)[1])
    resumed = train(tmp_path, acco=True, max_steps=40, resume="last", extra=extra)
    for r in range(2):
        assert torch.equal(flat(resumed[r]["params"]), flat(reference[r]["params"]))


def test_the_jit_checkpoints_sentinel_is_gone_before_transformers_looks_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers' JIT checkpoint removes its sentinel on every rank with a check, then a remove: where the ranks
    share the output directory another rank can remove it in between, and this rank's remove fails. Simulated in one
    process: the check reports the file and it is gone at once, as when another rank removes it then."""
    from types import SimpleNamespace

    from transformers.trainer_jit_checkpoint import CheckpointManager

    from hf_acco.integrations.trainer.checkpoints import JIT_SENTINEL, _JITAgreement

    saved = []
    trainer = SimpleNamespace(state=SimpleNamespace(global_step=7), _get_output_dir=lambda trial: str(tmp_path))
    trainer._save_checkpoint = lambda model, trial: saved.append(model)  # what the class method would do
    sentinel = tmp_path / "checkpoint-7" / JIT_SENTINEL
    exists = os.path.exists

    def another_rank_removes_it_now(path: str) -> bool:
        found = exists(path)
        if found and os.path.abspath(path) == str(sentinel):
            os.remove(path)
        return found

    monkeypatch.setattr(os.path, "exists", another_rank_removes_it_now)
    trainer.model = "model"
    with pytest.raises(FileNotFoundError):  # transformers' own, as it is
        CheckpointManager(trainer).execute_jit_checkpoint()
    manager = CheckpointManager(trainer)
    _JITAgreement(trainer, manager)  # type: ignore[arg-type]
    manager.execute_jit_checkpoint()
    assert saved == ["model", "model"] and not exists(sentinel)
    assert trainer._save_checkpoint.__name__ == "<lambda>"  # the trainer's own save is put back


def nan_run(rank: int, world_size: int, nonfinite: str) -> dict:
    model = tiny_llama()
    opt = ACCOOptimizer(decay_groups(model, 0.1), lr=1e-2, micro_batches=4, max_grad_norm=1.0, nonfinite=nonfinite)
    committed = []
    try:
        for t in range(6):
            for i in range(4):
                loss = mean_loss(model, batch(rank, t * 4 + i))[0]
                if rank == 1 and t == 3 and i == 0:
                    loss = loss * float("nan")  # one bad micro-batch on one rank, in half A of step 3
                loss.backward()
                opt.after_backward()
            opt.step()
            with opt.committed_parameters():
                committed.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    except FloatingPointError as e:
        return {"error": str(e)}
    finally:
        opt.close()
    return {"committed": committed, "skipped": opt.totals["skipped_steps"]}


def test_nonfinite_gradient_step_is_skipped_on_every_rank() -> None:
    results = run_ranks(nan_run, nonfinite="skip")
    for r in results:
        assert r["skipped"] == 1.0
        assert all(torch.isfinite(c).all() for c in r["committed"])
        assert torch.equal(r["committed"][3], r["committed"][2])  # step 3 did not move θ
        assert not torch.equal(r["committed"][4], r["committed"][3])  # training went on
    assert all(torch.equal(a, b) for a, b in zip(results[0]["committed"], results[1]["committed"]))


def test_nonfinite_gradient_can_stop_every_rank_with_an_error() -> None:
    results = run_ranks(nan_run, nonfinite="error")
    assert all("is not finite" in r["error"] for r in results)


def test_fault_free_runs_write_complete_checkpoints(tmp_path: Path) -> None:
    train(tmp_path, acco=True, save_steps=4)
    for step in (4, 8, 12):
        assert checkpoint_incomplete(str(tmp_path / f"checkpoint-{step}")) is None
    state = json.loads((tmp_path / "checkpoint-12" / "trainer_state.json").read_text())
    assert state["global_step"] == 12


class JitteredCommunicator(DelayedCommunicator):
    """Rounds that take a random extra 0-20 ms (seeded per rank)."""

    def __init__(self, seed: int) -> None:
        super().__init__(0.0)
        self.rng = random.Random(seed)

    def reduce_scatter(self, *args, **kwargs) -> None:
        self.delay_s = self.rng.uniform(0.0, 0.02)
        super().reduce_scatter(*args, **kwargs)


def soak_rank(rank: int, world_size: int, micro_batches: int) -> dict:
    rng = random.Random(100 + rank)
    model = tiny_llama()
    opt = ACCOOptimizer(
        decay_groups(model, 0.1), lr=1e-3, accumulation="dynamic", communicator=JitteredCommunicator(rank)
    )
    for index in range(micro_batches):
        if rank == 1:
            time.sleep(rng.uniform(0.0, 0.008))  # a slow, jittery rank
        mean_loss(model, batch(rank, index % 64))[0].backward()
        opt.after_backward()
        if opt.ready_to_step():
            opt.step()
    opt.finalize()
    params = torch.cat([p.detach().flatten() for p in model.parameters()])
    opt.close()
    return {
        "params": params,
        "local": opt.totals["micro_batches"],
        "global_sum": opt.totals["global_micro_batches"],
        "steps": opt.step_count,
    }


@pytest.mark.slow
def test_soak_dynamic_mode_with_a_jittery_slow_rank() -> None:
    """2 ranks x 1500 micro-batches, dynamic: no deadlock, identical parameters, every micro-batch counted once."""
    results = run_ranks(soak_rank, micro_batches=1500, timeout=600)
    assert torch.equal(results[0]["params"], results[1]["params"])
    assert torch.isfinite(results[0]["params"]).all()
    assert [r["local"] for r in results] == [1500, 1500]
    assert results[0]["global_sum"] == results[1]["global_sum"] == 3000  # the rounds' global counts add up
    assert results[0]["steps"] == results[1]["steps"]
