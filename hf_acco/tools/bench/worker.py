"""One rank of the benchmark: every method through the same training loop, plus compute and communication alone.

Started by ``python -m hf_acco.bench`` (inside the rank's network namespace) as
``python -m hf_acco.tools.bench.worker SPEC.json OUT.json`` with RANK, WORLD_SIZE, MASTER_ADDR and MASTER_PORT set.
Writes this rank's raw log; ``report.py`` turns the logs of both ranks into figures.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from hf_acco.comm.communicator import Communicator
from hf_acco.comm.groups import default_store
from hf_acco.comm.sharding import FlatLayout
from hf_acco.engine.core import ACCOOptimizer
from hf_acco.integrations.baselines import bf16_wire_hook
from hf_acco.pacing.claims import ClaimingBatchSampler
from hf_acco.pacing.pacer import Pacer
from hf_acco.tools.bench import fsdp_runs
from hf_acco.tools.bench.link import Traffic
from hf_acco.tools.bench.report import accumulation_name, gather_of, method_parts
from hf_acco.tools.collectives import one_collective

MAX_GRAD_NORM = 1.0  # Trainer's default, applied by every method


def load_tokens(path: str | None, seed: int = 0) -> torch.Tensor:
    """UTF-8 bytes of real text (a byte-level LM: vocabulary 256), or generated sentences without a file."""
    if path and Path(path).is_file():
        text = Path(path).read_text(encoding="utf-8")
    else:
        rng = random.Random(seed)
        words = ["the", "cat", "saw", "a", "dog", "and", "ran", "to", "big", "red", "house", "in", "sun", "played"]
        text = " ".join(rng.choice(words) for _ in range(400_000))
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


def build_model(spec: dict[str, Any], emulation: Emulation | None = None) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(spec["seed"])
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=spec["hidden"],
        intermediate_size=4 * spec["hidden"],
        num_hidden_layers=spec["layers"],
        num_attention_heads=spec["heads"],
        num_key_value_heads=spec["heads"],
        max_position_embeddings=spec["seq"],
    )
    model = LlamaForCausalLM(config)
    if emulation is not None:
        emulation.attach(model)
    if spec.get("model_dtype") == "bf16":
        model.to(torch.bfloat16)  # type: ignore[arg-type]  # (transformers' wrapper of Module.to hides its types)
    return model


def batches(tokens: torch.Tensor, spec: dict[str, Any], rank: int):
    """This rank's stream of micro-batches: the same for every method (seeded by seed and rank)."""
    g = torch.Generator().manual_seed(1000 * spec["seed"] + rank)
    seq, batch = spec["seq"], spec["batch"]
    while True:
        starts = torch.randint(0, tokens.numel() - seq, (batch,), generator=g)
        yield torch.stack([tokens[s : s + seq] for s in starts])


def paced_data(tokens: torch.Tensor, spec: dict[str, Any], micro_batches: int) -> Pacer:
    """Dynamic mode as ACCOTrainer runs it: one seeded set of windows of the text, claimed micro-batch by
    micro-batch by the ranks at their own pace, ``micro_batches`` per optimizer step over all ranks."""
    g = torch.Generator().manual_seed(1000 * spec["seed"] + 999)
    seq, n = spec["seq"], (spec["steps"] + 1) * micro_batches * spec["batch"]
    starts = torch.randint(0, tokens.numel() - seq, (n,), generator=g).tolist()
    windows: Any = [tokens[s : s + seq] for s in starts]  # a map-style dataset of windows
    sampler = ClaimingBatchSampler(default_store(), n, spec["batch"], seed=spec["seed"],
                                   num_replicas=dist.get_world_size())  # fmt: skip
    pacer = Pacer(DataLoader(windows, batch_sampler=sampler, collate_fn=torch.stack), sampler, micro_batches)
    pacer.set_epoch(0)
    return pacer


