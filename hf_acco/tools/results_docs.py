"""Results rendered for README.md and docs/benchmarks.md by ``python -m hf_acco.tools.docs``: `make gpu-check`'s
(benchmarks/results/gpu_check_<gpu>.json and the GPU tier's gpu_tests_<gpu>.xml) and the engine's memory traffic
(``benchmarks/engine_traffic.py``, recipes/results/engine/traffic/), the versions `make test-range` ran the suite on
(benchmarks/results/test_range/)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]

GPU_RESULTS = ROOT / "benchmarks" / "results"


def _gpu_tier(gpu: str) -> tuple[int, int, list[str]]:
    """(passed, ran, failed names) of ``benchmarks/results/gpu_tests_<gpu>.xml`` (the GPU tier's JUnit report)."""
    import xml.etree.ElementTree as ET

    suite = ET.parse(GPU_RESULTS / f"gpu_tests_{gpu}.xml").getroot().find("testsuite")
    assert suite is not None
    failed = [
        c.get("name", "")
        for c in suite.iter("testcase")
        if c.find("failure") is not None or c.find("error") is not None
    ]
    ran = int(suite.get("tests", 0)) - int(suite.get("skipped", 0))
    return ran - len(failed), ran, failed


def gpu_status(gpu: str = "nvidia_h200") -> str:
    """The README's status line for a GPU, from ``make gpu-check``'s files in benchmarks/results/."""
    result = json.loads((GPU_RESULTS / f"gpu_check_{gpu}.json").read_text())
    passed, ran, failed = _gpu_tier(gpu)
    runs, v = result["runs"], result["verdicts"]
    base = runs["trainer_bf16"]
    params = base["params"] / 1e9
    gap = max(abs(runs[m]["final_loss"] / base["final_loss"] - 1) for m in ("acco_acco", "acco_sync"))
    s = result["settings"]
    return (
        f"On one {result['gpu']} (torch {result['torch']}, CUDA {result['cuda']}, transformers "
        f"{result['transformers']}, one NCCL rank): the GPU test tier, {passed} of {ran} tests passed"
        + (f" (failed: {', '.join(f'`{n}`' for n in failed)})" if failed else "")
        + f". `ACCOTrainer` on a {params:.2f}B-parameter Llama (bf16 weights, sequences of {s['seq']}, "
        f"{s['micro_batches']} micro-batches of {s['batch']} per step): a step took "
        f"{v['acco_acco_vs_trainer_bf16']['ratio']:.2f}x (`acco`) and {v['acco_sync_vs_trainer_bf16']['ratio']:.2f}x "
        f"(`sync`) `Trainer`'s pure-bf16 step ({base['step_s']:.3f} s), the final loss within {100 * gap:.2f} % of "
        f"`Trainer`'s; the memory held at a step "
        f"end was within {100 * v['acco_acco_memory']['gap']:.1f} % of `python -m hf_acco.memory`'s figure.\n"
    )


def tested_versions() -> str:
    """The README's "Tested with" line: the oldest and the newest transformers / accelerate pair `make test-range`
    ran the default suite on (benchmarks/results/test_range/<pair>.json), and how it went."""
    runs = {p: json.loads((GPU_RESULTS / "test_range" / f"{p}.json").read_text()) for p in ("oldest", "newest")}

    def outcome(r: dict) -> str:
        v = r["versions"]
        went = f"{r['passed']} passed" + (f", {r['failed']} FAILED" if r["failed"] or r["pytest_exit_status"] else "")
        return f"transformers {v['transformers']} with accelerate {v['accelerate']} ({went}, {r['date']})"

    return (
        f"The test suite ran on the oldest transformers / accelerate pair this version allows, "
        f"{outcome(runs['oldest'])}, and on the newest, {outcome(runs['newest'])}; releases between them are "
        "inside the tested range.\n"
    )


VERDICT_FIGURES = (
    *("ratio", "limit", "gap", "count_over_64_bytes", "trainer_bf16_count", "count"),
    *("count_main_thread", "trainer_bf16_main_thread", "rounds_limit"),  # the device-to-host reads by thread
)


def gpu_check_table(gpu: str = "nvidia_h200") -> str:
    """``make gpu-check``'s table (benchmarks/gpu_check.py), with its GPU time per step by kernel family."""
    result = json.loads((GPU_RESULTS / f"gpu_check_{gpu}.json").read_text())
    out = [
        f"`{result['command']}` on {result['gpu']} (torch {result['torch']}, transformers {result['transformers']}):",
        "",
        "| method | s/step (median) | tokens/s | GPU busy ms/step | peak allocated (GB) | at step end (GB) "
        "| report (GB) | device-to-host copies / step (bytes) | final loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["runs"].values():
        d = r["device_to_host"] or {}
        report = r.get("report_persistent_bytes")
        out.append(
            f"| {r['method']} | {r['step_s']:.3f} | {r['tokens_per_s']:.0f} | {d.get('kernel_ms_per_step', 0):.0f} "
            f"| {r['peak_allocated_bytes'] / 1e9:.2f} | {r['step_end_allocated_bytes'] / 1e9:.2f} "
            f"| {'-' if report is None else f'{report / 1e9:.2f}'} "
            f"| {d.get('count', 0) / d.get('steps', 1):.1f} ({d.get('bytes', 0) / d.get('steps', 1):.0f}) "
            f"| {r['final_loss']:.4f} |"
        )
    passed, ran, failed = _gpu_tier(gpu)
    out.append(
        f"\nGPU tier (`gpu_tests_{gpu}.xml`): {passed} of {ran} passed"
        + (f"; failed: {', '.join(failed)}" if failed else "")
    )
    out.append("")
    for name, v in result["verdicts"].items():
        shown = {k: (round(x, 4) if isinstance(x, float) else x) for k, x in v.items() if k in VERDICT_FIGURES}
        out.append(f"- {name}: {'met' if v['ok'] else 'NOT MET'} {shown}")
    return "\n".join(out) + "\n"


TRAFFIC_PHASES = ("hooks", "boundaries", "rounds")


def traffic_rows(result: dict) -> list[str]:
    """The table of ``benchmarks/engine_traffic.py``'s results (what it prints, and what the docs render)."""
    out = [
        "| code | schedule | gradient hooks | step boundaries | rounds | engine total | ZeRO-1 minimum "
        "| total / minimum |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in result["runs"]:
        b, least = r["bytes_per_param_step"], r["zero1_minimum"]
        total = sum(b[p] for p in TRAFFIC_PHASES)
        out.append(
            f"| {r['code']} | {r['schedule']} | {b['hooks']:.1f} | {b['boundaries']:.1f} | {b['rounds']:.1f} "
            f"| {total:.1f} | {least['total']:.1f} | {total / least['total']:.2f}x |"
        )
    return out


def traffic_table(folder: str = "recipes/results/engine/traffic") -> str:
    """``benchmarks/engine_traffic.py``: bytes per parameter and step by phase, beside the ZeRO-1 minimum, and
    what the latest code spends above it, by operation."""
    result = json.loads((ROOT / folder / "traffic.json").read_text())
    out = [
        f"`{result['command']}` ({result['settings']['world_size']} gloo ranks, "
        f"{result['settings']['micro_batches']} micro-batches per step, a bf16 model), bytes per parameter and step:",
        "",
        *traffic_rows(result),
    ]
    out += ["", "The latest code's operations, bytes per parameter and step:", ""]
    for r in result["runs"][-2:]:
        for phase in TRAFFIC_PHASES:
            ops = ", ".join(f"`{k}` {v:.1f}" for k, v in r["ops"][phase].items() if v >= 0.05)
            out.append(f"- {r['schedule']}, {phase}: {ops}")
    return "\n".join(out) + "\n"


def bench_ab_table(name: str = "ff2df1a_vs_afaad44") -> str:
    """``python benchmarks/bench_ab.py``: the headline figures of each side's runs, alternated, and their medians."""
    run = json.loads((ROOT / "recipes" / "results" / "engine" / "bench_ab" / f"{name}.json").read_text())
    figures = list(run["medians"]["base"])
    out = ["| code | run | " + " | ".join(figures) + " |", "|---|---|" + "---:|" * len(figures)]
    for side in ("base", "head"):
        rows = [(str(i + 1), r) for i, r in enumerate(run["rounds"][side])] + [("median", run["medians"][side])]
        out += [f"| {run[side]} | {i} | " + " | ".join(f"{r[k]:.3f}" for k in figures) + " |" for i, r in rows]
    return "\n".join(out) + "\n"


def beside_table(folder: str, order: tuple[str, ...]) -> str:
    """``python benchmarks/beside.py`` on several commits' code (``PYTHONPATH=<worktree>``), runs alternated: the
    medians over runs and ranks of a micro-batch alone and beside back-to-back rounds, and of the round's wall."""
    runs: dict[str, list[dict]] = {}
    for path in sorted((ROOT / "recipes" / "results" / "engine" / "beside" / folder).glob("*.json")):
        run = json.loads(path.read_text())
        runs.setdefault(run["code_commit"], []).extend(run["ranks"])
    med = lambda ranks, key: statistics.median(r[key] for r in ranks)  # noqa: E731
    out = ["| code | runs x ranks | micro-batch alone (ms) | beside the rounds (ms) | ratio | round beside (ms) |"]
    out.append("|---|---:|---:|---:|---:|---:|")
    for code in order:
        ranks = runs[code]
        cells = [med(ranks, k) for k in ("micro_batch_alone_ms", "micro_batch_beside_ms", "beside_over_alone")]
        out.append(f"| {code} | {len(ranks)} | {cells[0]:.1f} | {cells[1]:.1f} | {cells[2]:.3f} | "
                   f"{med(ranks, 'round_beside_ms'):.1f} |")  # fmt: skip
    return "\n".join(out) + "\n"


def hsdp_memory_table() -> str:
    """``python -m hf_acco.memory --fsdp_shard 8 --grad_dtype bf16 --comm_dtype int8 --gather_dtype int8``: per
    GPU, FSDP2 over each machine's 8 GPUs and ACCO across machines, for 70B on 8 machines, 34B on 4 and 13B on 2
    (bf16 models, FSDP's groups assumed Llama-shaped, Accelerate's bf16 reduce): the engine's persistent bytes,
    FSDP's working set, the peak, the GPU's need with the CUDA context's and NCCL's allowance, what is left of an
    80 GiB GPU for the activations; the ``sync`` schedule's need and HSDP's, counted alike."""
    import torch

    from hf_acco.tools.device_memory import GIB, device_baseline
    from hf_acco.tools.memory import engine_memory

    out = [
        "| model, machines x 8 GPUs | HSDP-ACCO persistent (GB) | FSDP's working set (GB) | peak (GB) "
        "| on the GPU, with the allowance (GB) | left of 80 GiB for the activations (GB) "
        "| the same with `sync`: on the GPU (GB) | HSDP (FSDP2, fp32 masters): on the GPU (GB) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for params, machines in ((70e9, 8), (34e9, 4), (13e9, 2)):
        numel, world = int(params), 8 * machines
        settings = dict(param_dtype=torch.bfloat16, comm_dtype="int8", grad_dtype=torch.bfloat16, fsdp_shard=8,
                        gather_dtype="int8")  # fmt: skip
        acco = engine_memory(numel, world, **settings)  # type: ignore[arg-type]
        sync = engine_memory(numel, world, schedule="sync", **settings)  # type: ignore[arg-type]
        hsdp = device_baseline("HSDP", numel, world, torch.bfloat16, 8)
        cells = (acco.persistent_bytes, acco.fsdp_bytes, acco.peak_bytes, acco.device_bytes,
                 80 * GIB - acco.device_bytes, sync.device_bytes, hsdp)  # fmt: skip
        out.append(f"| {params / 1e9:.0f}B, {machines} x 8 | " + " | ".join(f"{n / 1e9:.1f}" for n in cells) + " |")
    return "\n".join(out) + "\n"


def hsdp_fits_table() -> str:
    """Which of DDP, ZeRO-1, HSDP, ACCO and HSDP-ACCO fit an 80 GiB GPU, per GPU, for bf16 models of 7B and 13B on 2
    machines of 8 GPUs, 34B on 4 and 70B on 8 (``hf_acco.memory``'s ``device_bytes``: the peak with FSDP's working
    set where FSDP shards the model, and the CUDA context's and NCCL's allowance; ACCO's with its leanest settings:
    bf16 sums, int8 gradients and changes on the wire). Activations are not counted: a setting fits when it leaves
    them the margin, ``memory.MARGIN`` of the GPU."""
    import torch

    from hf_acco.tools.device_memory import GIB, device_baseline, margin_bytes
    from hf_acco.tools.memory import engine_memory

    usable = 80 * GIB - margin_bytes(80)
    out = [
        "| model, machines x 8 GPUs | DDP (GB) | ZeRO-1 (GB) | HSDP (GB) | ACCO (GB) | HSDP-ACCO (GB) |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    mark = lambda n: f"{n / 1e9:.1f} {'fits' if n <= usable else '**no**'}"  # noqa: E731
    lean = dict(param_dtype=torch.bfloat16, comm_dtype="int8", grad_dtype=torch.bfloat16, gather_dtype="int8")
    for params, machines in ((7e9, 2), (13e9, 2), (34e9, 4), (70e9, 8)):
        numel, world = int(params), 8 * machines
        base = [device_baseline(name, numel, world, torch.bfloat16, 8) for name in ("DDP", "ZeRO-1", "HSDP")]
        acco = engine_memory(numel, world, **lean).device_bytes  # type: ignore[arg-type]
        hsdp_acco = engine_memory(numel, world, fsdp_shard=8, **lean).device_bytes  # type: ignore[arg-type]
        cells = " | ".join(mark(n) for n in (*base, acco, hsdp_acco))
        out.append(f"| {params / 1e9:.0f}B, {machines} x 8 | {cells} |")
    return "\n".join(out) + "\n"


def hsdp_70b_table() -> str:
    """70B (Llama 2 70B's shape) with FSDP inside 8 machines of 8 GPUs of 80 GiB: what each setting leaves of the GPU
    for the activations (``hf_acco.memory``'s ``device_bytes``), and whether a micro-batch of 1 or 2 sequences of
    4096 tokens with gradient checkpointing fits in it (``model_shape.activation_bytes``, rough)."""
    import torch

    from hf_acco.tools.device_memory import groups_of_model
    from hf_acco.tools.memory import GIB, engine_memory
    from hf_acco.tools.model_shape import Shape, activation_bytes

    shape = Shape(params=68_976_648_192, hidden=8192, layers=80, intermediate=28672, vocab=32000)
    acts = [activation_bytes(shape, n * 4096, checkpointing=True) for n in (1, 2)]
    lean = dict(param_dtype=torch.bfloat16, comm_dtype="int8", grad_dtype=torch.bfloat16, gather_dtype="int8",
                fsdp_shard=8)  # fmt: skip
    bf16, fp32 = torch.bfloat16, torch.float32
    rows: list[tuple[str, int, dict[str, Any]]] = [
        ("leanest (bf16 sums, int8 both ways), FSDP's bf16 reduce", 64, {}),
        ("the same, FSDP reducing in fp32", 64, {"reduce_dtype": fp32}),
        ("int4 changes in the all-gather", 64, {"gather_dtype": "int4"}),
        ('`acco_schedule="sync"` (no round beside the compute)', 64, {"schedule": "sync"}),
        ("16 machines of 8", 128, {}),
    ]
    out = [
        "| setting (70B, 8 GPUs a machine) | on the GPU (GB) | left of 80 GiB (GB) "
        f"| 1 x 4096 tokens, checkpointing ({acts[0] / 1e9:.1f} GB) | 2 x 4096 ({acts[1] / 1e9:.1f} GB) |",
        "|---|---:|---:|---|---|",
    ]
    with torch.device("meta"):
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                             num_key_value_heads=8, vocab_size=32000)  # fmt: skip
        model = LlamaForCausalLM(config)
    groups = groups_of_model(model, 8, "Llama 2 70B's config")
    for name, world, change in rows:
        settings = {**lean, "reduce_dtype": bf16, **change}
        report = engine_memory(shape.params, world, fsdp_groups=groups, **settings)  # type: ignore[arg-type]
        need = report.device_bytes
        left = 80 * GIB - need
        fits = [f"{'fits' if a <= left else '**no**'} ({(left - a) / 1e9:+.1f} GB)" for a in acts]
        out.append(f"| {name} | {need / 1e9:.1f} | {left / 1e9:.1f} | {fits[0]} | {fits[1]} |")
    return "\n".join(out) + "\n"


def hsdp_bench_table() -> str:
    """``python -m hf_acco.tools.bench.hsdp``'s committed run (recipes/results/hsdp): its command and table."""
    from hf_acco.tools.bench import hsdp

    payload = json.loads((ROOT / "recipes" / "results" / "hsdp" / "benchmark.json").read_text())
    predicted = f"; predictions: `{payload['analysed_with']}`" if "analysed_with" in payload else ""
    return f"`{payload['command']}`{predicted}\n\n" + hsdp.table(payload["runs"])


def packed_round_table(name: str = "c5966a9_vs_c1e9381") -> str:
    """``python benchmarks/packed_round.py`` on two commits' code, alternated (recipes/results/engine/packed_round/):
    each pass's milliseconds per run and the operations it dispatches."""
    result = json.loads((ROOT / "recipes" / "results" / "engine" / "packed_round" / f"{name}.json").read_text())
    commits = (result["base"], result["new"])
    out = ["| pass | " + " | ".join(f"{c}: ms (runs) | ops" for c in commits) + " |", "|---|" + "---:|---:|" * 2]
    for label in result["runs"][commits[0]][0]["passes"]:
        cells = []
        for c in commits:
            passes = [run["passes"][label] for run in result["runs"][c]]
            cells.append(" / ".join(f"{p['ms']:.0f}" for p in passes) + f" | {passes[0]['ops']}")
        out.append(f"| {label} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"
