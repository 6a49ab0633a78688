"""The GPU check in one command: the GPU test tier, then ACCOTrainer against Trainer on a ~1B Llama, then memory
against the memory report, then the gradient hook's accumulation kernel and its alternatives
(``benchmarks/accumulate_kernels.py``). One results file and a table.

    make gpu-check                                   # on one GPU: under 8 minutes, imports included
    python benchmarks/gpu_check.py [--out benchmarks/results] [--steps 12] [--skip_tests]
    python benchmarks/gpu_check.py --device cpu --tiny --skip_tests --steps 4 --out outputs/gpu_check   # plumbing

Each method trains the same model from the same config (no download: LlamaForCausalLM from a LlamaConfig, random
token ids, seeded) in a process of its own, one rank (ACCOTrainer makes a one-rank process group; NCCL runs its
real collectives there), ``bf16=True``, sdpa attention:

* ``trainer_bf16``: Trainer with bf16 weights (pure-bf16 AdamW): the fastest plain Trainer;
* ``trainer_fp32_autocast``: Trainer with fp32 weights under bf16 autocast;
* ``acco_sync`` / ``acco_acco``: ACCOTrainer with bf16 weights, ``acco_schedule`` sync / acco, the gradient hook
  adding with torch's kernels (``HF_ACCO_ACCUMULATE=torch``);
* ``acco_sync_triton`` / ``acco_acco_triton``: the same with ``HF_ACCO_ACCUMULATE=triton`` (the gradient hook's
  Triton kernels, ``hf_acco/engine/kernels.py``; left out where Triton is not installed): whether the hook should
  add that way by default is decided from these runs beside the two above.

Per method: the median step time over the steps after ``--warmup`` and before the last three (each step timed
between CUDA synchronisations at Trainer's step begin and end), tokens per second, the peak and the step-end
allocated memory, the final loss, and, from a profile of the last three steps, the device-to-host copies they made
(count, bytes, GPU time; how many the main thread asked for, the rest being the round thread's, which wait only
for the round's stream); for the ACCO runs the memory report's persistent bytes
(``hf_acco.tools.memory.engine_memory``) beside what the GPU held at a step end. The file records the GPU, the
versions and the command; the thresholds it checks are the issue's (acco <= 1.05 x and sync <= 1.03 x Trainer's
pure-bf16 step, persistent memory within 2 % of the report, no device-to-host copy of data in a step: none over 64
bytes, on the main thread no more scalar reads than Trainer's own step makes, its loss logging's, and on the rounds'
thread no more than two a round, its weight and its norm, which wait for the round's stream alone).
A measurement, not a test: it exits 0 whatever the figures, 1 if a run fails.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
METHODS = ("trainer_bf16", "trainer_fp32_autocast", "acco_sync", "acco_acco", "acco_sync_triton", "acco_acco_triton")
LIMITS = {"acco_acco": 1.05, "acco_sync": 1.03, "acco_acco_triton": 1.05, "acco_sync_triton": 1.03}  # / trainer_bf16
MEMORY_TOLERANCE = 0.02
TESTS_TIMEOUT_S = 360  # the GPU tier's limit: the measurements that follow still run
PROFILED = 3  # the last steps of each run, under the profiler (left out of the timing)
ROUND_READS = 2  # a round's reads of its device: a weight kept on it (Trainer's token count), its gradient norm
ROUNDS_PER_STEP = {"sync": 1, "acco": 2}


def model_config(tiny: bool) -> dict:
    """~0.95B parameters (hidden 2048, 16 layers), or a tiny one for the plumbing on CPU."""
    if tiny:
        return dict(
            vocab_size=128,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=64,
        )
    return dict(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=2048,
    )


def run_method(method: str, args: argparse.Namespace) -> dict:
    """One method's training run, in this process."""
    import torch
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from hf_acco import ACCOConfig, ACCOTrainer
    from hf_acco.tools.memory import engine_memory

    cuda = args.device == "cuda"
    seq = 64 if args.tiny else args.seq
    config = LlamaConfig(**model_config(args.tiny), attn_implementation="sdpa")
    torch.manual_seed(0)
    fp32 = method == "trainer_fp32_autocast"
    with torch.device(args.device):  # initialised where it trains: seconds, not a minute of 1B normal_() on the host
        model = LlamaForCausalLM(config).to(dtype=torch.float32 if fp32 else torch.bfloat16)
    numel = sum(p.numel() for p in model.parameters())
    rows = args.batch * args.micro_batches * (args.steps + 1)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (rows, seq), generator=g)
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})

    times: list[float] = []
    memory: dict[str, float] = {}

    class Clock(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):  # noqa: ANN001, ANN201
            if cuda:
                torch.cuda.synchronize()
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **kw):  # noqa: ANN001, ANN201
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t0)
            if cuda and state.global_step == args.warmup:
                memory["step_end_allocated"] = torch.cuda.memory_allocated()

    acco = method.startswith("acco_")
    settings = dict(
        output_dir=tempfile.mkdtemp(prefix=f"gpu_check_{method}_"),
        per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.micro_batches,
        learning_rate=1e-4,
        max_steps=args.steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        bf16=True,
        use_cpu=not cuda,
        seed=0,
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    if acco:
        settings["acco_schedule"] = method.removeprefix("acco_").removesuffix("_triton")
    training_args = (ACCOConfig if acco else TrainingArguments)(**settings)
    trainer = (ACCOTrainer if acco else Trainer)(
        model=model, args=training_args, train_dataset=data, callbacks=[Clock()]
    )
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    copies = None
    if cuda:  # the last PROFILED steps under the profiler (not timed): the device-to-host copies they made
        copies = _profile_copies(trainer, args)
    else:
        trainer.train()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    timed = times[args.warmup : len(times) - (PROFILED if cuda else 0)] or times
    step_s = statistics.median(timed)
    out = {
        "method": method,
        "params": numel,
        "step_s": step_s,
        "steps_timed": len(timed),
        "tokens_per_s": args.batch * args.micro_batches * seq / step_s,
        "final_loss": losses[-1] if losses else None,
        "peak_allocated_bytes": torch.cuda.max_memory_allocated() if cuda else None,
        "step_end_allocated_bytes": memory.get("step_end_allocated"),
        "device_to_host": copies,
    }
    if acco:
        report = engine_memory(
            numel,
            1,
            param_dtype=torch.bfloat16,
            comm_dtype="auto",
            schedule=settings["acco_schedule"],
            ranks_per_node=1,
        )
        out["report_persistent_bytes"] = report.persistent_bytes
    return out


def _profile_copies(trainer, args: argparse.Namespace) -> dict:  # noqa: ANN001
    """Train, with the profiler on for the last PROFILED steps; the device-to-host copies of those steps (from the
    trace's memcpy events: count, bytes, GPU time), all and those of more than 64 bytes (data, not a scalar read)."""
    import torch
    from torch.profiler import ProfilerActivity, profile, schedule
    from transformers import TrainerCallback

    prof = profile(
        activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
        schedule=schedule(wait=args.steps - PROFILED, warmup=0, active=PROFILED, repeat=1),
    )

    class Step(TrainerCallback):
        def on_step_end(self, a, state, control, **kw):  # noqa: ANN001, ANN201
            prof.step()

    trainer.add_callback(Step())
    with prof:
        trainer.train()
    torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text()).get("traceEvents", [])
    return device_to_host(events, threading.get_native_id())


