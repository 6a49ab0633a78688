"""The sharded optimizer: estimate = the step it would commit, and it leaves master and state bit-identical."""

from __future__ import annotations

import copy

import pytest
import torch

from hf_acco.comm.sharding import Segment
from hf_acco.engine.optim import ShardOptimizer, check_elementwise

SEGMENTS = [Segment(0, 40, 0), Segment(40, 90, 1), Segment(90, 98, 0)]  # 98..100 is padding
CASES = [
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.9, 0.95)}),
    (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.1}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.1}),
    (torch.optim.Adagrad, {"lr": 0.1, "weight_decay": 0.1}),
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True}),
    # Trainer's default optim="adamw_torch_fused": the estimate runs the fused kernel the commit runs
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "betas": (0.9, 0.95), "fused": True}),
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1, "foreach": True}),
    (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.1, "maximize": True, "fused": True}),
]


def _make(cls, kw, piece_numel=None):
    torch.manual_seed(0)
    master = torch.randn(100)
    master[98:] = 0
    hparams = [{"lr": kw["lr"], "weight_decay": kw["weight_decay"]}, {"lr": kw["lr"], "weight_decay": 0.0}]
    return ShardOptimizer(master, SEGMENTS, hparams, cls, kw, piece_numel=piece_numel), hparams


@pytest.mark.parametrize(("cls", "kw"), CASES, ids=lambda c: getattr(c, "__name__", ""))
def test_estimate_leaves_state_bit_identical_and_equals_the_commit(cls, kw) -> None:
    opt, hparams = _make(cls, kw)
    out = torch.empty(100)
    for i in range(5):
        opt.grad.view(-1).copy_(torch.randn(100))
        opt.grad.view(-1)[98:] = 0
        master = opt.master.clone()
        flat, scalars = copy.deepcopy(opt.state_tensors())
        opt.estimate(hparams, out)
        assert torch.equal(opt.master, master)
        flat2, scalars2 = opt.state_tensors()
        assert flat.keys() == flat2.keys() and scalars.keys() == scalars2.keys()
        assert all(torch.equal(flat[k], flat2[k]) for k in flat)
        assert all(torch.equal(scalars[k], scalars2[k]) for k in scalars)
        if i == 0:
            # before the first commit: no state, or (Adam) its zeros, made in place once
            assert not flat or all(not v.any() for v in flat.values())
        opt.commit(hparams)
        assert torch.equal(out, opt.master), f"step {i}: estimate differs from the committed step"


def test_estimate_into_strided_pieces() -> None:
    """The round writes the estimate straight into this rank's pieces of the communication buffer."""
    opt, hparams = _make(torch.optim.AdamW, CASES[0][1], piece_numel=25)
    opt.grad.copy_(torch.randn(4, 25))
    opt.commit(hparams)
    buffer = torch.zeros(4, 2, 25)  # 4 buckets x 2 ranks x 25: rank 0's pieces are buffer[:, 0]
    opt.grad.copy_(torch.randn(4, 25))
    contiguous = torch.empty(100)
    opt.estimate(hparams, contiguous)
    opt.estimate(hparams, buffer[:, 0])
    assert torch.equal(buffer[:, 0].reshape(-1), contiguous)
    assert torch.all(buffer[:, 1] == 0)


@pytest.mark.parametrize(("cls", "kw"), CASES, ids=lambda c: getattr(c, "__name__", ""))
def test_updates_read_a_gradient_in_a_rounds_buffer_and_the_estimate_may_overwrite_it(cls, kw) -> None:
    """A round keeps the shard gradient in this rank's pieces of its buffer and writes the estimate over it."""
    kept, hparams = _make(cls, kw, piece_numel=25)
    placed, _ = _make(cls, kw, piece_numel=25)
    buffer = torch.zeros(4, 2, 25)  # rank 1's pieces hold the gradient
    for i in range(3):
        grad = torch.randn(4, 25)
        kept.grad.copy_(grad)
        buffer[:, 1] = grad
        placed.use_grad(buffer[:, 1])
        if i == 1:  # an estimate over its own gradient: the same values as into a separate output
            out = torch.empty(100)
            kept.estimate(hparams, out)
            placed.estimate(hparams, buffer[:, 1])
            assert torch.equal(buffer[:, 1].reshape(-1), out)
            assert torch.all(buffer[:, 0] == 0)
            continue
        kept.commit(hparams)
        placed.commit(hparams)
        assert torch.equal(kept.master, placed.master)


def test_optimizer_without_a_gradient_of_its_own_needs_one() -> None:
    master = torch.randn(100)
    opt = ShardOptimizer(master, SEGMENTS, [{"lr": 0.1}, {"lr": 0.1}], torch.optim.SGD, {}, 25, keep_grad=False)
    assert opt.own_grad is None
    with pytest.raises(AssertionError, match="no gradient of its own"):
        opt.use_grad(None)