class Slowdown:
    """Emulates a slower device: before each micro-batch, sleep (factor - 1) x this rank's normal compute time."""

    def __init__(self, factor: float) -> None:
        self.factor, self.seconds = factor, 0.0

    def calibrate(self, t_micro: float) -> None:
        self.seconds = max(0.0, (self.factor - 1.0) * t_micro)

    def __call__(self) -> None:
        if self.seconds > 0:
            time.sleep(self.seconds)


class _WaitInBackward(torch.autograd.Function):
    """Identity forward; its backward waits until ``emulation``'s deadline for ``layer`` before passing the
    gradient on (to the layer's own parameters, whose gradients are then ready, as a GPU's would be)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, emulation: Emulation, layer: int) -> torch.Tensor:  # noqa: ANN001
        ctx.emulation, ctx.layer = emulation, layer
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # noqa: ANN001, ANN205
        ctx.emulation.backward_reached(ctx.layer)
        return grad, None, None


class Emulation:
    """GPU-like compute: a micro-batch computes the real gradients of the (small) model, then waits, so that it
    takes ``micro_batch_s`` with the CPU free meanwhile, as a GPU leaves the host; and the model carries a
    ballast of ``params`` extra trainable elements, so that what the methods communicate and update is the
    gradients of a model of that size.

    Timeline of one micro-batch from ``begin()``: the forward ends at ``forward_share x micro_batch_s``; the
    backward then reaches layer ``i`` (last layer first) at ``forward + (L - i) / L x backward`` and only then
    computes that layer's gradients (ballast included): DDP's buckets become ready during the backward, as on a
    GPU, and overlap the rest of it; ``end()`` waits for the micro-batch's end. Waits run to deadlines, so the
    real compute is inside the stated time (a micro-batch only takes longer when the CPU cannot keep up:
    ``compute_slowdown`` in the report shows it)."""

    def __init__(self, micro_batch_s: float, params: int, forward_share: float = 1 / 3) -> None:
        self.micro_batch_s, self.params, self.forward_share = micro_batch_s, int(params), forward_share
        self.layers = 1
        self.t0 = 0.0

    def attach(self, model: Any) -> None:  # a LlamaForCausalLM
        blocks = model.model.layers
        self.layers = len(blocks)
        sizes = [self.params // self.layers + (i < self.params % self.layers) for i in range(self.layers)]
        for i, (block, size) in enumerate(zip(blocks, sizes)):
            block.register_parameter("bench_ballast", torch.nn.Parameter(torch.zeros(size)))
            block.register_forward_hook(self._hook(i))

    def _hook(self, layer: int):  # noqa: ANN202
        def hook(module: Any, args: Any, output: Any) -> Any:  # a decoder layer, with its ballast
            hidden = output[0] if isinstance(output, tuple) else output
            # the ballast's gradient (zeros, of its full size) is computed in this layer's backward
            hidden = hidden + 0.0 * module.bench_ballast.sum().to(hidden.dtype)
            hidden = _WaitInBackward.apply(hidden, self, layer)
            return (hidden, *output[1:]) if isinstance(output, tuple) else hidden

        return hook

    def _wait_until(self, fraction: float) -> None:
        left = self.t0 + fraction * self.micro_batch_s - time.perf_counter()
        if left > 0:
            time.sleep(left)

    def begin(self) -> None:
        self.t0 = time.perf_counter()

    def forward_done(self) -> None:
        self._wait_until(self.forward_share)

    def backward_reached(self, layer: int) -> None:
        done = (self.layers - layer) / self.layers
        self._wait_until(self.forward_share + (1 - self.forward_share) * done)

    def end(self) -> None:
        self._wait_until(1.0)


class _RealCompute:
    """No emulation: a micro-batch takes what the CPU takes."""

    def begin(self) -> None: ...

    def forward_done(self) -> None: ...

    def end(self) -> None: ...


def _reset_peak_memory() -> None:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed heap back, so the next peak is the next run's
    with contextlib.suppress(OSError):
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM (Linux >= 4.0)


def _memory(field: str = "VmHWM") -> int | None:
    """Peak (VmHWM) or current (VmRSS) resident memory of this process, in bytes."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def compute_alone(model, stream, repeats: int, warmup: int = 2, emu: Any = None) -> list[float]:
    """Seconds of ``repeats`` micro-batches (forward + backward) with no communication, after ``warmup``."""
    seconds, emu = [], emu or _RealCompute()
    for i in range(warmup + repeats):
        ids = next(stream)
        t0 = time.perf_counter()
        emu.begin()
        loss = model(input_ids=ids, labels=ids).loss
        emu.forward_done()
        loss.backward()
        emu.end()
        if i >= warmup:
            seconds.append(time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    return seconds


def comm_alone(model, traffic: Traffic, repeats: int) -> dict[str, float | None]:
    """Median seconds and bytes sent of one ACCO/ZeRO-1 round (reduce-scatter + all-gather, both spellings) and
    of one all-reduce (DDP) of the trainable parameters, with nothing else running."""
    params = [p for p in model.parameters() if p.requires_grad]
    out: dict[str, float | None] = {}
    for name in ("all_to_all", "native", "all_reduce"):
        comm = Communicator(reduce_scatter="native" if name == "all_reduce" else name)
        layout = FlatLayout(params, [str(i) for i in range(len(params))], [0] * len(params), comm.world_size)
        flat, shard = layout.new_flat("cpu"), torch.zeros(layout.shard_numel)
        flat.normal_()
        seconds, sent, cpu = [], [], []
        for _ in range(repeats + 1):
            dist.barrier(comm.group)
            before, cpu0, t0 = traffic.read(), time.process_time(), time.perf_counter()
            one_collective(comm, name, layout, flat, shard)
            seconds.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - cpu0)
            after = traffic.read()
            if before is not None and after is not None:
                sent.append(after - before)
        out[f"{name}_s"] = statistics.median(seconds[1:])
        out[f"{name}_bytes"] = statistics.median(sent[1:]) if sent else None
        out[f"{name}_cpu_s"] = statistics.median(cpu[1:])
        comm.destroy()
    out["numel"] = float(sum(p.numel() for p in params))
    return out


