"""CUDA path: the round on its own stream, ordered by events, NCCL. Skipped without a GPU.

    make test-gpu     # these tests + a CUDA overlap timing, under 5 minutes on one GPU

One GPU gives one NCCL rank: the collectives are trivial, but the side stream, the events and the background
thread are the real ones, and a missing stream dependency shows up as a run that is not reproducible.
"""

from __future__ import annotations

import pytest
import torch

from hf_acco import ACCOOptimizer
from hf_acco.comm import DelayedCommunicator
from hf_acco.multiprocess import run_ranks

from .models import batch, decay_groups, mean_loss, tiny_llama
from .reference import Reference, relative_error, run_acco

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run `make test-gpu` on one)"),
]
STEPS, MICRO = 12, 4
HP = {"lr": 1e-2, "betas": (0.9, 0.95)}


def cuda_train(rank: int, world_size: int, delay: float, autocast: bool) -> list[torch.Tensor]:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = tiny_llama().cuda()
    opt = ACCOOptimizer(
        decay_groups(model, 0.1), micro_batches=MICRO, max_grad_norm=0.5, communicator=DelayedCommunicator(delay), **HP
    )
    assert opt.rounds.runner._stream is not None, "the CUDA round must run on its own stream"
    for t in range(STEPS):
        for i in range(MICRO):
            b = {k: v.cuda() for k, v in batch(0, t * MICRO + i).items()}
            with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
                loss = mean_loss(model, b)[0]
            loss.backward()
            opt.after_backward()
        opt.step()
    with opt.committed_parameters():
        out = [p.detach().cpu().clone() for p in model.parameters()]
    assert opt.buffers.accum.dtype == torch.float32
    opt.close()
    return out


def _run(delay: float, autocast: bool = False) -> list[torch.Tensor]:
    return run_ranks(
        cuda_train, world_size=1, backend="nccl", start_method="spawn", delay=delay, autocast=autocast, timeout=300
    )[0]


def test_cuda_acco_matches_the_reference() -> None:
    got = _run(delay=0.0)
    model = tiny_llama()
    ref = Reference(model, decay_groups(model, 0.1), torch.optim.AdamW, 0.5, mean_loss, **HP)
    plan = [
        [([batch(0, t * MICRO + i) for i in range(2)], [batch(0, t * MICRO + i) for i in range(2, 4)])]
        for t in range(STEPS)
    ]
    assert relative_error(got, run_acco(ref, plan)[-1]) < 1e-4


def test_cuda_fixed_mode_does_not_depend_on_round_timing() -> None:
    """A missing event between the streams would let timing change what the round reads or writes."""
    fast, slow = _run(delay=0.0), _run(delay=0.05)
    assert all(torch.equal(a, b) for a, b in zip(fast, slow))


def test_cuda_bf16_autocast_trains() -> None:
    got = _run(delay=0.01, autocast=True)
    assert all(torch.isfinite(p).all() for p in got)
    assert relative_error(got, [p.detach() for p in tiny_llama().parameters()]) > 1e-3