def test_weight_decay_is_per_element() -> None:
    opt, hparams = _make(torch.optim.SGD, {"lr": 0.5, "weight_decay": 0.2})
    before = opt.master.clone()
    opt.grad.zero_()
    opt.commit(hparams)
    assert torch.allclose(opt.master[0:40], before[0:40] * (1 - 0.5 * 0.2))
    assert torch.equal(opt.master[40:90], before[40:90])


@pytest.mark.parametrize("cls", [torch.optim.LBFGS, torch.optim.SparseAdam])
def test_non_elementwise_optimizers_are_refused(cls) -> None:
    with pytest.raises(ValueError, match="element-wise optimizer"):
        check_elementwise(cls)
    check_elementwise(cls, allow_custom=True)


def _placement(state: dict) -> dict:
    return {k: (v.device, v.dtype) for k, v in state.items() if torch.is_tensor(v)}


@pytest.mark.parametrize("fused", [True, False])
def test_loaded_state_is_placed_as_torchs_own_load_state_dict_places_it(fused: bool) -> None:
    """A checkpoint's ``step`` as another run saved it (float64: torch's scalar dtype under a float64 default):
    torch's ``load_state_dict`` gives a fused Adam float32 on the parameter's device, and keeps it otherwise."""
    kw = {"lr": 1e-2, "weight_decay": 0.1, "fused": fused}
    saved, hparams = _make(torch.optim.AdamW, kw)
    saved.grad.view(-1).copy_(torch.randn(100))
    saved.commit(hparams)
    flat, scalars = saved.state_tensors()
    scalars = {k: v.double() for k, v in scalars.items()}
    loaded, _ = _make(torch.optim.AdamW, kw)
    loaded.master.copy_(saved.master)
    loaded.load_state_tensors(flat, scalars)
    p = torch.nn.Parameter(torch.zeros(3))
    reference = torch.optim.AdamW([p], **kw)
    state = {"step": scalars["step"], "exp_avg": torch.zeros(3), "exp_avg_sq": torch.zeros(3)}
    reference.load_state_dict({"state": {0: state}, "param_groups": reference.state_dict()["param_groups"]})
    expected = _placement(reference.state[p])
    for param in loaded._seg_params:
        assert _placement(loaded.inner.state[param]) == expected
    steps = [loaded.inner.state[param]["step"] for param in loaded._seg_params]
    assert len({s.data_ptr() for s in steps}) == len(steps)  # one step tensor each: incremented in place
    assert all(loaded.inner.state[q]["exp_avg"].data_ptr() == loaded._flat_state["exp_avg"][seg.start :].data_ptr()
               for q, seg in zip(loaded._seg_params, loaded.segments))  # fmt: skip
    loaded.grad.view(-1).copy_(torch.randn(100))
    saved.grad.copy_(loaded.grad)
    loaded.commit(hparams)  # the fused kernel takes the placed state
    saved.commit(hparams)
    assert torch.equal(loaded.master, saved.master)


@pytest.mark.parametrize("kw", [CASES[0][1], CASES[4][1], CASES[5][1]], ids=["adamw", "amsgrad", "fused"])
def test_adam_moments_are_made_once_in_place_not_at_the_first_step(kw) -> None:
    """Left to torch, the first step allocates each segment's moments and the shard optimizer then copies them into
    one vector per moment: twice the moments at the peak. They exist before the first step, and stay where they
    are."""
    opt, hparams = _make(torch.optim.AdamW, kw)
    keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if kw.get("amsgrad") else [])
    before = {k: opt._flat_state[k].data_ptr() for k in keys}
    for p, seg in zip(opt._seg_params, opt.segments):
        assert all(opt.inner.state[p][k].data_ptr() == before[k] + 4 * seg.start for k in keys)
    for _ in range(2):
        opt.grad.view(-1).copy_(torch.randn(100))
        opt.commit(hparams)
    assert {k: opt._flat_state[k].data_ptr() for k in keys} == before
    for p, seg in zip(opt._seg_params, opt.segments):
        assert all(opt.inner.state[p][k].data_ptr() == before[k] + 4 * seg.start for k in keys)


def test_a_resume_hands_each_moment_over_once() -> None:
    """``load_state_tensors(copy=False)``, the resume's path: the new vectors are taken over (a GPU gets one copy of
    each moment, from the host; not a second one on the device)."""
    saved, hparams = _make(torch.optim.AdamW, CASES[0][1])
    saved.grad.view(-1).copy_(torch.randn(100))
    saved.commit(hparams)
    flat, scalars = saved.state_tensors()
    fresh = {k: v.clone() for k, v in flat.items()}
    loaded, _ = _make(torch.optim.AdamW, CASES[0][1])
    loaded.load_state_tensors(fresh, scalars, copy=False)
    assert all(loaded._flat_state[k].data_ptr() == fresh[k].data_ptr() for k in fresh)
    kept, _ = _make(torch.optim.AdamW, CASES[0][1])
    kept.load_state_tensors(flat, scalars)  # the default copies: the caller's vectors stay the caller's
    assert all(kept._flat_state[k].data_ptr() != flat[k].data_ptr() for k in flat)
