"""The memory report (hf_acco.tools.memory) against the tensors a built engine really holds, and its CLI."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from hf_acco import ACCOOptimizer
from hf_acco.engine.rounds import own_pieces
from hf_acco.tools.memory import engine_memory, engine_memory_of
from hf_acco.tools.multiprocess import run_ranks

from .models import batch, mean_loss, tiny_llama


class Allocations(TorchDispatchMode):
    """Bytes of the new tensors the ops of this thread make (in-place ops, copies into existing tensors and views
    left out)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
        out = func(*args, **(kwargs or {}))
        if not func.is_view and not func.__name__.split(".")[0].endswith("_"):
            self.bytes += sum(
                t.nbytes for t in (out if isinstance(out, (tuple, list)) else [out]) if torch.is_tensor(t)
            )
        return out


BOUNDARY = "acco: the boundary's model shard (model dtype, pinned; hand-written loops, opt-in under FSDP)"
ESTIMATE = "round: Adam estimate windows"


def _held(
    rank: int,
    world_size: int,
    schedule: str,
    comm_dtype: str,
    model_dtype: torch.dtype,
    grad_dtype: str,
    fused: bool,
    gather_dtype: str = "auto",
) -> tuple[dict, dict]:
    model = tiny_llama().to(model_dtype)
    opt = ACCOOptimizer(
        model.parameters(), schedule=schedule, micro_batches=2, comm_dtype=comm_dtype, grad_dtype=grad_dtype,
        gather_dtype=gather_dtype, bucket_numel=3000, lr=1e-3, **({"fused": True} if fused else {"foreach": True}),
    )  # fmt: skip
    for i in range(2):
        mean_loss(model, batch(rank, i))[0].backward()
        opt.after_backward()
    opt.step()
    opt.synchronize()  # the optimizer state exists once a commit round has run
    held = {
        "parameters (the model's)": sum(p.nbytes for p in model.parameters()),
        "gradient accumulation buffer (full)": opt.buffers.accum.nbytes,
        "round buffer (full)": opt.buffers.wire.nbytes if opt.buffers.separate else 0,
        "master shard (fp32)": opt.shard.master.nbytes,
        "shard gradient (fp32; 0: in the round's buffer)": getattr(opt.shard.own_grad, "nbytes", 0),
        "optimizer state shard (fp32)": sum(v.nbytes for v in opt.shard.state_tensors()[0].values()),
    }
    report = engine_memory_of(opt)
    out = dict(report.persistent)
    if schedule == "acco":  # on the host, in the model's dtype; none where the engine keeps no copy (ACCOTrainer's)
        held[BOUNDARY], out[BOUNDARY] = opt._boundary.copy.nbytes, report.host[BOUNDARY]
        opt._boundary_copy = False
        assert BOUNDARY not in engine_memory_of(opt).host
        opt._boundary_copy = True
        assert opt._boundary.copy.device.type == "cpu" and opt._boundary.copy.dtype == model_dtype
        # the estimate's temporaries, where the round writes it (rounds.py: its own pieces, or over the gradient)
        buf, shard = opt.buffers.wire, opt.shard
        shard.use_grad(opt.buffers.shard_grad_of(opt.buffers.grads_of(buf)))
        narrow = buf.dtype != torch.float32 or opt.buffers.grad_room == "own"
        own = narrow and opt.buffers.grad_room == "own"  # packed: over the shard's own gradient too
        target = shard.grad if own or opt.buffers.packed else own_pieces(opt.layout, buf, opt.comm.rank)
        with Allocations() as made:
            shard.estimate(opt._hparams(), target)
        window_bytes = 4 * opt.layout.shard_numel  # one window: the whole shard of a tiny model
        held[ESTIMATE] = round(made.bytes / window_bytes) * window_bytes  # real elements and a few step bytes
        out[ESTIMATE] = report.round_pool[ESTIMATE]
    opt.close()
    return held, out


