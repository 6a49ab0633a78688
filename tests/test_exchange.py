"""The rounds' all-gathers (exchange.py: point to point on gloo for the packed changes, the collective for a round's
output), and the profile of a round that measured them."""

from __future__ import annotations

import sys

import pytest
import torch

from hf_acco.tools.multiprocess import run_ranks

from .helpers import load_script


def _gathers(rank: int, world_size: int, dtype: torch.dtype, point_to_point: bool = True) -> dict:
    import torch.distributed as dist

    from hf_acco.comm.exchange import Exchange, all_gather_into

    group = dist.new_group()
    n, buckets = 1000 + 7 * world_size, 5
    mine = [torch.randn(n, generator=torch.Generator().manual_seed(100 * rank + b)).to(dtype) for b in range(buckets)]
    # several buckets in flight at once on one group, each with its own tag, waited for in reverse order; the even
    # buckets send this rank's own row of the output in place, the odd ones a tensor apart (99: a value none sends)
    outs = [torch.full((world_size * n,), 99, dtype=dtype) for _ in range(buckets)]
    handles = []
    for b, out in enumerate(outs):
        own = out.view(world_size, n)[rank]
        if b % 2 == 0:
            own.copy_(mine[b])
        handles.append(
            all_gather_into(out, own if b % 2 == 0 else mine[b], group, tag=b, point_to_point=point_to_point)
        )
    for handle in reversed(handles):
        handle.wait()
    expected = [torch.empty(world_size * n, dtype=dtype) for _ in range(buckets)]
    for b in range(buckets):
        dist.all_gather_into_tensor(expected[b], mine[b], group=group)
    return {
        "equal": all(torch.equal(o, e) for o, e in zip(outs, expected)),
        "point_to_point": [isinstance(h, Exchange) for h in handles],
    }


@pytest.mark.parametrize(("world_size", "dtype"), [(2, torch.float32), (3, torch.bfloat16), (4, torch.int8)])
def test_the_point_to_point_all_gather_gives_the_collectives_bits(world_size: int, dtype: torch.dtype) -> None:
    results = run_ranks(_gathers, world_size=world_size, dtype=dtype)  # int8: the packed changes of deltas.py
    assert all(r["equal"] and all(r["point_to_point"]) for r in results)


def _round_gather(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from hf_acco.comm import communicator as comm_module
    from hf_acco.comm.communicator import Communicator
    from hf_acco.comm.sharding import FlatLayout

    params = [torch.zeros(300), torch.zeros(41)]
    layout = FlatLayout(params, ["w", "b"], [0, 0], world_size, bucket_numel=64)
    communicator = Communicator()
    flat = torch.zeros(layout.num_buckets * layout.bucket_size)
    for b in range(layout.num_buckets):
        layout.piece(flat, b, rank).fill_(rank + 1)
    spelled = []
    inner = comm_module.all_gather_into

    def spy(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        spelled.append(kwargs.get("point_to_point", True))
        return inner(*args, **kwargs)

    comm_module.all_gather_into = spy
    try:
        communicator.all_gather(layout, None, flat)
    finally:
        comm_module.all_gather_into = inner
    rows = flat.view(layout.num_buckets, world_size, layout.chunk)
    filled = all(bool((rows[:, r] == r + 1).all()) for r in range(world_size))
    communicator.destroy()
    dist.barrier()
    return {"filled": filled, "point_to_point": spelled, "buckets": layout.num_buckets}


def test_a_rounds_output_is_all_gathered_by_gloos_own_collective() -> None:
    """Communicator.all_gather (a round's exact output): the collective on gloo, every bucket, every rank's pieces.
    Point to point it took less CPU but made the round longer beside the compute (exchange.py)."""
    results = run_ranks(_round_gather, world_size=2)
    assert all(r["filled"] and r["point_to_point"] == [False] * r["buckets"] for r in results)
    assert results[0]["buckets"] > 1


def test_the_round_cpu_profile_times_every_component_of_a_round(tmp_path) -> None:  # noqa: ANN001
    """benchmarks/round_cpu.py instruments the engine's own methods: each is called as often as a round calls it."""
    import json
    from pathlib import Path

    module = load_script(Path(__file__).resolve().parent.parent / "benchmarks" / "round_cpu.py")
    module.main(["--rounds", "8", "--out", str(tmp_path / "round_cpu.json")])
    parts = json.loads((tmp_path / "round_cpu.json").read_text())["components"]
    calls = {label: part["calls_per_round"] for label, part in parts.items()}
    assert calls == {
        "counts (host all-reduce)": 1.0,
        "reduce-scatter": 1.0,
        "global norm (with its all-reduce)": 1.0,
        "AdamW estimate (estimate rounds)": 0.5,
        "AdamW step (commit rounds)": 0.5,
        "all-gather": 1.0,
        "whole round": 1.0,
    }
    assert all(0 < part["thread_ms"] <= part["process_ms"] + 1e-6 for part in parts.values())
    switches = json.loads((tmp_path / "round_cpu.json").read_text())["context_switches_per_round"]
    if sys.platform.startswith("linux"):  # gloo's worker thread is woken for every collective of a round
        assert switches > 0
    else:
        assert switches is None


def test_an_exchange_waits_for_its_last_message_first() -> None:
    """Exchange.wait: every work, the last posted first (one blocking wait where messages arrive in order)."""
    from hf_acco.comm.exchange import Exchange

    waited = []

    class Work:
        def __init__(self, i: int) -> None:
            self.i = i

        def wait(self) -> bool:
            waited.append(self.i)
            return True

    assert Exchange([Work(0), Work(1), Work(2)]).wait()
    assert waited == [2, 1, 0]


def _mismatched(rank: int, world_size: int) -> str:
    import torch.distributed as dist

    from hf_acco.comm.exchange import all_gather_into

    try:
        all_gather_into(torch.zeros(2 * world_size), torch.zeros(3), dist.group.WORLD)
    except ValueError as e:
        return str(e)
    return "accepted"


def test_a_point_to_point_all_gather_of_the_wrong_size_is_refused_as_the_collective_would() -> None:
    assert all("2 x 3" in r for r in run_ranks(_mismatched, world_size=2))