def device_to_host(events: list[dict], main_thread: int) -> dict:
    """The device-to-host copies of a chrome trace's profiled steps (count, bytes, GPU time), all and those of more
    than 64 bytes (data, not a scalar read), and by the thread that asked for them (the CUDA runtime call with the
    copy's correlation id): ``main_thread`` (its native id: Trainer's loop, where a read makes the host wait for the
    compute) or another (the round's, which waits alone); the GPU's busy time and its top kernels."""
    copies = [
        e
        for e in events
        if e.get("cat") == "gpu_memcpy" and ("DtoH" in e.get("name", "") or "Device -> P" in e["name"])
    ]
    caller = {
        e.get("args", {}).get("correlation"): e.get("tid")
        for e in events
        if e.get("cat") == "cuda_runtime" and "Memcpy" in e.get("name", "")
    }
    on_main = [e for e in copies if caller.get(e.get("args", {}).get("correlation")) == main_thread]
    sizes = [int(e.get("args", {}).get("bytes", 0)) for e in copies]
    kernels: dict[str, float] = {}
    for e in events:
        if e.get("cat") == "kernel":
            kernels[e["name"][:90]] = kernels.get(e["name"][:90], 0.0) + float(e.get("dur", 0)) / 1e3 / PROFILED
    large = [n for n in sizes if n > 64]
    return {
        "steps": PROFILED,
        "count": len(copies),
        "count_main_thread": len(on_main),  # the rest: other threads (the round's)
        "bytes": sum(sizes),
        "ms": sum(float(e.get("dur", 0)) for e in copies) / 1e3,
        "count_over_64_bytes": len(large),
        "bytes_over_64_bytes": sum(large),
        "kernel_ms_per_step": sum(kernels.values()),  # the GPU's busy time, and where it goes (the top 15)
        "top_kernels_ms_per_step": dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:15]),
    }