@pytest.mark.parametrize(
    ("world_size", "schedule", "comm_dtype", "model_dtype", "grad_dtype", "fused"),
    [(2, "acco", "fp32", torch.float32, "fp32", True), (2, "acco", "auto", torch.bfloat16, "fp32", True),
     (2, "sync", "fp32", torch.float32, "fp32", True), (2, "dpu", "bf16", torch.float32, "fp32", False),
     (2, "acco", "fp32", torch.bfloat16, "fp32", False), (4, "acco", "bf16", torch.bfloat16, "fp32", True),
     (4, "acco", "bf16", torch.bfloat16, "bf16", False), (2, "acco", "int8", torch.bfloat16, "fp32", True),
     (4, "acco", "int8", torch.bfloat16, "fp32", True), (2, "sync", "int8", torch.float32, "fp32", False),
     (2, "acco", "int8:int8", torch.bfloat16, "bf16", True), (4, "acco", "int8:int4", torch.float32, "fp32", False),
     (4, "sync", "int8:int8", torch.bfloat16, "fp32", True)],
)  # fmt: skip
def test_the_report_is_what_the_engine_holds(
    world_size: int, schedule: str, comm_dtype: str, model_dtype: torch.dtype, grad_dtype: str, fused: bool
) -> None:
    """("int8:int8": int8 gradients and int8 changes, where the round's buffer is packed int8 rows.)"""
    comm_dtype, gather_dtype = (comm_dtype + ":auto").split(":")[:2]
    kwargs = {"schedule": schedule, "comm_dtype": comm_dtype, "model_dtype": model_dtype, "grad_dtype": grad_dtype}
    kwargs["gather_dtype"] = gather_dtype
    for held, report in run_ranks(_held, world_size=world_size, fused=fused, **kwargs):
        assert held.keys() == report.keys()
        for name in held:
            assert report[name] == pytest.approx(held[name], rel=0.01), name
        assert sum(report.values()) == pytest.approx(sum(held.values()), rel=0.01)


