"""CUDA path: the round on its own stream, ordered by events, NCCL. Skipped without a GPU.

    make test-gpu     # these tests, one at a time (make gpu-check runs them 4 at a time)

One GPU gives one NCCL rank. The engine runs NCCL's real reduce-scatter and all-gather there anyway
(``collectives_at_world_size_1``), with the counts on the host (gloo) group first; the side stream, the events
and the background thread are the real ones, and a missing stream dependency shows up as a run that is not
reproducible.
"""

from __future__ import annotations

import pytest
import torch

from hf_acco import ACCOOptimizer
from hf_acco.tools.multiprocess import run_ranks

from .doubles import DelayedCommunicator
from .models import batch, decay_groups, mean_loss, tiny_llama
from .reference import Reference, relative_error, run_acco

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run `make test-gpu` on one)"),
]
STEPS, MICRO = 12, 4
HP = {"lr": 1e-2, "betas": (0.9, 0.95)}


def on_one_gpu(fn, **kwargs):  # noqa: ANN001, ANN003, ANN201 - run_ranks' own
    """``fn``'s result on one NCCL rank in a process of its own (spawned: CUDA in a child)."""
    return run_ranks(fn, world_size=1, backend="nccl", start_method="spawn", timeout=300, **kwargs)[0]


def cuda_train(rank: int, world_size: int, delay: float, autocast: bool) -> list[torch.Tensor]:
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    model = tiny_llama().cuda()
    opt = ACCOOptimizer(
        decay_groups(model, 0.1),
        micro_batches=MICRO,
        max_grad_norm=0.5,
        communicator=DelayedCommunicator(delay, collectives_at_world_size_1=True),
        **HP,
    )
    assert opt.rounds.runner._stream is not None, "the CUDA round must run on its own stream"
    assert opt.comm.backend == "nccl" and not opt.comm.local_copies and opt.comm.host_group is not opt.comm.group
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


class SlowKernelCommunicator(DelayedCommunicator):
    """Its all-gather leaves a long kernel on the round's stream: the host returns long before the device ends. The
    kernel's own device time is measured by events around it (``slept``, of the last call)."""

    cycles = 0
    slept: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    def all_gather(self, layout, shard, flat) -> None:
        super().all_gather(layout, shard, flat)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(self.cycles)
        end.record()
        self.slept = (start, end)


def cuda_round_duration(rank: int, world_size: int) -> dict:
    comm = SlowKernelCommunicator(0.0, collectives_at_world_size_1=True)
    comm.cycles = 200_000_000  # a sleep kernel of 0.1-0.6 s, at the SM clocks from boost to idle
    model = tiny_llama().cuda()
    opt = ACCOOptimizer(model.parameters(), micro_batches=2, communicator=comm, lr=1e-3)
    for t in range(3):
        for i in range(2):
            b = {k: v.cuda() for k, v in batch(0, 2 * t + i).items()}
            mean_loss(model, b)[0].backward()
            opt.after_backward()
        opt.step()
    opt.synchronize()
    seconds = opt.last_commit.seconds
    start, end = comm.slept
    end.synchronize()
    opt.close()
    return {"round_s": seconds, "kernel_s": start.elapsed_time(end) / 1000}


def test_cuda_round_duration_covers_its_kernels() -> None:
    """On NCCL ``work.wait()`` does not block the host: a round's duration must be read once its kernels are done
    (the dynamic half policy plans with it, and ``acco_round_s`` reports it). The round's kernel is measured by
    events around it, not calibrated beforehand (a calibration at an idle clock overstated it 1.6x on an H200)."""
    got = run_ranks(cuda_round_duration, world_size=1, backend="nccl", start_method="spawn", timeout=300)[0]
    assert got["kernel_s"] > 0.05, got  # long enough that a duration read at launch would miss most of it
    assert got["round_s"] >= got["kernel_s"], got  # the last commit round's duration covers its last kernel