def versions() -> dict:
    import accelerate
    import torch
    import transformers

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else platform.processor() or "cpu"
    return {
        "gpu": gpu,
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
    }


def gpu_tests(report: Path) -> dict:
    """The GPU tier (tests/test_gpu.py); its counts and the failures' names. Four tests at a time where pytest-xdist
    is installed: each spends most of its ~15 s starting a process, CUDA and NCCL, not on the GPU."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-m", "gpu", "tests/test_gpu.py", f"--junitxml={report}"]
    if importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", "4"]
    try:
        done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=TESTS_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        tail = (e.stdout or b"")[-1500:]
        return {"returncode": None, "timed_out_s": TESTS_TIMEOUT_S, "failed": [], "tail": str(tail)}
    import xml.etree.ElementTree as ET

    suite = ET.parse(report).getroot().find("testsuite") if report.exists() else None
    failed = []
    if suite is not None:
        for case in suite.iter("testcase"):
            if case.find("failure") is not None or case.find("error") is not None:
                failed.append(case.get("name"))
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")} if suite is not None else {}
    return {"returncode": done.returncode, **counts, "failed": failed, "tail": done.stdout[-1500:]}


def child_env() -> dict[str, str]:
    """A part's environment: this checkout's hf_acco first, then the carried packages (PYTHONPATH) as they are."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}


def part_result(args: argparse.Namespace, script: str) -> dict:
    """``benchmarks/<script>`` on this device, in a process of its own (its result, or its error)."""
    with tempfile.TemporaryDirectory() as tmp:
        file = Path(tmp) / "part.json"
        cmd = [sys.executable, str(ROOT / "benchmarks" / script), "--device", args.device, "--out", str(file),
               *(["--tiny"] if args.tiny else [])]  # fmt: skip
        done = subprocess.run(cmd, cwd=ROOT, env=child_env(), capture_output=True, text=True)
        if done.returncode or not file.exists():
            return {"error": done.stderr[-3000:]}
        return json.loads(file.read_text())


def verdicts(runs: dict[str, dict]) -> dict:
    base = runs.get("trainer_bf16")
    out: dict = {}
    for method, limit in LIMITS.items():
        if base and method in runs:
            ratio = runs[method]["step_s"] / base["step_s"]
            out[f"{method}_vs_trainer_bf16"] = {"ratio": ratio, "limit": limit, "ok": ratio <= limit}
    for method in [m for m in runs if m.startswith("acco_")]:
        run = runs[method]
        held, predicted = run.get("step_end_allocated_bytes"), run.get("report_persistent_bytes")
        if held and predicted:
            gap = abs(held - predicted) / held
            out[f"{method}_memory"] = {"held": held, "report": predicted, "gap": gap, "ok": gap <= MEMORY_TOLERANCE}
        copies = run.get("device_to_host")
        if copies is not None:
            # no copy of data; on the main thread (where a read makes the host wait for the compute) no more scalar
            # reads than Trainer's own step makes (its logging's); on the rounds' thread, no more than each round's
            # own (its device weight and its norm, read on its stream: they wait for the round's kernels only)
            base_copies = (base or {}).get("device_to_host", {})
            base_main = base_copies.get("count_main_thread", base_copies.get("count", 0))
            main = copies.get("count_main_thread", copies["count"])
            schedule = method.removeprefix("acco_").removesuffix("_triton")
            round_limit = ROUND_READS * ROUNDS_PER_STEP[schedule] * copies["steps"]
            ok = copies["count_over_64_bytes"] == 0 and main <= base_main and copies["count"] - main <= round_limit
            out[f"{method}_device_to_host"] = {
                "count": copies["count"],
                "count_main_thread": main,
                "count_over_64_bytes": copies["count_over_64_bytes"],
                "trainer_bf16_count": base_copies.get("count", 0),
                "trainer_bf16_main_thread": base_main,
                "rounds_limit": round_limit,
                "ok": ok,
            }
    return out