def test_the_cli_prints_one_json_object_for_7b_on_8_ranks() -> None:
    def report(*flags: str) -> dict:
        cmd = [sys.executable, "-m", "hf_acco.memory", "--params", "7e9", "--world_size", "8", "--json", *flags]
        return json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=120).stdout)

    default = report("--param_dtype", "bf16")  # Trainer's fused AdamW, the model's dtype on the wire
    fp32 = report("--param_dtype", "bf16", "--comm_dtype", "fp32", "--optimizer", "foreach")
    bf16_sums = report("--param_dtype", "bf16", "--grad_dtype", "bf16")
    # 14 (params) + 28 (fp32 accumulation) + 14 (bf16 round buffer) + 3.5 (master) + 7 (moments) GB, the shard
    # gradient in the round's buffer; an fp32 wire: a 28 GB round buffer; bf16 accumulation: 14 less
    assert default["comm_dtype"] == "bf16" and default["unit"].startswith("bytes")
    assert default["persistent_bytes"] / 1e9 == pytest.approx(66.5, abs=0.005)  # (padding: 27 KB)
    assert default["peak_bytes"] / 1e9 <= 70.0 and default["host_pinned_bytes_per_rank"] / 1e9 <= 4.0
    assert default["host_pinned_bytes_per_node"] == 8 * default["host_pinned_bytes_per_rank"]
    assert default["persistent_bytes_gib"] == pytest.approx(default["persistent_bytes"] / 2**30)
    assert fp32["persistent_bytes"] / 1e9 == pytest.approx(80.5, abs=0.005)
    assert fp32["round_pool_bytes"] / 1e9 == pytest.approx(3.5, abs=0.005)  # foreach's shard-sized square root
    assert bf16_sums["persistent_bytes"] / 1e9 == pytest.approx(52.5, abs=0.005)
    assert default["baselines_persistent_bytes"]["ZeRO-1"] / 1e9 == pytest.approx(52.5, abs=0.005)
    # int8 on the wire: the default's buffers (the round is handed bf16 sums), plus its packing in the round's pool
    int8 = report("--param_dtype", "bf16", "--comm_dtype", "int8")
    assert int8["comm_dtype"] == "int8" and int8["persistent_bytes"] == default["persistent_bytes"]
    (packing,) = (v for k, v in int8["round_pool"].items() if "int8" in k)
    # 4 buckets of 259 M elements in flight, each sent and received packed (263 MB), and 2 fp32 chunks of 32 M
    assert packing / 1e9 == pytest.approx(4 * 2 * 0.263 + 2 * 0.13, abs=0.01)
    assert int8["round_pool_bytes"] == max(default["round_pool_bytes"], packing)
    # int8 parameter changes too: the round's buffer holds int8 rows (deltas.PackedRound: 7B x (1 + 4/256) bytes)
    # instead of bf16 (14 GB), and the shard gradient a tensor of its own (3.5 GB); the sums are packed at the
    # hand-over, so the round only receives (one packed bucket per bucket in flight), and the changes it receives
    # land in its buffer: per bucket in flight, this rank's packed chunk (33 MB), one fp32 chunk's change and the
    # (de)quantising temporaries
    both = report("--param_dtype", "bf16", "--comm_dtype", "int8", "--gather_dtype", "int8")
    packed = 7e9 * (1 + 4 / 256) / 1e9
    assert both["persistent"]["round buffer (full)"] / 1e9 == pytest.approx(packed, abs=0.01)
    assert both["persistent_bytes"] / 1e9 == pytest.approx(66.5 - 14 + packed + 3.5, abs=0.01)
    (changes,) = (v for k, v in both["round_pool"].items() if "all-gather" in k)
    assert changes / 1e9 == pytest.approx(4 * 0.0329 + 2 * 0.13 + 0.13, abs=0.01)
    (received,) = (v for k, v in both["round_pool"].items() if "reduce-scatter" in k)
    assert received / 1e9 == pytest.approx(4 * 0.263 + 2 * 0.13, abs=0.01)
    assert both["round_pool_bytes"] == max(received, changes) == received
    # int4 changes: half the packed values (16.6 MB a chunk), the same temporaries, the same int8 round buffer
    int4 = report("--param_dtype", "bf16", "--comm_dtype", "int8", "--gather_dtype", "int4")
    (changes4,) = (v for k, v in int4["round_pool"].items() if "int4 all-gather" in k)
    assert changes4 / 1e9 == pytest.approx(4 * 0.0166 + 2 * 0.13 + 0.13, abs=0.01)
    assert int4["persistent_bytes"] == both["persistent_bytes"] and int4["round_pool_bytes"] == received
    # 2 machines of 8: the two levels regroup one bucket (bf16) for the machine's reduce-scatter and send one packed
    # row per machine, not per rank: less than the flat all-to-all's buffers (one rank per machine)
    wide = ["--param_dtype", "bf16", "--comm_dtype", "int8", "--world_size", "16"]
    (levels,) = (v for k, v in report(*wide)["round_pool"].items() if "two levels" in k)
    (flat,) = (v for k, v in report(*wide, "--gpus_per_node", "1")["round_pool"].items() if "reduce-scatter" in k)
    assert 0.5 < levels / 1e9 < flat / 1e9
    # error feedback: an fp32 residual per row this rank quantises: the whole buffer (28 GB for 7B) on one machine of
    # 8, an eighth of it per rank on 2 machines of 8 (two levels: one row per machine)
    ef = report("--param_dtype", "bf16", "--comm_dtype", "int8", "--error_feedback")
    assert ef["persistent"]["int8 error feedback residual (fp32)"] / 1e9 == pytest.approx(28.0, abs=0.01)
    ef16 = report(*wide, "--error_feedback")
    assert ef16["persistent"]["int8 error feedback residual (fp32)"] / 1e9 == pytest.approx(28.0 / 8, abs=0.01)
    assert default["host"][BOUNDARY] / 1e9 == pytest.approx(1.75, abs=0.005)  # the bf16 boundary shard
    assert default["host_pinned_bytes_per_rank"] == 2**31  # as torch's pinned allocator rounds it
    for numel in (125e6, 1.3e9, 6738415616):  # smaller shards, Llama-2-7B's size: the pool within one fp32 shard
        small = engine_memory(int(numel), 8, param_dtype=torch.bfloat16, optimizer="foreach")
        assert small.peak_bytes - small.persistent_bytes <= small.persistent["master shard (fp32)"]
        assert small.persistent["shard gradient (fp32; 0: in the round's buffer)"] == 0
    assert engine_memory(int(7e9), 8, param_dtype=torch.bfloat16).persistent_bytes == default["persistent_bytes"]
    cmd = [sys.executable, "-m", "hf_acco.memory", "--params", "7e9"]
    text = subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=120).stdout
    assert "GiB" in text and "pinned per node" in text


def _residual(rank: int, world_size: int) -> tuple[int, int]:
    opt = ACCOOptimizer(tiny_llama().parameters(), comm_dtype="int8", error_feedback=True, bucket_numel=3000, lr=1e-3)
    held, report = opt._round.feedback.residual.nbytes, engine_memory_of(opt).persistent
    opt.close()
    return held, report["int8 error feedback residual (fp32)"]


