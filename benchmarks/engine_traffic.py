"""The engine's own memory traffic: the bytes ACCOTrainer's engine reads and writes per optimizer step outside the
model's forward and backward, per parameter, next to the least a ZeRO-1 step needs.

    python benchmarks/engine_traffic.py                          # this tree: acco and sync, 2 gloo ranks
    python benchmarks/engine_traffic.py --base 824f643 e08c78f   # and earlier commits (git worktrees), side by side
    python benchmarks/engine_traffic.py --out recipes/results/engine/traffic

Every aten operation run by the engine is counted by a ``TorchDispatchMode`` entered in its three entry points
(patched around, so that any commit can be measured): the gradient hook (per micro-batch, inside backward), the
optimizer's ``after_backward`` and ``step`` (the step boundaries, on the main thread) and the round (what
``RoundRunner.launch`` runs on the round's thread). An operation reads its tensor arguments and writes its outputs,
or, in place, the arguments it mutates (``copy_``, ``zero_``, ``fill_`` write without reading); views and
allocations move nothing; the communicator's own work (gloo's sums on CPU) is counted apart and left out of the
engine's total (its bytes on the wire: ``benchmarks/engine.py bytes``). Counted over the steady steps (after
``--warmup``), divided by the steps and the model's parameters.

The ZeRO-1 minimum, per parameter and step, N ranks, M micro-batches, a bf16 model with fp32 sums, master weights
and Adam state: accumulating the gradients (the first micro-batch writes its sums: read 2, write 4; the others
add: read 2 + 4, write 4), the shard's Adam update (read weight, gradient, two moments, write three: 28 / N),
rounding the shard to bf16 for the all-gather (read 4 / N, write 2 / N), all-gathered in place into the model's
own storage (nothing more). ACCO adds a second update per step (the estimate: read 16 / N, write 2 / N) and a copy
of half A's sums for its round while half B goes on adding (read 4, write 4).

On a GPU (``--device cuda --world_size 1``) the same counts apply. A measurement of what the code does, not a timing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PHASES = ("hooks", "boundaries", "rounds")  # the engine's; "collectives" (the communicator's) is reported apart
WRITE_ONLY = {"copy_", "zero_", "fill_", "_foreach_copy_", "_foreach_zero_", "normal_", "uniform_"}
NO_TRAFFIC = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "_local_scalar_dense"}
READ_ONLY_ARGS = {"grads", "state_steps"}  # marked mutable by the fused optimizers' schemas, only read


def zero1_minimum(world_size: int, micro_batches: int, acco: bool) -> dict[str, float]:
    """The least bytes per parameter and step (see the module's docstring), by phase."""
    n, m = world_size, micro_batches
    hooks = 6 + 10 * (m - 1)
    rounds = (28 + 6) / n + ((16 + 2) / n if acco else 0.0)
    boundaries = 8.0 if acco else 0.0
    return {"hooks": hooks, "boundaries": boundaries, "rounds": rounds, "total": hooks + boundaries + rounds}


def _nbytes(value) -> int:  # noqa: ANN001
    import torch

    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_nbytes(v) for v in value)
    return 0


def op_bytes(func, args: tuple, kwargs: dict, out) -> tuple[int, int]:  # noqa: ANN001
    """(read, written) bytes of one aten operation."""
    name = func._schema.name.split("::")[-1]
    if name in NO_TRAFFIC:
        return 0, 0
    read = written = 0
    mutated = False
    for i, arg in enumerate(func._schema.arguments):
        value = args[i] if i < len(args) else kwargs.get(arg.name)
        size = _nbytes(value)
        if arg.alias_info is not None and arg.alias_info.is_write and arg.name not in READ_ONLY_ARGS:
            mutated = True
            written += size
            if name not in WRITE_ONLY:
                read += size
        else:
            read += size
    if not mutated:
        written += _nbytes(out)
    return read, written


class Traffic:
    """Bytes by phase and by operation, counted while ``measuring`` is set."""

    def __init__(self) -> None:
        self.measuring = False
        self.lock = threading.Lock()
        self.bytes: dict[str, float] = defaultdict(float)
        self.ops: dict[str, dict[str, float]] = {p: defaultdict(float) for p in (*PHASES, "collectives")}
        self.active = threading.local()

    @contextlib.contextmanager
    def phase(self, phase: str, counting: bool | None = None):  # noqa: ANN201
        """Count this thread's operations under ``phase`` inside (when ``counting``: by default, whether the
        steady steps are being measured now; a round passes what held when it was launched, so that each round
        is counted whole or not at all); an inner phase (a collective inside a round) takes over until it ends.
        The outermost one enters the dispatch mode."""
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = getattr(self.active, "phase", None)
        self.active.phase = phase
        if outer is not None:
            try:
                yield
            finally:
                self.active.phase = outer
            return
        traffic = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                if traffic.active.counting and not func.is_view and func.namespace == "aten":
                    read, written = op_bytes(func, args, kwargs, out)
                    now = traffic.active.phase
                    with traffic.lock:
                        traffic.bytes[now] += read + written
                        traffic.ops[now][func._schema.name.split("::")[-1]] += read + written
                return out

        self.active.counting = self.measuring if counting is None else counting
        try:
            with Mode():
                yield
        finally:
            self.active.phase = None