def train_run(
    run: dict[str, Any],
    spec: dict[str, Any],
    tokens: torch.Tensor,
    slow: Slowdown,
    traffic: Traffic,
    rank: int,
    emu: Emulation | None = None,
) -> dict[str, Any]:
    """One method for ``spec['steps']`` optimizer steps; the raw timings of this rank."""
    model, alone, resident_before = model_and_compute_alone(spec, tokens, rank, emu)
    timing = emu or _RealCompute()
    k, steps = run.get("k", spec["micro_batches"]), spec["steps"]
    stream = batches(tokens, spec, rank)
    ddp, opt, paced = build_method(run, spec, model, k)

    tokens_per_mb = spec["batch"] * spec["seq"]
    records, step_ends, waits, per_step, mb_compute = [], [], [], [], []
    dist.barrier()
    up0, sent0, cpu0, t0 = traffic.across(), traffic.read(), time.process_time(), time.perf_counter()  # CPU: all
    in_step = 0

    def acco_micro_batch(model: torch.nn.Module, opt: ACCOOptimizer, ids: torch.Tensor, t_mb: float) -> None:
        timing.begin()
        loss = model(input_ids=ids, labels=ids).loss
        timing.forward_done()
        loss.backward()
        opt.after_backward()  # on a GPU part of the micro-batch: the emulated time includes it
        timing.end()
        records.append((time.perf_counter() - t0, loss.item(), tokens_per_mb))
        mb_compute.append(time.perf_counter() - t_mb)

    def step_ended(opt: ACCOOptimizer) -> None:
        step_ends.append(time.perf_counter() - t0)
        waits.append(opt.last_step_stats["wait_s"])
        per_step.append(int(opt.last_step_stats["micro_batches"]))

    pacer = paced_data(tokens, spec, dist.get_world_size() * k) if ddp is None and paced else None
    while pacer is not None and len(step_ends) < steps:  # paced: this rank's micro-batches of each step
        for ids in pacer.step_batches(opt):
            slow()
            acco_micro_batch(model, opt, ids, time.perf_counter())
        step_ended(opt)
    while len(step_ends) < steps:
        ids = next(stream)
        slow()
        t_mb = time.perf_counter()
        if ddp is not None:
            in_step += 1
            ctx = ddp.no_sync() if in_step < k else contextlib.nullcontext()
            with ctx:
                timing.begin()
                loss = ddp(input_ids=ids, labels=ids).loss
                timing.forward_done()
                (loss / k).backward()
                timing.end()
            records.append((time.perf_counter() - t0, loss.item(), tokens_per_mb))
            if in_step < k:  # the last backward also all-reduces: not compute alone
                mb_compute.append(time.perf_counter() - t_mb)
            if in_step == k:
                torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_GRAD_NORM)
                opt.step()
                opt.zero_grad(set_to_none=True)
                step_ends.append(time.perf_counter() - t0)
                waits.append(None)
                per_step.append(k)
                in_step = 0
        else:
            acco_micro_batch(model, opt, ids, t_mb)
            if opt.ready_to_step():
                opt.step()
                step_ended(opt)
    if ddp is None:
        opt.finalize()  # the model holds the committed parameters
        opt.close()  # its process groups too
    cpu1, wall = time.process_time(), time.perf_counter() - t0
    dist.barrier()
    sent1, up1 = traffic.read(), traffic.across()
    log = {
        **run,
        **{"step_ends": step_ends, "waits": waits, "micro_batches": per_step, "records": records},
        **{"compute_alone_s": alone, "micro_batch_compute_s": mb_compute, "cpu_s": cpu1 - cpu0, "wall_s": wall},
        "tx_bytes": None if sent0 is None or sent1 is None else sent1 - sent0,
        "across_tx_bytes": None if up0 is None or up1 is None else up1 - up0,
        "peak_mem_bytes": _memory("VmHWM"),
        "resident_before_bytes": resident_before,
        "buffer_bytes": 4 * sum(p.numel() for p in model.parameters() if p.requires_grad),
    }
    del model, opt, ddp
    return log