def test_the_error_feedback_residual_is_what_the_engine_holds() -> None:
    for held, reported in run_ranks(_residual, world_size=2):
        assert held == reported > 0


def test_fsdp_inside_machines_for_70b_34b_13b_on_machines_of_8() -> None:
    """FSDP2 over each machine's 8 GPUs, ACCO across machines, the leanest settings (bf16 sums, int8 gradients and
    int8 changes on the wire): per GPU 70B on 8 machines, 34B on 4, 13B on 2, against HSDP (FSDP2 with fp32 master
    parameters, replicated across machines), and what would hold less."""

    def report(params: str, machines: int, *flags: str) -> dict:
        cmd = [sys.executable, "-m", "hf_acco.memory", "--params", params, "--world_size", str(8 * machines),
               "--fsdp_shard", "8", "--grad_dtype", "bf16", "--comm_dtype", "int8", "--json", *flags]  # fmt: skip
        return json.loads(subprocess.run(cmd, capture_output=True, text=True, check=True, timeout=120).stdout)

    hsdp = "HSDP (FSDP2 over 8 ranks, fp32 master parameters)"
    lean = ("--gather_dtype", "int8")
    big, mid, small = report("70e9", 8, *lean), report("34e9", 4, *lean), report("13e9", 2, *lean)
    # 70B / 8 = 8.75 B per FSDP shard: 17.5 GB each of the shard's parameters and sums (bf16), the round's buffer as
    # int8 rows (8.9), its eighth's master (4.4), gradient (4.4) and moments (8.75); HSDP holds 16 bytes a parameter
    # of the shard: 140 GB
    assert big["persistent"]["round buffer (full)"] / 1e9 == pytest.approx(8.75 * (1 + 4 / 256), abs=0.01)
    assert big["persistent_bytes"] / 1e9 == pytest.approx(61.4, abs=0.05) and big["persistent_bytes"] <= 64e9
    assert big["baselines_persistent_bytes"][hsdp] / 1e9 == pytest.approx(140.0, abs=0.05)
    assert mid["persistent_bytes"] / 1e9 <= 48 < mid["baselines_persistent_bytes"][hsdp] / 1e9
    assert (
        small["persistent_bytes"] / 1e9 <= 48 and small["persistent_bytes"] < small["baselines_persistent_bytes"][hsdp]
    )
    lower = big["lower_persistent_bytes"]
    assert lower["--schedule sync (one buffer: no round runs beside the next micro-batches)"] / 1e9 == pytest.approx(
        48.1, abs=0.05
    )
    assert all(v < big["persistent_bytes"] for v in lower.values())
    # with the parameters exact in the all-gather the round's buffer is bf16 (17.5 GB): above 64, and the report
    # names the int8 changes as what would bring it down
    exact = report("70e9", 8)
    assert exact["persistent_bytes"] / 1e9 == pytest.approx(65.6, abs=0.05)
    assert (
        exact["lower_persistent_bytes"]["--gather_dtype int8 (int8 changes in the all-gather)"]
        == big["persistent_bytes"]
    )


def test_a_gpu_size_gets_a_verdict_and_what_would_hold_less(capsys) -> None:
    """7B on 8 ranks in an 80 GiB GPU: bf16 weights fit (the peak leaves room for activations), fp32 weights for a
    bf16 run do not, and the report says that loading them in bf16 holds the bf16 run's bytes."""
    from hf_acco.tools import memory

    def report(*flags: str) -> dict:
        memory.main(["--params", "7e9", "--world_size", "8", "--gpu_gib", "80", "--json", *flags])
        return json.loads(capsys.readouterr().out)

    bf16, fp32 = report("--param_dtype", "bf16"), report("--param_dtype", "fp32")
    assert bf16["fits"] and bf16["left_for_activations_bytes"] == 80 * 2**30 - bf16["device_bytes"]
    assert bf16["device_bytes"] - bf16["peak_bytes"] == sum(bf16["runtime"].values()) == 2 * 2**30  # the allowance
    assert not fp32["fits"] and fp32["left_for_activations_bytes"] < 0
    lower = fp32["lower_persistent_bytes"]
    loaded_in_bf16 = next(v for k, v in lower.items() if k.startswith("--param_dtype bf16"))
    assert loaded_in_bf16 == bf16["persistent_bytes"]
    memory.main(["--params", "7e9", "--world_size", "8", "--param_dtype", "fp32", "--gpu_gib", "80"])
    assert "Does not fit a GPU of 80 GiB" in capsys.readouterr().out