def cuda_placed(
    rank: int,
    world_size: int,
    comm_dtype: str,
    grad_dtype: str,
    separate: bool,
    gather_dtype: str = "auto",
    delay: float = 0.005,
    late_copy_cycles: int = 0,
) -> dict:
    """A bf16 model on one GPU, NCCL's real collectives; the shard gradient where the engine puts it (the fp32
    round buffer's own pieces: NCCL's in-place reduce-scatter, the estimate over its own gradient, rounded into
    bf16) or, ``separate``, held apart. ``late_copy_cycles``: a sleep kernel on the round's stream before its copy
    of the sums (the device runs the copy late; the host goes on at once)."""
    if separate:  # this spawned process only
        import hf_acco.engine.buffers

        hf_acco.engine.buffers.shard_grad_room = lambda *args: None
    if late_copy_cycles:
        from hf_acco.engine.handover import LentSums

        take = LentSums.take

        def late(self):  # noqa: ANN001, ANN202
            torch.cuda._sleep(late_copy_cycles)  # on the round's stream, queued before the copy
            return take(self)

        LentSums.take = late
    model = tiny_llama().cuda().to(torch.bfloat16)
    opt = ACCOOptimizer(
        decay_groups(model, 0.1), micro_batches=MICRO, max_grad_norm=0.5, comm_dtype=comm_dtype,
        grad_dtype=grad_dtype, gather_dtype=gather_dtype,
        communicator=DelayedCommunicator(delay, collectives_at_world_size_1=True), **HP,
    )  # fmt: skip
    room, accum = opt.buffers.grad_room, opt.buffers.accum.dtype
    for t in range(STEPS):
        for i in range(MICRO):
            b = {k: v.cuda() for k, v in batch(0, t * MICRO + i).items()}
            mean_loss(model, b)[0].backward()
            opt.after_backward()
        opt.step()
    with opt.committed_parameters():
        out = [p.detach().cpu().clone() for p in model.parameters()]
    opt.close()
    return {"room": room, "accum": accum, "params": out}


def _placed(**kwargs) -> dict:
    return run_ranks(cuda_placed, world_size=1, backend="nccl", start_method="spawn", timeout=300, **kwargs)[0]


def test_cuda_shard_gradient_in_the_rounds_buffer_changes_no_bit() -> None:
    placed = _placed(comm_dtype="fp32", grad_dtype="fp32", separate=False)
    apart = _placed(comm_dtype="fp32", grad_dtype="fp32", separate=True)
    assert (placed["room"], apart["room"]) == ("own", None)
    assert all(torch.equal(a, b) for a, b in zip(placed["params"], apart["params"]))


def test_cuda_the_rounds_copy_of_the_sums_comes_before_the_next_halfs_gradients() -> None:
    """fp32 sums and a bf16 wire: each hand-over is a cast copy the round makes on its own stream. Held back on the
    device, it must still read the sums before the next half's hooks (main stream) add to them: the same parameters,
    bit for bit (handover.LentSums: the writer's stream waits for the copy's event)."""
    prompt = _placed(comm_dtype="auto", grad_dtype="fp32", separate=False)
    late = _placed(comm_dtype="auto", grad_dtype="fp32", separate=False, late_copy_cycles=50_000_000)
    assert prompt["accum"] == torch.float32
    assert all(torch.equal(a, b) for a, b in zip(prompt["params"], late["params"]))


def test_cuda_bf16_wire_and_bf16_accumulation_train() -> None:
    got = _placed(comm_dtype="bf16", grad_dtype="bf16", separate=False)
    assert got["accum"] == torch.bfloat16
    assert all(torch.isfinite(p).all() for p in got["params"])
    start = [p.detach().to(torch.bfloat16).float() for p in tiny_llama().parameters()]
    assert relative_error([p.float() for p in got["params"]], start) > 1e-3  # it trained


@pytest.mark.parametrize("changes", ["int8", "int4"])
def test_cuda_int8_gradients_and_parameters_do_not_depend_on_round_timing(changes: str) -> None:
    """int8 gradients, int8 or int4 changes on NCCL: the round reads the model (the changes' base) on its own
    stream, after the launch's event; a missing dependency on the main stream's load of the model would make the
    run depend on the round's timing."""
    fast = _placed(comm_dtype="int8", grad_dtype="fp32", separate=False, gather_dtype=changes, delay=0.0)
    slow = _placed(comm_dtype="int8", grad_dtype="fp32", separate=False, gather_dtype=changes, delay=0.05)
    assert all(torch.equal(a, b) for a, b in zip(fast["params"], slow["params"]))
    exact = _placed(comm_dtype="auto", grad_dtype="fp32", separate=False)
    floats = lambda ps: [p.float() for p in ps]  # noqa: E731
    assert 0 < relative_error(floats(fast["params"]), floats(exact["params"])) < 0.2