def model_and_compute_alone(
    spec: dict[str, Any], tokens: torch.Tensor, rank: int, emu: Emulation | None
) -> tuple[torch.nn.Module, list[float], int | None]:
    """(model, compute alone, resident memory before the model). The compute alone is measured again before each
    run (both ranks at once, one step's micro-batches on a stream of their own): this shared machine's speed
    drifts by several percent within minutes, so the compute time a run is compared with is measured next to it,
    not only once per setting."""
    _reset_peak_memory()
    resident_before = _memory("VmRSS")
    model = build_model(spec, emu)
    dist.barrier()
    alone = compute_alone(model, batches(tokens, spec, rank + 1000), 4, warmup=1, emu=emu)
    _reset_peak_memory()
    return model, alone, resident_before


def build_method(
    run: dict[str, Any], spec: dict[str, Any], model: torch.nn.Module, k: int
) -> tuple[torch.nn.parallel.DistributedDataParallel | None, Any, bool]:
    """(DDP wrapper or None, optimizer, paced) for the run's method: DDP as Trainer runs it (no_sync while
    accumulating, all-reduce in the last backward) or an ACCOOptimizer; paced runs take ACCOTrainer's path (the
    same global batch of 2 x k micro-batches, each rank at its own pace)."""
    method, wire = method_parts(run["method"])
    if method in fsdp_runs.METHODS:  # FSDP2 inside each node: HSDP, or ACCO's rounds across nodes
        return *fsdp_runs.build(run, spec, model, k, MAX_GRAD_NORM), False
    if method == "ddp":
        ddp = torch.nn.parallel.DistributedDataParallel(model)
        if wire == "bf16":  # the matching choice for a bf16 wire: DDP's compression hook
            ddp.register_comm_hook(None, bf16_wire_hook)
        return ddp, torch.optim.AdamW(model.parameters(), lr=spec["lr"], weight_decay=0.0), False
    paced = accumulation_name(run["accumulation"]) == "paced"
    opt = ACCOOptimizer(model.parameters(), schedule=method, accumulation="paced" if paced else "fixed",
                        micro_batches=k, max_grad_norm=MAX_GRAD_NORM, lr=spec["lr"], weight_decay=0.0,
                        comm_dtype=wire, gather_dtype=gather_of(run["method"]),
                        bucket_numel=spec.get("bucket_numel"))  # fmt: skip
    return None, opt, paced