def test_memory_reads_a_models_shape_from_its_config(tmp_path) -> None:
    """--config (a transformers config.json, offline): the parameter count of the model it builds, tied weights
    once, for three architectures; the same figures as --params with that count."""
    import json
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM, GPT2Config, GPTNeoXConfig, LlamaConfig

    from hf_acco.tools.model_shape import shape_from_config

    configs = {
        "llama": LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                             num_attention_heads=4, tie_word_embeddings=True),
        "gpt2": GPT2Config(vocab_size=1000, n_embd=64, n_layer=3, n_head=4, bos_token_id=0, eos_token_id=0),
        "neox": GPTNeoXConfig(vocab_size=1000, hidden_size=64, intermediate_size=256, num_hidden_layers=2,
                              num_attention_heads=4),
    }  # fmt: skip
    for name, config in configs.items():
        config.save_pretrained(tmp_path / name)
        built = AutoModelForCausalLM.from_config(config)
        shape = shape_from_config(tmp_path / name / "config.json")
        assert shape.params == sum(p.numel() for p in built.parameters()), name
    argv = [sys.executable, "-m", "hf_acco.memory", "--world_size", "2", "--gpus_per_node", "2", "--json"]
    by_config = json.loads(subprocess.run([*argv, "--config", str(tmp_path / "llama")], capture_output=True,
                                          text=True, check=True).stdout)  # fmt: skip
    params = shape_from_config(tmp_path / "llama").params
    by_count = json.loads(subprocess.run([*argv, "--params", str(params)], capture_output=True, text=True,
                                         check=True).stdout)  # fmt: skip
    assert by_config["params"] == params and by_config["persistent_bytes"] == by_count["persistent_bytes"]
    bad = subprocess.run([*argv[:-1], "--params", "1e9", "--micro_batch_size", "4"], capture_output=True, text=True)
    assert bad.returncode == 2 and "needs --config" in bad.stderr and "Traceback" not in bad.stderr


def test_the_activation_estimate_is_within_20_percent_of_what_a_forward_saves(tmp_path) -> None:
    """The bytes a bf16 Llama's forward saves for its backward (saved_tensors_hooks), on a shape other than the one
    the constants came from, against model_shape.activation_bytes: without checkpointing, and with it (the layers'
    inputs and what lies outside them; the one layer recomputed at a time is not saved by the forward)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_acco.tools.model_shape import activation_bytes, layer_bytes_per_token, shape_from_config

    config = LlamaConfig(vocab_size=2000, hidden_size=192, intermediate_size=512, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    config.save_pretrained(tmp_path)
    shape = shape_from_config(tmp_path)
    b, s = 2, 96

    def saved(checkpointing: bool) -> int:
        torch.manual_seed(0)
        model = LlamaForCausalLM(config).to(torch.bfloat16).train()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        seen: dict[tuple, int] = {}

        def pack(t: torch.Tensor) -> torch.Tensor:
            seen[(t.data_ptr(), t.numel(), t.dtype)] = t.numel() * t.element_size()
            return t

        ids = torch.randint(0, 2000, (b, s))
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(input_ids=ids, labels=ids)
        return sum(seen.values())

    full = activation_bytes(shape, b * s, checkpointing=False)
    assert abs(full / saved(False) - 1) < 0.2, (full, saved(False))
    kept = activation_bytes(shape, b * s, checkpointing=True) - b * s * layer_bytes_per_token(shape)
    assert abs(kept / saved(True) - 1) < 0.2, (kept, saved(True))


def test_the_report_is_within_3_percent_of_what_a_gpu_held() -> None:
    """Every committed GPU results file (benchmarks/results/gpu_check_*.json, `make gpu-check`): the memory the run
    held at a step end against the report, recomputed now from the run's settings (a change to the report's model
    that the GPU contradicts fails here). The step end holds the engine's buffers, the model and Trainer's
    few small tensors: the report's persistent bytes."""
    import json
    from pathlib import Path

    files = sorted((Path(__file__).resolve().parents[1] / "benchmarks" / "results").glob("gpu_check_*.json"))
    if not files:
        pytest.skip("no GPU results committed (benchmarks/results/gpu_check_*.json)")
    checked = 0
    for path in files:
        for method, run in json.loads(path.read_text())["runs"].items():
            if not method.startswith("acco_") or run.get("step_end_allocated_bytes") is None:
                continue
            report = engine_memory(run["params"], 1, param_dtype=torch.bfloat16, comm_dtype="auto",
                                   schedule=method.removeprefix("acco_"), ranks_per_node=1)  # fmt: skip
            assert abs(report.persistent_bytes / run["step_end_allocated_bytes"] - 1) < 0.03, (path.name, method)
            checked += 1
    assert checked