# ---- the first real run's rules, on the device (issue: 8 GPUs, Trainer's defaults, a bf16 model, a resume) -------


def _fused_engine(model: torch.nn.Module) -> ACCOOptimizer:
    return ACCOOptimizer(
        decay_groups(model, 0.1),
        micro_batches=MICRO,
        max_grad_norm=0.5,
        fused=True,
        communicator=DelayedCommunicator(0.0, collectives_at_world_size_1=True),
        **HP,
    )


def _cuda_steps(model, opt, start: int, stop: int) -> None:
    for t in range(start, stop):
        for i in range(MICRO):
            b = {k: v.cuda() for k, v in batch(0, t * MICRO + i).items()}
            mean_loss(model, b)[0].backward()
            opt.after_backward()
        opt.step()


def cuda_fused_resume(rank: int, world_size: int, directory: str) -> dict:
    from hf_acco.engine.checkpoint import load_optimizer_state, save_optimizer_state

    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_llama().cuda().to(torch.bfloat16)
    opt = _fused_engine(model)
    _cuda_steps(model, opt, 0, 3)
    save_optimizer_state(opt, directory)
    _cuda_steps(model, opt, 3, 6)
    with opt.committed_parameters():
        straight = [p.detach().cpu().clone() for p in model.parameters()]
    opt.close()
    model = tiny_llama(seed=1).cuda().to(torch.bfloat16)
    opt = _fused_engine(model)
    load_optimizer_state(opt, directory)
    steps = {(s["step"].device.type, s["step"].dtype) for s in opt.shard.inner.state.values()}
    _cuda_steps(model, opt, 3, 6)  # the fused kernel takes the placed state (CPU steps would raise)
    with opt.committed_parameters():
        resumed = [p.detach().cpu().clone() for p in model.parameters()]
    opt.close()
    return {"straight": straight, "resumed": resumed, "steps": steps}


def test_cuda_fused_adamw_resume_is_exact(tmp_path) -> None:
    got = run_ranks(
        cuda_fused_resume, world_size=1, backend="nccl", start_method="spawn", timeout=300, directory=str(tmp_path)
    )[0]
    assert got["steps"] == {("cuda", torch.float32)}  # torch's policy for fused: float32 on the device
    assert all(torch.equal(a, b) for a, b in zip(got["straight"], got["resumed"]))