def main(spec_path: str, out_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(spec.get("threads", 1))
    timeout = datetime.timedelta(seconds=spec.get("timeout_s", 600))
    dist.init_process_group("gloo", timeout=timeout)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    factor = spec["slow_factor"] if rank == spec.get("slow_rank", 1) else 1.0
    emu = None
    if spec.get("emulate"):  # GPU-like compute: the slow rank's micro-batch is stated longer, no extra sleep
        e = spec["emulate"]
        # without micro_batch_s it is set from the round measured alone (comm_over_compute), below
        emu = Emulation(e.get("micro_batch_s", 0.0) * factor, e["params"], e.get("forward_share", 1 / 3))
        factor = 1.0
    slow = Slowdown(factor)
    devices = spec.get("devices") or [None] * world_size
    uplinks = spec.get("uplinks") or [None]  # (namespace, device) of each node's uplink, two levels only
    uplink = uplinks[rank // (world_size // len(uplinks))]
    traffic = Traffic(devices[rank], spec.get("shared_device", False), world_size, uplink, len(uplinks))
    tokens = load_tokens(spec.get("text_path"), spec["seed"])
    say = (lambda msg: print(f"[bench {spec['label']}] {msg}", flush=True)) if rank == 0 else (lambda msg: None)

    model = build_model(spec, emu)
    dist.barrier()
    repeats = spec.get("calibration_repeats", 10) // 2
    per_node = spec.get("fsdp_shard")  # FSDP methods: what crosses between nodes is one FSDP shard's worth
    comm = fsdp_runs.comm_alone(model, per_node, repeats) if per_node else comm_alone(model, traffic, repeats)
    if emu is not None and spec["emulate"].get("comm_over_compute"):
        # a micro-batch's time from the round measured alone: one round = comm_over_compute x a step's compute
        # (the slowest rank's round; every rank the same figure, the slow rank its factor on top)
        slowest = torch.tensor([comm["all_to_all_s"]])
        dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
        base = slowest.item() / (spec["emulate"]["comm_over_compute"] * spec["micro_batches"])
        emu.micro_batch_s = base * (spec["slow_factor"] if rank == spec.get("slow_rank", 1) else 1.0)
    dist.barrier()  # every rank computes alone at the same time, as they will while training
    alone = compute_alone(model, batches(tokens, spec, rank), spec.get("calibration_repeats", 10), emu=emu)
    slow.calibrate(statistics.median(alone))  # the slow rank's sleep: fixed for the whole setting
    del model
    t_step = statistics.median(alone) * spec["micro_batches"]
    say(f"compute alone {t_step:.3f} s/step{' (emulated)' if emu else ''}; round alone {comm['all_to_all_s']:.3f} s")
    runs = []
    for i, run in enumerate(spec["runs"]):
        log = train_run(run, spec, tokens, slow, traffic, rank, emu)
        alone += log["compute_alone_s"]
        runs.append(log)
        ends = log["step_ends"]
        step = statistics.median([b - a for a, b in zip(ends[2:], ends[3:])] or [float("nan")])
        say(f"{i + 1}/{len(spec['runs'])} {run['method']} {run['accumulation']} (repeat {run['repeat']}): "
            f"{step:.3f} s/step, loss {statistics.mean(r[1] for r in log['records'][-8:]):.3f}")  # fmt: skip
    # one micro-batch's compute alone (the slow rank's includes its sleep): the median of every measurement of
    # the setting, before and between the runs
    t_base = statistics.median(alone)
    for log in runs:
        log["t_base"], log["t_micro"] = t_base, t_base + slow.seconds
    out = {"rank": rank, "t_base": t_base, "t_micro": t_base + slow.seconds, "comm": comm, "runs": runs}
    Path(out_path).write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(*sys.argv[1:3])