# ---- FSDP2's working set (FSDP inside machines), measured from its tensors ----------------------------------------

FSDP_LLAMA = dict(vocab_size=2000, hidden_size=256, intermediate_size=704, num_hidden_layers=3, num_attention_heads=8,
                  num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False)  # fmt: skip


def _fsdp_working_set(rank: int, world_size: int, config: str, reduce: str) -> dict[str, int]:
    """A transformers Llama sharded over each machine's 2 ranks as Accelerate's ``fsdp2_prepare_model`` does (each
    decoder layer, the input embedding, the tail [norm, lm_head] with ``reshard_after_forward=False``, the root; a
    bf16 model, its bf16 policy), two training steps; the peak bytes of each kind of FSDP tensor alive at once,
    sampled around every FSDP parameter group's unshard, copy-out, reshard and post-backward and every hook."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    from transformers import AutoConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(AutoConfig.from_pretrained(config)).to(torch.bfloat16)
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    kw = dict(mesh=mesh["dp_shard"], mp_policy=MixedPrecisionPolicy(torch.bfloat16, getattr(torch, reduce)))
    for layer in model.model.layers:
        fully_shard(layer, **kw)
    fully_shard(model.model.embed_tokens, **kw)
    fully_shard([model.model.norm, model.lm_head], **kw, reshard_after_forward=False)
    fully_shard(model, **kw)
    groups = [m._get_fsdp_state()._fsdp_param_group for m in model.modules() if isinstance(m, FSDPModule)]
    groups = [g for g in groups if g is not None]
    tail = model.lm_head._get_fsdp_state()._fsdp_param_group  # (the group of [norm, lm_head])
    ctx = model._get_fsdp_state()._comm_ctx
    peaks = dict.fromkeys(("all_gather_outputs", "unsharded", "unsharded_grads", "reduce_scatter_input", "tail"), 0)

    def storage(tensors, seen: set) -> int:  # noqa: ANN001 - each storage once (views of one buffer share it)
        total = 0
        for t in tensors:
            if t is not None and t.untyped_storage().nbytes() and t.untyped_storage().data_ptr() not in seen:
                seen.add(t.untyped_storage().data_ptr())
                total += t.untyped_storage().nbytes()
        return total

    def sample(*_: object, **__: object) -> None:
        outputs = [g._all_gather_result for g in groups] + [getattr(ctx.all_gather_state, "all_gather_result", None)]
        now = {
            "all_gather_outputs": storage([r.all_gather_output for r in outputs if r is not None], set()),
            "unsharded": storage(
                [
                    t
                    for g in groups
                    if g is not tail
                    for fp in g.fsdp_params
                    for t in getattr(fp, "all_gather_outputs", [])
                ],
                set(),
            ),  # fmt: skip
            "unsharded_grads": storage(
                [fp._unsharded_param.grad for g in groups for fp in g.fsdp_params if hasattr(fp, "_unsharded_param")],
                set(),
            ),  # fmt: skip
            "reduce_scatter_input": storage([s.reduce_scatter_input for s in ctx.reduce_scatter_states], set()),
            "tail": storage([t for fp in tail.fsdp_params for t in getattr(fp, "all_gather_outputs", [])], set()),
        }
        for k, v in now.items():
            peaks[k] = max(peaks[k], v)

    for name in ("unshard", "wait_for_unshard", "reshard", "post_backward"):
        method = getattr(FSDPParamGroup, name)
        setattr(FSDPParamGroup, name, lambda self, *a, _m=method, **k: (sample(), _m(self, *a, **k), sample())[1])
    for m in model.modules():
        m.register_forward_pre_hook(sample)
        m.register_forward_hook(sample)
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(sample)
    ids = torch.randint(0, FSDP_LLAMA["vocab_size"], (2, 32), generator=torch.Generator().manual_seed(rank))
    for _ in range(2):
        model(input_ids=ids, labels=ids).loss.backward()
    return peaks


@pytest.mark.parametrize("reduce", ["bfloat16", "float32"])
def test_fsdps_working_set_in_the_report_is_what_fsdp2_allocates(tmp_path, reduce: str) -> None:
    """``hf_acco.memory --fsdp_shard 2 --config``: each FSDP line within 10 % of what FSDP2 allocated on 2 x 2 CPU
    ranks for a transformers Llama (the all-gather outputs alive at once, the unsharded group, its gradients, the
    reduce-scatter input in the policy's reduce dtype, the tail group), its groups read from the config."""
    from transformers import LlamaConfig

    from hf_acco.tools.device_memory import groups_from_config, working_set

    LlamaConfig(**FSDP_LLAMA).save_pretrained(tmp_path)
    measured = run_ranks(_fsdp_working_set, world_size=4, timeout=300, config=str(tmp_path), reduce=reduce)[0]
    lines = working_set(groups_from_config(tmp_path, 2), torch.bfloat16, getattr(torch, reduce))
    by_kind = dict(zip(("all_gather_outputs", "unsharded", "unsharded_grads", "reduce_scatter_input", "tail"), lines))
    for kind, line in by_kind.items():
        assert measured[kind] > 0, kind
        assert abs(lines[line] - measured[kind]) <= 0.1 * measured[kind], (kind, lines[line], measured[kind])


def test_70b_on_8_by_8_with_fsdp_inside_counts_fsdps_working_set_and_says_what_is_left(capsys, tmp_path) -> None:
    """The leanest settings for 70B on 8 machines of 8: FSDP's working set as lines of its own, in the peak, the
    allowance beside it, and what is left of the GPU is what remains after all of them; the groups assumed from
    --params (and said so), or read from --config."""
    from transformers import LlamaConfig

    from hf_acco.tools import memory

    lean = ["--world_size", "64", "--gpus_per_node", "8", "--fsdp_shard", "8", "--grad_dtype", "bf16",
            "--comm_dtype", "int8", "--gather_dtype", "int8"]  # fmt: skip
    memory.main(["--params", "70e9", *lean])
    text = capsys.readouterr().out
    assert "| + FSDP: all-gather outputs, current and prefetched" in text
    assert "assumed: shaped like Llama 2 70B" in text
    memory.main(["--params", "70e9", *lean, "--json"])
    out = json.loads(capsys.readouterr().out)
    assert len(out["fsdp"]) == 6 and out["fsdp_bytes"] == sum(out["fsdp"].values()) > 8e9  # ~5 layers of 1.7 GB
    held = out["persistent_bytes"] + out["round_pool_bytes"] + max(out["temporaries"].values())
    assert out["peak_bytes"] == held + out["fsdp_bytes"]
    assert out["left_for_activations_bytes"] == 80 * 2**30 - out["peak_bytes"] - sum(out["runtime"].values())
    assert out["fits_with_margin"] == (out["left_for_activations_bytes"] >= out["margin_bytes"] == 8 * 2**30)
    memory.main(["--params", "70e9", *lean, "--json", "--fsdp_reduce_dtype", "fp32"])
    fp32_reduce = json.loads(capsys.readouterr().out)
    layer = out["fsdp"]["FSDP: the group being computed, unsharded (model dtype)"] // 2  # elements
    more = {k: fp32_reduce["fsdp"][k] - v for k, v in zip(fp32_reduce["fsdp"], out["fsdp"].values())}
    assert more[next(k for k in more if k.startswith("FSDP: reduce-scatter input"))] == 2 * layer  # 2 more bytes
    assert more[next(k for k in more if k.startswith("FSDP: reduce-scatter output"))] == -(-layer // 8) * 4  # + cast

    config = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                         num_key_value_heads=8, vocab_size=32000)  # fmt: skip
    config.save_pretrained(tmp_path)  # Llama 2 70B's shape: the assumed groups, unscaled, are its own
    memory.main(["--config", str(tmp_path), *lean, "--json"])
    own = json.loads(capsys.readouterr().out)
    assert own["fsdp_groups"].startswith("the model's config")
    layer = 2 * (2 * 8192 * 8192 + 2 * 8192 * 1024 + 3 * 8192 * 28672 + 2 * 8192)  # bf16 bytes of a decoder layer
    assert own["fsdp"]["FSDP: the group being computed, unsharded (model dtype)"] == layer