def cuda_boundary_copies(rank: int, world_size: int) -> dict:
    """Profile one acco step boundary: every device-to-host copy and the stream it ran on."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    model = tiny_llama().cuda().to(torch.bfloat16)
    opt = _fused_engine(model)
    _cuda_steps(model, opt, 0, 2)
    for i in range(MICRO):  # the next step's micro-batches, then its boundary under the profiler
        mean_loss(model, {k: v.cuda() for k, v in batch(0, 8 + i).items()})[0].backward()
        opt.after_backward(torch.tensor(1.0, device="cuda"))  # a weight on the device, as Trainer's token counts
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        marker = torch.full((1 << 16,), 3.0, device="cuda").neg_()  # a kernel on the main stream, to find it by
        opt.step()
        marker.neg_()
        opt.synchronize()
        torch.cuda.synchronize()
    events = [e for e in prof.profiler.kineto_results.events() if e.device_type() == DeviceType.CUDA]
    main = {e.device_resource_id() for e in events if "neg" in e.name().lower()}
    dtoh = [(e.name(), e.device_resource_id()) for e in events if "DtoH" in e.name() or "Device -> Pinned" in e.name()]
    opt.close()
    return {"main": main, "dtoh": dtoh}


def test_cuda_no_device_to_host_copy_on_the_main_stream_at_a_step_boundary() -> None:
    """The boundary's model shard goes to the host on a side stream, from the commit round's thread; the step's
    device weight is read by the round, on its stream: the main stream copies nothing to the host."""
    got = run_ranks(cuda_boundary_copies, world_size=1, backend="nccl", start_method="spawn", timeout=300)[0]
    assert len(got["main"]) == 1, got
    assert got["dtoh"], "the boundary's copy to the host did not run at all"
    assert all(stream not in got["main"] for _, stream in got["dtoh"]), got


def cuda_eval_host_memory(rank: int, world_size: int) -> dict:
    model = tiny_llama().cuda().to(torch.bfloat16)
    opt = _fused_engine(model)
    _cuda_steps(model, opt, 0, 2)
    before = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    with opt.committed_parameters():  # at a step boundary, as Trainer evaluates and saves
        during = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    after = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    full = opt.layout.padded_numel * 2
    opt.close()
    return {"before": before, "during": during, "after": after, "full": full}


def test_cuda_evaluation_at_a_step_boundary_takes_no_pinned_host_memory() -> None:
    got = run_ranks(cuda_eval_host_memory, world_size=1, backend="nccl", start_method="spawn", timeout=300)[0]
    assert got["during"] - got["before"] < got["full"] // 2, got
    assert got["after"] <= got["before"], got


def cuda_save_state_memory(rank: int, world_size: int, directory: str) -> dict:
    from accelerate import Accelerator

    from hf_acco import prepare_acco

    accelerator = Accelerator(gradient_accumulation_steps=2)
    model, optimizer = prepare_acco(accelerator, tiny_llama().cuda(), lr=1e-3)
    for i in range(4):
        with accelerator.accumulate(model):
            accelerator.backward(model(**{k: v.cuda() for k, v in batch(0, i).items()}).loss)
            optimizer.step()
    # the last step's commit round runs on (its thread, its stream): wait for it, so that what is measured is the
    # save's alone (the round's own optimizer step allocates its temporaries, about a model's worth at one rank)
    optimizer.optimizer.synchronize()
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    accelerator.save_state(directory)
    grew = torch.cuda.max_memory_allocated() - start
    model_bytes = sum(p.nbytes for p in model.parameters())
    optimizer.optimizer.close()
    return {"grew": grew, "model": model_bytes}


def test_cuda_save_state_makes_no_device_copy_of_the_model(tmp_path) -> None:
    got = run_ranks(
        cuda_save_state_memory, world_size=1, backend=None, start_method="spawn", timeout=300, directory=str(tmp_path)
    )[0]
    assert got["grew"] < got["model"] // 2, got  # the committed weights are copied to the host, not on the GPU


def cuda_trainer(rank: int, world_size: int, argv: list[str]) -> dict:
    from .scripts import trainer_script

    return trainer_script.main(argv)


def _trainer_on_gpu(out, **options) -> dict:
    """tests/scripts/trainer_script.py on the GPU, one rank (full_determinism: deterministic CUDA kernels)."""
    import json

    extra = {"use_cpu": not torch.cuda.is_available(), "full_determinism": True, **options.pop("extra", {})}
    argv = ["--output_dir", str(out), "--acco", "--extra", json.dumps(extra)]
    for key, value in options.items():
        argv += [f"--{key}", str(value)]
    return run_ranks(cuda_trainer, world_size=1, backend=None, start_method="spawn", timeout=300, argv=argv)[0]


@pytest.mark.parametrize("schedule", ["acco", "sync"])
def test_cuda_acco_trainer_trains_saves_and_resumes_bit_identically(tmp_path, schedule: str) -> None:
    """ACCOTrainer on the GPU (NCCL, the round's stream): 12 steps with a checkpoint at step 6, then a second run
    from that checkpoint; the resumed run ends where the uninterrupted one ends, bit for bit, losses included."""
    straight = _trainer_on_gpu(tmp_path / "straight", save_steps=6, extra={"acco_schedule": schedule})
    resumed = _trainer_on_gpu(
        tmp_path / "resumed", resume=tmp_path / "straight" / "checkpoint-6", extra={"acco_schedule": schedule}
    )
    losses = [[h["loss"] for h in r["log_history"] if "loss" in h] for r in (straight, resumed)]
    assert len(losses[0]) == 12 and losses[1] == losses[0], losses  # (the first 6 restored from the checkpoint)
    assert all(p.device.type == "cpu" for p in straight["params"].values())  # (handed back from the GPU)
    assert all(torch.equal(straight["params"][n], resumed["params"][n]) for n in straight["params"]), "resume moved"
    assert straight["acco_totals"]["steps"] == 12
    assert resumed["log_history"][-2]["acco_optimizer_steps"] == 12  # (the last entry is the run's summary)


def cuda_fsdp_train(
    rank: int, world_size: int, delay: float, dtype: str = "float32", last_backward: bool = True
) -> list[torch.Tensor]:
    """The engine over an FSDP2 model on one GPU (a 1 x 1 mesh, NCCL): FSDP runs the gradient hooks on its own
    reduce-scatter stream, so the accumulation is written there; the main stream waits for that stream before the
    boundary hands the sums to a round (``handover.HookStreams``), whether or not FSDP's own end-of-backward wait
    runs (``last_backward=False``: ``set_is_last_backward(False)``, which skips it). ``dtype``: the model's (bf16:
    FSDP's shards in bf16, as ``shard_within_machines`` keeps a bf16 model's; bf16 gradients into fp32 sums)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.backends.cuda.matmul.allow_tf32 = False
    mesh = init_device_mesh("cuda", (1, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
    model = tiny_llama().to(getattr(torch, dtype)).cuda()
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    model.set_is_last_backward(last_backward)
    opt = ACCOOptimizer(decay_groups(model, 0.1), micro_batches=MICRO, max_grad_norm=0.5,
                        communicator=DelayedCommunicator(delay, collectives_at_world_size_1=True), **HP)  # fmt: skip
    _cuda_steps(model, opt, 0, STEPS)
    with opt.committed_parameters():
        out = [p.full_tensor().detach().cpu().clone() for p in model.parameters()]
    opt.close()
    return out


def test_cuda_acco_over_a_bf16_fsdp2_model_is_the_same_whatever_the_round_timing() -> None:
    """bf16 shards (a bf16 model under FSDP inside machines): the same parameters bit for bit whether the rounds are
    quick or held back, so no stream dependency is missing with bf16 gradients either; and the model trained."""
    runs = [
        run_ranks(
            cuda_fsdp_train, world_size=1, backend="nccl", start_method="spawn", timeout=300, delay=d, dtype="bfloat16"
        )[0]  # fmt: skip
        for d in (0.0, 0.05)
    ]
    assert all(a.dtype == torch.bfloat16 for a in runs[0])
    assert all(torch.equal(a, b) for a, b in zip(*runs))
    start = [p.detach().to(torch.bfloat16) for p in tiny_llama().parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(runs[0], start))


@pytest.mark.parametrize("last_backward", [True, False], ids=["fsdp-waits", "fsdp-does-not-wait"])
def test_cuda_acco_over_an_fsdp2_model_matches_the_reference_whatever_the_round_timing(last_backward: bool) -> None:
    runs = [on_one_gpu(cuda_fsdp_train, delay=d, last_backward=last_backward) for d in (0.0, 0.05)]
    assert all(torch.equal(a, b) for a, b in zip(*runs))  # no stream dependency missing
    model = tiny_llama()
    ref = Reference(model, decay_groups(model, 0.1), torch.optim.AdamW, 0.5, mean_loss, **HP)
    plan = [
        [([batch(0, t * MICRO + i) for i in range(2)], [batch(0, t * MICRO + i) for i in range(2, 4)])]
        for t in range(STEPS)
    ]
    assert relative_error(runs[0], run_acco(ref, plan)[-1]) < 1e-4


def cuda_kernel_checks(rank: int, world_size: int) -> dict:
    import os

    from hf_acco.engine import kernels

    from .test_kernels import checked_writes

    os.environ[kernels.ENV] = "triton"
    add, copy = kernels.writers(torch.device("cuda"))
    out = checked_writes(add, copy, "cuda", (kernels.MIN_NUMEL, 3 * kernels.MIN_NUMEL + 5))
    acc, grad = torch.zeros(kernels.MIN_NUMEL, device="cuda"), torch.ones(kernels.MIN_NUMEL, device="cuda").bfloat16()
    add(acc, grad)  # (compiled for these arguments before the timing below)
    acc.zero_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        torch.cuda._sleep(200_000_000)  # ~0.1 s and more: the side stream's kernels start after it
        add(acc, grad)
    early = acc.sum().item()  # the default stream, not waiting for the side one
    side.synchronize()
    out["on the current stream"] = (early, acc.sum().item()) == (0.0, float(kernels.MIN_NUMEL))
    return out


def test_cuda_the_triton_kernels_give_torchs_sums_on_the_current_stream() -> None:
    """HF_ACCO_ACCUMULATE=triton, compiled: the hook's add and copy give torch's sums bit for bit (infinities, NaN,
    signed zeros, subnormals, overflow, a partial block, at aligned and unaligned places), and run on the current
    stream as torch's ops do: launched on a side stream held back by a sleep kernel, the default stream does not see
    the result before the side one. (In a process of its own: Triton decides compiled or interpreted once.)"""
    (result,) = run_ranks(cuda_kernel_checks, world_size=1, backend="nccl", start_method="spawn", timeout=300)
    assert result and all(result.values()), result


def cuda_kernels_train(rank: int, world_size: int, choice: str, fsdp: bool) -> dict:
    """A bf16 tiny Llama trained by the engine with the hook's kernels ``choice``, every bf16 gradient through
    them (MIN_NUMEL 1); with ``fsdp``, over an FSDP2 model (the hooks run on FSDP's reduce-scatter stream)."""
    import os

    from hf_acco.engine import kernels

    from .test_kernels import record_launches

    os.environ[kernels.ENV] = choice
    kernels.MIN_NUMEL = 1  # every bf16 gradient, however small
    launched = record_launches()
    torch.backends.cuda.matmul.allow_tf32 = False
    model = tiny_llama().cuda().to(torch.bfloat16)
    if fsdp:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cuda", (1, 1), mesh_dim_names=("dp_replicate", "dp_shard"))
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh["dp_shard"])
        fully_shard(model, mesh=mesh["dp_shard"])
    opt = ACCOOptimizer(decay_groups(model, 0.1), micro_batches=MICRO, max_grad_norm=0.5,
                        communicator=DelayedCommunicator(0.0, collectives_at_world_size_1=True), **HP)  # fmt: skip
    _cuda_steps(model, opt, 0, 4)
    with opt.committed_parameters():
        full = [p.full_tensor() if fsdp else p for p in model.parameters()]
        out = [p.detach().cpu().clone() for p in full]
    opt.close()
    return {"params": out, "kernel_calls": sum(launched)}


@pytest.mark.parametrize("fsdp", [False, True], ids=["plain", "fsdp2"])
def test_cuda_training_with_the_triton_kernels_gives_the_same_parameters(fsdp: bool) -> None:
    runs = {choice: on_one_gpu(cuda_kernels_train, choice=choice, fsdp=fsdp) for choice in ("torch", "triton")}
    every = len(runs["torch"]["params"]) * 4 * MICRO  # each parameter's gradient of each micro-batch
    assert runs["torch"]["kernel_calls"] == 0 and 0 < runs["triton"]["kernel_calls"] <= every
    assert fsdp or runs["triton"]["kernel_calls"] == every  # (FSDP's local shards could be strided: torch's op)
    assert all(torch.equal(a, b) for a, b in zip(runs["torch"]["params"], runs["triton"]["params"]))


# ---- 4 GPUs as 2 machines x 2: FSDP's NCCL collectives inside each "machine", the rounds across ------------------

FOUR_GPUS = pytest.mark.skipif(
    torch.cuda.device_count() < 4,
    reason="needs 4 GPUs (2 machines x 2: FSDP2's NCCL all-gathers and reduce-scatters inside each, ACCO's rounds "
    "across); `make gpu-check` runs it where there are",
)


class _RandomlyDelayed(DelayedCommunicator):
    """Each round's reduce-scatter and all-gather held back by a random 0-30 ms, drawn per rank (seeded): the rounds
    end at other times on every rank and step, against FSDP's collectives on the main thread."""

    def __init__(self, seed: int, **kwargs) -> None:  # noqa: ANN003
        import random

        super().__init__(0.0, **kwargs)
        self._random = random.Random(seed)

    def reduce_scatter(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        import time

        time.sleep(self._random.uniform(0.0, 0.03))
        super().reduce_scatter(*args, **kwargs)

    def all_gather(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003
        import time

        time.sleep(self._random.uniform(0.0, 0.03))
        super().all_gather(*args, **kwargs)


def cuda_hsdp_train(
    rank: int, world_size: int, delayed: bool, settings: dict, dtype: str = "float32", device: str = "cuda"
) -> dict:
    """A tiny Llama sharded by FSDP2 over each machine's 2 GPUs (NCCL), the engine over the machines (the replicate
    group); ``delayed``: every round held back at random. ``device="cpu"``: the same on gloo ranks (a smoke run of
    this function where there is no GPU)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from hf_acco.comm.communicator import Communicator

    if device == "cuda":
        torch.cuda.set_device(rank)
        torch.backends.cuda.matmul.allow_tf32 = False
    mesh = init_device_mesh(device, (2, world_size // 2), mesh_dim_names=("dp_replicate", "dp_shard"))
    model = tiny_llama().to(getattr(torch, dtype)).to(device)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh["dp_shard"])
    fully_shard(model, mesh=mesh["dp_shard"])
    group = mesh.get_group("dp_replicate")
    comm = _RandomlyDelayed(rank, group=group) if delayed else Communicator(group=group)
    opt = ACCOOptimizer(decay_groups(model, 0.1), micro_batches=MICRO, max_grad_norm=0.5, communicator=comm,
                        **settings, **HP)  # fmt: skip
    for t in range(STEPS):
        for i in range(MICRO):
            b = {k: v.to(device) for k, v in batch(rank, t * MICRO + i).items()}
            mean_loss(model, b)[0].float().backward()
            opt.after_backward()
        opt.step()
    with opt.committed_parameters():
        full = [p.full_tensor().detach().cpu().clone() for p in model.parameters()]
    out = {"full": full, "packed": opt.buffers.packed is not None, "norm": opt.last_commit.grad_norm}
    opt.close()
    return out


def _hsdp_runs(settings: dict, dtype: str = "float32") -> tuple[list[dict], list[dict]]:
    return tuple(  # type: ignore[return-value]
        run_ranks(
            cuda_hsdp_train,
            world_size=4,
            backend="nccl",
            start_method="spawn",
            timeout=300,
            delayed=d,
            settings=settings,
            dtype=dtype,
        )  # fmt: skip
        for d in (False, True)
    )


@FOUR_GPUS
def test_cuda_fsdp_inside_2_machines_of_2_matches_the_reference_whatever_the_round_timing() -> None:
    """FSDP2's collectives on NCCL inside each machine, the rounds across, every round delayed at random: the same
    parameters bit for bit as undelayed rounds on every rank (no stream or thread ordering missing between FSDP's
    streams, the hooks' and the round's), and the single-process reference's (the global mean, the global norm)."""
    quick, delayed = _hsdp_runs({})
    for a, b in zip(quick, delayed):
        assert all(torch.equal(x, y) for x, y in zip(a["full"], b["full"]))
        assert all(torch.equal(x, y) for x, y in zip(a["full"], quick[0]["full"]))
    model = tiny_llama()
    ref = Reference(model, decay_groups(model, 0.1), torch.optim.AdamW, 0.5, mean_loss, **HP)
    half = MICRO // 2
    plan = [[([batch(r, t * MICRO + i) for i in range(half)], [batch(r, t * MICRO + i) for i in range(half, MICRO)])
             for r in range(4)] for t in range(STEPS)]  # fmt: skip
    assert relative_error(quick[0]["full"], run_acco(ref, plan)[-1]) < 1e-4


@FOUR_GPUS
def test_cuda_fsdp_inside_machines_with_the_packed_round_is_the_same_whatever_the_round_timing() -> None:
    """A bf16 model, bf16 sums, int8 both ways between the machines: the round's buffer is int8 rows (packed by the
    round on its stream), and the parameters are the same bit for bit whether the rounds are quick or delayed at
    random, on every rank; the model trained."""
    settings = {"grad_dtype": "bf16", "comm_dtype": "int8", "gather_dtype": "int8"}
    quick, delayed = _hsdp_runs(settings, dtype="bfloat16")
    assert all(r["packed"] for r in quick)
    for a, b in zip(quick, delayed):
        assert all(torch.equal(x, y) for x, y in zip(a["full"], b["full"]))
        assert all(torch.equal(x, y) for x, y in zip(a["full"], quick[0]["full"]))
    start = [p.detach().to(torch.bfloat16) for p in tiny_llama().parameters()]
    assert any(not torch.equal(a, b) for a, b in zip(quick[0]["full"], start))
