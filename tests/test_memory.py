"""The memory report (hf_acco.memory) against the tensors a built engine really holds, and its CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from hf_acco import ACCOOptimizer
from hf_acco.memory import engine_memory, engine_memory_of
from hf_acco.multiprocess import run_ranks

from .models import batch, mean_loss, tiny_llama


def _held(
    rank: int, world_size: int, schedule: str, comm_dtype: str, model_dtype: torch.dtype, grad_dtype: str
) -> tuple[dict, dict]:
    model = tiny_llama().to(model_dtype)
    opt = ACCOOptimizer(
        model.parameters(), schedule=schedule, micro_batches=2, comm_dtype=comm_dtype, grad_dtype=grad_dtype,
        bucket_numel=3000, lr=1e-3,
    )  # fmt: skip
    for i in range(2):
        mean_loss(model, batch(rank, i))[0].backward()
        opt.after_backward()
    opt.step()
    opt.synchronize()  # the optimizer state exists once a commit round has run
    held = {
        "parameters (the model's)": sum(p.nbytes for p in model.parameters()),
        "gradient accumulation buffer (full)": opt.buffers.accum.nbytes,
        "round buffer (full)": opt.buffers.comm.nbytes if opt.buffers.separate else 0,
        "master shard (fp32)": opt.shard.master.nbytes,
        "shard gradient (fp32; 0: in the round's buffer)": getattr(opt.shard.own_grad, "nbytes", 0),
        "optimizer state shard (fp32)": sum(v.nbytes for v in opt.shard.state_tensors()[0].values()),
        "boundary shard (fp32, for mid-step checkpoints)": opt._boundary.model.nbytes,
    }
    report = engine_memory_of(opt)
    report = {**report.persistent, "boundary shard (fp32, for mid-step checkpoints)": report.host[
        "boundary shard (fp32, for mid-step checkpoints)"]}  # fmt: skip
    assert opt._boundary.model.device.type == "cpu"  # on the host
    opt.close()
    return held, report


@pytest.mark.parametrize(
    ("world_size", "schedule", "comm_dtype", "model_dtype", "grad_dtype"),
    [(2, "acco", "fp32", torch.float32, "fp32"), (2, "acco", "bf16", torch.bfloat16, "fp32"),
     (2, "sync", "fp32", torch.float32, "fp32"), (2, "dpu", "bf16", torch.float32, "fp32"),
     (2, "acco", "fp32", torch.bfloat16, "fp32"), (4, "acco", "bf16", torch.bfloat16, "fp32"),
     (4, "acco", "bf16", torch.bfloat16, "bf16")],
)  # fmt: skip
def test_the_report_is_what_the_engine_holds(
    world_size: int, schedule: str, comm_dtype: str, model_dtype: torch.dtype, grad_dtype: str
) -> None:
    kwargs = {"schedule": schedule, "comm_dtype": comm_dtype, "model_dtype": model_dtype, "grad_dtype": grad_dtype}
    for held, report in run_ranks(_held, world_size=world_size, **kwargs):
        assert held.keys() == report.keys()
        for name in held:
            assert report[name] == pytest.approx(held[name], rel=0.01), name
        assert sum(report.values()) == pytest.approx(sum(held.values()), rel=0.01)


def test_the_cli_prints_one_json_object_for_7b_on_8_ranks() -> None:
    def report(*flags: str) -> dict:
        cmd = [sys.executable, "-m", "hf_acco.memory", "--params", "7e9", "--world_size", "8", "--json", *flags]
        return json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=120).stdout)

    fp32 = report("--param_dtype", "bf16")
    bf16 = report("--param_dtype", "bf16", "--comm_dtype", "bf16")
    bf16_sums = report("--param_dtype", "bf16", "--comm_dtype", "bf16", "--grad_dtype", "bf16")
    # the accounting of the GPU-scale issue: 14 (params) + 28 (accumulation) + 28 (round buffer) + 3.5 (master)
    # + 7 (moments) GB on the device, the shard gradient inside the round's buffer: ZeRO-1 + one full fp32
    # buffer; a bf16 round buffer saves 14 (ZeRO-1 + one bf16 buffer), bf16 accumulation 14 more. On the host: the
    # boundary shard (3.5) and, while evaluating or saving, a bf16 copy of the model (14)
    assert fp32["persistent_bytes"] / 1e9 == pytest.approx(80.5, abs=0.05)
    assert bf16["persistent_bytes"] / 1e9 == pytest.approx(66.5, abs=0.05)
    assert bf16_sums["persistent_bytes"] / 1e9 == pytest.approx(52.5, abs=0.05)
    assert fp32["baselines_persistent_bytes"]["ZeRO-1"] / 1e9 == pytest.approx(52.5, abs=0.05)
    for r in (fp32, bf16, bf16_sums):  # no full-size temporary on the device: the peak is within one fp32 shard
        assert (r["peak_bytes"] - r["persistent_bytes"]) / 1e9 <= 3.5 + 1e-6
    for numel in (125e6, 1.3e9, 6738415616):  # smaller shards; an odd chunk (Llama-2-7B's size) keeps "beside"
        small = engine_memory(int(numel), 8, param_dtype=torch.bfloat16, comm_dtype=torch.bfloat16)
        assert small.peak_bytes - small.persistent_bytes <= small.persistent["master shard (fp32)"]
        assert small.persistent["shard gradient (fp32; 0: in the round's buffer)"] == 0
    assert fp32["host_bytes"] / 1e9 == pytest.approx(17.5, abs=0.05)
    assert engine_memory(int(7e9), 8, param_dtype=torch.bfloat16).persistent_bytes == fp32["persistent_bytes"]
