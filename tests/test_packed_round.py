"""The packed round buffer (``deltas.PackedRound``): with int8 gradients and quantised changes the round's buffer
holds int8 rows (about half of a bf16 buffer) packed at the hand-over instead of in the round. It is the same
algorithm with the same roundings: the parameters are bit-identical to a round buffer of the wire's dtype, every
step, through evaluations and a resume of a pending commit round (gloo ranks)."""

from __future__ import annotations

import pytest
import torch

import hf_acco.engine.buffers
from hf_acco import ACCOOptimizer
from hf_acco.comm.sharding import FlatLayout
from hf_acco.engine.packing import packed_round_saves
from hf_acco.engine.runner import ROUND_THREAD
from hf_acco.tools.multiprocess import run_ranks

from .models import batch, decay_groups, mean_loss, tiny_llama

HP = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8}
MICRO, STEPS, SAVE_AT = 4, 6, 3


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def _engine(model: torch.nn.Module, settings: dict) -> ACCOOptimizer:
    return ACCOOptimizer(decay_groups(model, 0.1), micro_batches=MICRO, max_grad_norm=0.6, bucket_numel=5000,
                         comm_dtype="int8", **settings, **HP)  # fmt: skip


def _model(dtype: torch.dtype, seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return tiny_llama().to(dtype)


def _steps(opt: ACCOOptimizer, model: torch.nn.Module, rank: int, first: int, last: int, out: dict) -> None:
    for t in range(first, last):
        for i in range(MICRO):
            mean_loss(model, batch(rank, t * MICRO + i))[0].float().backward()
            opt.after_backward()
        opt.step()
        out["held"].append(_flat(model))  # the model as the next micro-batches see it (the estimate, for acco)
        if t % 2:  # an evaluation reads the committed parameters, and training goes on from what it held
            with opt.committed_parameters():
                out["committed"].append(_flat(model))
        if t + 1 == SAVE_AT:
            out["state"] = opt.state_dict()


def _train(rank: int, world_size: int, packed: bool, dtype: torch.dtype, settings: dict) -> dict:
    if not packed:  # the round buffer in the wire's dtype, as without this mode
        hf_acco.engine.packing.packed_round_saves = lambda *args: False
    model = _model(dtype)
    opt = _engine(model, settings)
    out: dict = {"held": [], "committed": [], "packed": opt.buffers.packed is not None}
    out["wire"] = (opt.buffers.wire.dtype, opt.buffers.wire.nbytes, opt.shard.grad is not None)
    _steps(opt, model, rank, 0, STEPS, out)
    with opt.committed_parameters():
        out["final"] = _flat(model)
    opt.close()
    # a resume of the checkpoint taken after step SAVE_AT (a commit round pending), into a model of other values
    other = _model(dtype, seed=1)
    again = _engine(other, settings)
    again.load_state_dict(out.pop("state"))
    resumed: dict = {"held": [], "committed": []}
    _steps(again, other, rank, SAVE_AT, STEPS, resumed)
    with again.committed_parameters():
        out["resumed_final"] = _flat(other)
    again.close()
    out["resumed_held"] = resumed["held"]
    return out


CASES = {  # (ranks, model dtype, settings): where the packed buffer is the smaller one
    "bf16-sums-int8-changes-2-ranks": (2, torch.bfloat16, {"grad_dtype": "bf16", "gather_dtype": "int8"}),
    "bf16-int4-changes-3-ranks": (3, torch.bfloat16, {"gather_dtype": "int4"}),
    "fp32-int8-changes-4-ranks": (4, torch.float32, {"gather_dtype": "int8"}),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_a_packed_round_buffer_gives_the_same_bits_as_one_in_the_wires_dtype(case: str) -> None:
    world_size, dtype, settings = CASES[case]
    packed = run_ranks(_train, world_size=world_size, packed=True, dtype=dtype, settings=settings)
    plain = run_ranks(_train, world_size=world_size, packed=False, dtype=dtype, settings=settings)
    assert packed[0]["packed"] and not plain[0]["packed"]
    (wire_dtype, wire_bytes, own_grad), (plain_dtype, plain_bytes, _) = packed[0]["wire"], plain[0]["wire"]
    assert wire_dtype == torch.int8 and plain_dtype == dtype and own_grad  # (the shard gradient: its own tensor)
    assert wire_bytes < plain_bytes * (0.55 if dtype == torch.bfloat16 else 0.3)
    for r in range(world_size):
        for key in ("held", "committed", "resumed_held"):
            assert len(packed[r][key]) == len(plain[r][key]) > 0
            for a, b in zip(packed[r][key], plain[r][key]):
                assert torch.equal(a, b), (key, r)
        assert torch.equal(packed[r]["final"], plain[r]["final"])
        assert torch.equal(packed[r]["resumed_final"], packed[r]["final"])  # the resume is exact
        assert torch.equal(packed[r]["final"], packed[0]["final"])  # every rank the same bits
    assert not torch.equal(packed[0]["held"][0], packed[0]["held"][-1])  # it trained


@pytest.mark.parametrize(
    ("ranks", "dtype", "packed"),
    [(2, torch.bfloat16, True), (3, torch.bfloat16, True), (4, torch.bfloat16, False), (8, torch.bfloat16, True),
     (4, torch.float32, True)],
)  # fmt: skip
def test_the_packed_buffer_is_used_where_it_holds_fewer_bytes(ranks: int, dtype: torch.dtype, packed: bool) -> None:
    """bf16 on 4 ranks: a bf16 round buffer keeps the fp32 shard gradient in two other ranks' pieces (free), and
    int8 rows (1 + 4/256 bytes an element) plus a shard gradient of its own (4/4) take a little more than its 2."""
    layout = FlatLayout([torch.empty(1 << 20, device="meta")], ["all"], [0], ranks, 1 << 16)
    assert packed_round_saves(layout, dtype, dtype, dtype) is packed


def _packing_threads(rank: int, world_size: int, delay: float) -> dict:
    """Which thread quantised the sums into the round's buffer at each hand-over, each pack held back by ``delay``
    seconds (a writer of the sums that did not wait for it, half B's first gradients, would overtake it)."""
    import threading
    import time

    from hf_acco.comm.deltas import PackedRound

    threads: list[str] = []
    pack = PackedRound.pack_sums

    def recorded(self, buf, sums, wire):  # noqa: ANN001, ANN202
        threads.append(threading.current_thread().name)
        time.sleep(delay)
        return pack(self, buf, sums, wire)

    PackedRound.pack_sums = recorded  # (this forked rank only)
    model = _model(torch.bfloat16)
    opt = _engine(model, {"grad_dtype": "bf16", "gather_dtype": "int8"})
    out: dict = {"held": [], "committed": []}
    _steps(opt, model, rank, 0, 3, out)
    with opt.committed_parameters():
        final = _flat(model)
    packed = opt.buffers.packed is not None
    opt.close()
    return {"threads": threads, "packed": packed, "held": out["held"], "final": final}


def test_the_round_packs_the_sums_on_its_own_thread_and_stream_with_the_same_bits() -> None:
    """The hand-over lends the sums to the round (``handover.LentSums``): the round quantises them into its buffer
    first thing, on its thread and (on CUDA) its stream, off the main thread's critical path; the next writer of the
    sums waits for it. A slow pack changes no bit."""
    quick, slow = (run_ranks(_packing_threads, world_size=2, delay=d) for d in (0.0, 0.05))
    for r in quick + slow:
        assert r["packed"] and set(r["threads"]) == {ROUND_THREAD} and len(r["threads"]) == 6, r["threads"]
    for a, b in zip(quick, slow):
        assert all(torch.equal(x, y) for x, y in zip(a["held"] + [a["final"]], b["held"] + [b["final"]]))
    assert torch.equal(quick[0]["final"], quick[1]["final"])
    assert not torch.equal(quick[0]["final"], _flat(_model(torch.bfloat16)))  # it trained


@pytest.mark.parametrize(("dtype", "bits"), [(torch.bfloat16, 8), (torch.bfloat16, 4), (torch.float32, 8)])
def test_the_boundary_adds_the_changes_in_place_with_the_bits_of_a_rounded_fp32_sum(dtype: torch.dtype,
                                                                                   bits: int) -> None:  # fmt: skip
    """``PackedRound.apply`` adds each rank's dequantised change where the model holds it, through one reused fp32
    row: the bits of the change plus the model's elements in fp32, rounded to the model's dtype (what the round
    buffer of the model's dtype holds), pieces that split parameters and chunks that are no whole blocks included."""
    from types import SimpleNamespace

    from hf_acco.comm import quant
    from hf_acco.comm.deltas import PackedRound

    torch.manual_seed(0)
    shapes = [(37, 11), (300,), (5, 64), (1000,)]  # pieces of 4 ranks cut through them
    params = [torch.randn(s).to(dtype) for s in shapes]
    params[1][:8] = torch.tensor([1e-40, -1e-40, 0.0, -0.0, 3e38, 1e-3, 2.0**-126, 7.0]).to(dtype)  # edges
    layout = FlatLayout(params, [str(i) for i in range(len(params))], [0] * len(params), 4, 1000)
    packed = PackedRound(layout, SimpleNamespace(rank=0, world_size=4), params, bits, dtype)  # type: ignore[arg-type]
    assert layout.num_buckets > 1 and layout.chunk % quant.BLOCK  # several buckets, a partial block a row
    buf = packed.new_buffer(torch.device("cpu"))
    changes = torch.randn(layout.num_buckets, 4, layout.chunk) * 1e-2
    changes[0, 0, :4] = torch.tensor([1e-40, 0.0, -1e-3, 5.0])
    flat = torch.cat([p.flatten().float() for p in params] + [torch.zeros(layout.padded_numel - layout.numel)])
    expected = flat.clone()
    for b in range(layout.num_buckets):
        packed._changes(buf, b).copy_(quant.pack(changes[b], bits=bits))
        for r in range(4):  # the model's elements + the dequantised change, in fp32, rounded to the model's dtype
            dequantised = quant.unpack(packed._changes(buf, b)[r : r + 1], layout.chunk, bits)[0]
            piece = layout.piece(expected, b, r)
            piece.copy_((dequantised + piece).to(dtype).float())
    packed.apply(buf)
    got = torch.cat([p.flatten().float() for p in params])
    assert all(p.dtype == dtype for p in params)
    assert torch.equal(got, expected[: layout.numel])
    assert not torch.equal(got, flat[: layout.numel])  # it changed the model
