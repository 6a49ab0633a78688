"""An engine's process groups live as long as it does; a failed load with a round in flight says so and does not hang;
settings that break the GPU path are named (2 gloo ranks)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hf_acco import ACCOOptimizer
from hf_acco.comm.groups import round_group_options, warn_if_one_hardware_queue
from hf_acco.engine.checkpoint import load_optimizer_state, save_optimizer_state, shard_filename
from hf_acco.tools.multiprocess import run_ranks

from .doubles import DelayedCommunicator
from .models import batch, mean_loss, tiny_llama


def _groups() -> int:
    return len(dist.distributed_c10d._world.pg_map)


def build_and_close(rank: int, world_size: int) -> list[int]:
    counts = [_groups()]
    model = tiny_llama()
    for _ in range(5):
        opt = ACCOOptimizer(model.parameters(), micro_batches=2, lr=1e-3)
        for i in range(2):
            mean_loss(model, batch(rank, i))[0].backward()
            opt.after_backward()
        opt.step()
        opt.finalize()
        opt.close()
        counts.append(_groups())
    opt.reopen()  # a closed engine trains again (Trainer: train() twice) on new groups
    for i in range(2):
        mean_loss(model, batch(rank, i))[0].backward()
        opt.after_backward()
    opt.step()
    opt.close()
    counts.append(_groups())
    return counts


def test_closed_engines_leave_no_process_group_behind() -> None:
    """Retries and repeated trainers build engines again and again: on NCCL every group left alive holds a
    communicator (device memory, a proxy thread)."""
    for counts in run_ranks(build_and_close):
        assert len(set(counts)) == 1, counts


def load_with_a_round_in_flight(rank: int, world_size: int, directory: str) -> str:
    model = tiny_llama()
    comm = DelayedCommunicator(0.5)  # the round is still running when the load starts
    opt = ACCOOptimizer(model.parameters(), micro_batches=2, lr=1e-3, communicator=comm)
    for i in range(2):
        mean_loss(model, batch(rank, i))[0].backward()
        opt.after_backward()
    opt.step()
    assert opt.rounds.current is not None
    try:
        load_optimizer_state(opt, directory)
        return "loaded"
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    finally:
        opt.close()


def save_two_steps(rank: int, world_size: int, directory: str) -> None:
    model = tiny_llama()
    opt = ACCOOptimizer(model.parameters(), micro_batches=2, lr=1e-3)
    for t in range(2):
        for i in range(2):
            mean_loss(model, batch(rank, 2 * t + i))[0].backward()
            opt.after_backward()
        opt.step()
    save_optimizer_state(opt, directory)
    opt.close()


def test_a_failed_load_waits_for_the_round_in_flight_and_fails_on_every_rank(tmp_path: Path) -> None:
    """The load's error path agrees on the failure with a collective on the round's group: only once the round in
    flight is over (two threads on one group can pair their collectives differently on each rank: a hang)."""
    run_ranks(save_two_steps, directory=str(tmp_path))
    (tmp_path / shard_filename(1, 2)).write_bytes(b"damaged")
    got = run_ranks(load_with_a_round_in_flight, directory=str(tmp_path), timeout=60)
    assert "Another rank could not load" in got[0] and "is damaged" in got[1], got


def test_one_hardware_queue_is_named(monkeypatch) -> None:
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with pytest.warns(UserWarning, match="CUDA_DEVICE_MAX_CONNECTIONS=1"):
        warn_if_one_hardware_queue(torch.device("cuda", 0))
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_if_one_hardware_queue(torch.device("cuda", 0))
        warn_if_one_hardware_queue(torch.device("cpu"))
    assert caught == []


def test_only_an_nccl_round_group_gets_options() -> None:
    assert round_group_options("gloo") is None


def test_the_rounds_ctas_are_capped_where_asked_and_a_bad_cap_is_refused(monkeypatch) -> None:
    """HF_ACCO_ROUND_MAX_CTAS caps the round's NCCL communicators' CTAs (``ProcessGroupNCCL.Options.config``; a
    stand-in for the options here: this torch build may have no NCCL); a value NCCL cannot take is refused, on
    every backend, before any group is made."""
    from types import SimpleNamespace

    from hf_acco.comm.groups import MAX_CTAS, cap_ctas, round_max_ctas

    options = SimpleNamespace(config=SimpleNamespace(max_ctas=-1))
    monkeypatch.delenv(MAX_CTAS, raising=False)
    assert round_max_ctas() is None and cap_ctas(options, round_max_ctas()).config.max_ctas == -1
    monkeypatch.setenv(MAX_CTAS, "8")
    assert cap_ctas(options, round_max_ctas()).config.max_ctas == 8
    for bad in ("0", "65", "eight", "-4"):
        monkeypatch.setenv(MAX_CTAS, bad)
        with pytest.raises(ValueError, match="a whole number from 1 to 64"):
            round_group_options("gloo")


@pytest.mark.skipif(not dist.is_nccl_available(), reason="this torch build has no NCCL")
def test_the_rounds_nccl_group_has_a_high_priority_stream(monkeypatch) -> None:
    assert round_group_options("nccl").is_high_priority_stream
    monkeypatch.setenv("HF_ACCO_ROUND_MAX_CTAS", "4")
    assert round_group_options("nccl").config.max_ctas == 4


def build_with_interface(rank: int, world_size: int, interface: str) -> str:
    import os

    os.environ["GLOO_SOCKET_IFNAME"] = interface  # read by gloo when a group is made: after the default group
    try:
        ACCOOptimizer(tiny_llama().parameters(), micro_batches=2, lr=1e-3).close()
        return "built"
    except RuntimeError as e:
        return str(e)


def test_a_gloo_group_that_cannot_be_made_names_the_interface() -> None:
    """A wrong network interface: every rank fails at once with what to set, not a bare gloo error."""
    for message in run_ranks(build_with_interface, interface="hfacco-none0", timeout=60):
        assert "GLOO_SOCKET_IFNAME='hfacco-none0'" in message and "Unable to find address" in message, message
        assert "set GLOO_SOCKET_IFNAME on every node" in message.replace("Set", "set")