def table(result: dict) -> str:
    head = (
        "| method | s/step (median) | tokens/s | peak allocated (GB) | at step end (GB) | report (GB) | final loss |"
    )
    rows = [head, "|---|---:|---:|---:|---:|---:|---:|"]

    def gb(n: float | None) -> str:
        return "-" if n is None else f"{n / 1e9:.2f}"

    for r in result["runs"].values():
        rows.append(
            f"| {r['method']} | {r['step_s']:.3f} | {r['tokens_per_s']:.0f} | {gb(r['peak_allocated_bytes'])} "
            f"| {gb(r['step_end_allocated_bytes'])} | {gb(r.get('report_persistent_bytes'))} "
            f"| {r['final_loss']:.4f} |"
        )
    tests = result.get("gpu_tests")
    if tests:
        ran = tests.get("tests", 0)
        passed = ran - tests.get("failures", 0) - tests.get("errors", 0) - tests.get("skipped", 0)
        failed = f"; failed: {', '.join(tests['failed'])}" if tests["failed"] else ""
        rows.append(f"\nGPU tier: {passed} of {ran} passed{failed}")
    for name, v in result["verdicts"].items():
        rows.append(f"- {name}: {'ok' if v['ok'] else 'NOT MET'} ({ {k: v[k] for k in v if k != 'ok'} })")
    kernels = result.get("accumulation_kernels", {}).get("variants")
    if kernels:  # ms per pass over every parameter (one micro-batch's gradients), and the bandwidth it makes
        figures = ", ".join(f"{k} {v['ms']:.2f} ms ({v['GB_per_s']:.0f} GB/s)" for k, v in kernels.items())
        rows.append(f"\nAccumulating one micro-batch's gradients: {figures}")
    return "\n".join(rows)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python benchmarks/gpu_check.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--out", default="benchmarks/results", help="folder of gpu_check_<gpu>.json")
    p.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    p.add_argument("--tiny", action="store_true", help="a tiny model (the plumbing, on CPU)")
    p.add_argument("--steps", type=int, default=15, help="the last 3 are profiled (on a GPU), not timed")
    p.add_argument("--warmup", type=int, default=4, help="first steps left out of the timing")
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--batch", type=int, default=4, help="rows per micro-batch")
    p.add_argument("--micro_batches", type=int, default=4, help="gradient_accumulation_steps")
    p.add_argument("--methods", nargs="+", choices=METHODS, help="default: all (the _triton ones where Triton is)")
    p.add_argument("--skip_tests", action="store_true", help="leave the GPU test tier out")
    p.add_argument("--skip_kernels", action="store_true", help="leave the accumulation kernels' timing out")
    p.add_argument("--run", choices=METHODS, help=argparse.SUPPRESS)  # one method, in a process of its own
    p.add_argument("--result", help=argparse.SUPPRESS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if args.run:
        Path(args.result).write_text(json.dumps(run_method(args.run, args)))
        return 0
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            print("gpu_check: no CUDA device here; on a CPU, --device cpu --tiny checks the plumbing", file=sys.stderr)
            return 2
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    started = time.time()
    command = "python benchmarks/gpu_check.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    settings = {k: v for k, v in vars(args).items() if k not in ("run", "result")}
    result: dict = {"command": command, "settings": settings, **versions()}
    name = "".join(c if c.isalnum() else "_" for c in result["gpu"].lower()).strip("_") or "device"
    path = out_dir / f"gpu_check_{name}.json"

    def write() -> None:  # after each part: a run stopped at its time limit keeps what it measured
        result["verdicts"] = verdicts(result["runs"])
        result["wall_s"] = time.time() - started
        path.write_text(json.dumps(result, indent=1) + "\n")

    result["runs"], failed = {}, []
    methods = args.methods or [m for m in METHODS if not m.endswith("_triton") or importlib.util.find_spec("triton")]
    settings["methods"] = methods
    if not args.skip_tests:
        result["gpu_tests"] = gpu_tests(out_dir / f"gpu_tests_{name}.xml")
        write()
    for method in methods:
        with tempfile.TemporaryDirectory() as tmp:
            file = Path(tmp) / "result.json"
            cmd = [sys.executable, __file__, "--run", method, "--result", str(file), *(argv or sys.argv[1:])]
            env = child_env() | ({"ACCELERATE_USE_CPU": "1"} if args.device == "cpu" else {})
            if method.endswith("_triton"):  # (on a CPU, Triton's interpreter: the plumbing)
                env |= {"HF_ACCO_ACCUMULATE": "triton"} | ({"TRITON_INTERPRET": "1"} if args.device == "cpu" else {})
            elif method.startswith("acco_"):  # torch's kernels, whatever this shell's environment says
                env["HF_ACCO_ACCUMULATE"] = "torch"
            done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
            if done.returncode or not file.exists():
                failed.append(method)
                result["runs_failed"] = {**result.get("runs_failed", {}), method: done.stderr[-3000:]}
                continue
            result["runs"][method] = json.loads(file.read_text())
        write()
    if not args.skip_kernels:  # last, seconds: the hook's kernel and its alternatives (accumulate_kernels.py)
        result["accumulation_kernels"] = part_result(args, "accumulate_kernels.py")
        result["packed_round"] = part_result(args, "packed_round.py")  # the packed round's boundary passes
        write()
    write()
    print(table(result))
    print(f"written: {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