def patch(traffic: Traffic) -> None:
    """Count inside the engine's three entry points."""
    from hf_acco.comm.communicator import Communicator
    from hf_acco.engine.buffers import BufferPair
    from hf_acco.engine.core import ACCOOptimizer
    from hf_acco.engine.runner import RoundRunner

    def around(cls, name: str, phase: str) -> None:  # noqa: ANN001
        original = getattr(cls, name)

        def counted(self, *args, **kwargs):  # noqa: ANN001, ANN202
            with traffic.phase(phase):
                return original(self, *args, **kwargs)

        setattr(cls, name, counted)

    around(BufferPair, "_grad_hook", "hooks")
    around(ACCOOptimizer, "after_backward", "boundaries")
    around(ACCOOptimizer, "step", "boundaries")
    launch = RoundRunner.launch

    def counted_launch(self, fn):  # noqa: ANN001, ANN202  # all the round's thread does (the boundary copy too)
        counting = traffic.measuring  # launched in a measured step: counted whole, whenever it runs

        def run():  # noqa: ANN202
            with traffic.phase("rounds", counting):
                return fn()

        return launch(self, run)

    RoundRunner.launch = counted_launch
    for name in ("reduce_scatter", "all_gather", "all_reduce", "all_reduce_counts", "broadcast"):
        around(Communicator, name, "collectives")  # the wire's own work (gloo's sums on CPU), not the engine's


def measure(rank: int, world_size: int, cfg: dict) -> dict:
    import torch
    from datasets import Dataset
    from transformers import LlamaConfig, LlamaForCausalLM, TrainerCallback

    from hf_acco import ACCOConfig, ACCOTrainer

    traffic = Traffic()
    patch(traffic)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)  # fmt: skip
    with torch.device(cfg["device"]):
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    numel = sum(p.numel() for p in model.parameters())
    rows = 2 * cfg["micro_batches"] * world_size * (cfg["steps"] + 1)
    ids = torch.randint(0, config.vocab_size, (rows, 32), generator=torch.Generator().manual_seed(1))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})

    class Window(TrainerCallback):  # the steady steps: from the warm-up's end to the last step's beginning
        def on_step_begin(self, args, state, control, **kw):  # noqa: ANN001, ANN201
            traffic.measuring = cfg["warmup"] <= state.global_step < cfg["steps"] - 1

    with tempfile.TemporaryDirectory(prefix="engine_traffic_") as out:  # (each rank its own: nothing is saved)
        args = ACCOConfig(
            output_dir=out, per_device_train_batch_size=2,
            gradient_accumulation_steps=cfg["micro_batches"], max_steps=cfg["steps"], learning_rate=1e-3,
            acco_schedule=cfg["schedule"], bf16=True, use_cpu=cfg["device"] == "cpu", save_strategy="no",
            report_to=[], logging_steps=cfg["steps"], disable_tqdm=True, seed=0,
        )  # fmt: skip
        ACCOTrainer(model=model, args=args, train_dataset=data, callbacks=[Window()]).train()
    steps = cfg["steps"] - 1 - cfg["warmup"]
    per = float(numel * steps)
    return {
        "params": numel,
        "steps": steps,
        "bytes_per_param_step": {p: traffic.bytes[p] / per for p in (*PHASES, "collectives")},
        "ops": {
            p: {k: v / per for k, v in sorted(o.items(), key=lambda kv: -kv[1]) if v} for p, o in traffic.ops.items()
        },
    }


def run_here(cfg: dict) -> dict:
    from hf_acco.tools.multiprocess import run_ranks

    return run_ranks(measure, world_size=cfg["world_size"], backend=None, timeout=600, cfg=cfg)[0]


def run_code(code: Path, cfg: dict) -> dict:
    """This script on another tree's hf_acco (its own process)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "r.json"
        env = {**os.environ, "PYTHONPATH": str(code), "OMP_NUM_THREADS": "1"}
        cmd = [sys.executable, __file__, "--one", json.dumps(cfg), "--result", str(out)]
        subprocess.run(cmd, cwd=code, env=env, check=True)
        return json.loads(out.read_text())


def table(results: dict) -> str:
    from hf_acco.tools.results_docs import traffic_rows

    return "\n".join(traffic_rows(results)) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/engine_traffic.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--base", nargs="*", default=[], help="commits to measure beside this tree (worktrees)")
    p.add_argument("--schedules", nargs="+", default=["acco", "sync"])
    p.add_argument("--world_size", type=int, default=2)
    p.add_argument("--micro_batches", type=int, default=4)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--out", default="outputs/engine_traffic")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        Path(args.result).write_text(json.dumps(run_here(json.loads(args.one))))
        return 0
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--", "hf_acco"], cwd=ROOT, capture_output=True,
                           text=True).stdout.strip()  # fmt: skip
    trees: list[tuple[str, Path]] = [(head.stdout.strip() + (" + changes" if dirty else ""), ROOT)]
    with contextlib.ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        for i, base in enumerate(args.base):  # oldest first, as given; this tree last
            tree = tmp / f"base{i}"
            subprocess.run(["git", "worktree", "add", "-q", "--detach", str(tree), base], cwd=ROOT, check=True)
            stack.callback(subprocess.run, ["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT)
            trees.insert(i, (base, tree))
        runs = []
        for name, code in trees:
            for schedule in args.schedules:
                cfg = {k: getattr(args, k) for k in ("world_size", "micro_batches", "steps", "warmup", "device")}
                r = run_code(code, {**cfg, "schedule": schedule})
                least = zero1_minimum(args.world_size, args.micro_batches, schedule == "acco")
                runs.append({"code": name, "schedule": schedule, **r, "zero1_minimum": least})
    command = "python benchmarks/engine_traffic.py " + " ".join(argv if argv is not None else sys.argv[1:])
    results = {"command": command, "settings": vars(args), "runs": runs}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "traffic.json").write_text(json.dumps(results, indent=1) + "\n")
    (out / "table.md").write_text(table(results))
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
