"""What a wakeup of another thread costs the compute beside it, on this machine's cores.

    python benchmarks/wakeups.py [--micro_batches 40] [--out recipes/results/engine/wakeups/<date>.json]

Two processes (as two ranks on two cores) each run the benchmark's micro-batch (forward + backward of
hf_acco.tools.bench's model, one thread) while a second thread of the same process sleeps and wakes every ``period``
(doing nothing else), for a few periods and without one. Printed per setting: the median micro-batch's wall time and
its thread's CPU, the waker's wakeups per micro-batch, and what one wakeup cost the micro-batch (its wall time over the
baseline's, per wakeup). A round's threads (the round's own, gloo's worker and socket threads) wake each time a message
is sent or arrives, so their number, not only their CPU, is what a round takes from the compute
(``benchmarks/round_cpu.py`` counts them per round). A measurement, not a test."""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import statistics
import sys
import threading
import time
from pathlib import Path

PERIODS_MS = (0.0, 2.0, 1.0, 0.5)  # 0: no waker (the baseline)
MODEL = {"seed": 0, "hidden": 128, "layers": 3, "heads": 2, "seq": 128}  # hf_acco.tools.bench's defaults
BATCH = 8


def _waker(period_s: float, stop: threading.Event, wakeups: list[int]) -> None:
    while not stop.is_set():
        time.sleep(period_s)
        wakeups[0] += 1


def _process(period_ms: float, micro_batches: int, results: mp.Queue) -> None:
    import torch

    from hf_acco.tools.bench.worker import build_model

    torch.set_num_threads(1)
    model = build_model(MODEL)
    ids = torch.randint(0, 256, (BATCH, MODEL["seq"]), generator=torch.Generator().manual_seed(0))
    for _ in range(3):  # warm-up
        model(input_ids=ids, labels=ids).loss.backward()
    stop, wakeups = threading.Event(), [0]
    if period_ms:
        threading.Thread(target=_waker, args=(period_ms / 1e3, stop, wakeups), daemon=True).start()
    walls, cpus = [], []
    t0 = time.perf_counter()
    for _ in range(micro_batches):
        wall, cpu = time.perf_counter(), time.thread_time()
        model(input_ids=ids, labels=ids).loss.backward()
        walls.append(time.perf_counter() - wall)
        cpus.append(time.thread_time() - cpu)
    span = time.perf_counter() - t0
    stop.set()
    per_mb = wakeups[0] * statistics.median(walls) / span
    wall_ms, cpu_ms = 1e3 * statistics.median(walls), 1e3 * statistics.median(cpus)
    results.put({"wall_ms": wall_ms, "cpu_ms": cpu_ms, "wakeups": per_mb})


def measure(period_ms: float, micro_batches: int) -> dict[str, float]:
    """Both processes at once, averaged."""
    results: mp.Queue = mp.Queue()
    procs = [mp.Process(target=_process, args=(period_ms, micro_batches, results)) for _ in range(2)]
    for p in procs:
        p.start()
    got = [results.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return {key: statistics.mean(g[key] for g in got) for key in got[0]}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--micro_batches", type=int, default=40)
    p.add_argument("--repeats", type=int, default=2, help="passes over the periods, interleaved")
    p.add_argument("--out", default=None, help="default: recipes/results/engine/wakeups/<today>.json")
    args = p.parse_args(argv)
    runs: dict[float, list[dict[str, float]]] = {period: [] for period in PERIODS_MS}
    for _ in range(args.repeats):
        for period in PERIODS_MS:
            runs[period].append(measure(period, args.micro_batches))
    settings = []
    base = statistics.median(r["wall_ms"] for r in runs[0.0])
    for period, rs in runs.items():
        row: dict[str, float | None] = {"period_ms": period, **{k: statistics.median(r[k] for r in rs) for k in rs[0]}}
        wall, wakeups = statistics.median(r["wall_ms"] for r in rs), statistics.median(r["wakeups"] for r in rs)
        cost = (wall - base) / wakeups if wakeups else None
        row["cost_per_wakeup_ms"] = cost
        settings.append(row)
        print(f"period {period:4.1f} ms: micro-batch {wall:6.1f} ms wall, {row['cpu_ms']:6.1f} ms CPU, "
              f"{wakeups:5.1f} wakeups" + (f", {1e3 * cost:5.0f} us per wakeup" if cost else ""))  # fmt: skip
    command = "python benchmarks/wakeups.py " + " ".join(sys.argv[1:] if argv is None else argv)
    result = {"command": command.strip(), "model": MODEL, "batch": BATCH, "repeats": args.repeats}
    result["settings"] = settings
    today = datetime.date.today().isoformat()
    out = Path(args.out or Path(__file__).resolve().parent.parent / f"recipes/results/engine/wakeups/{today}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(f"written to {out}")


if __name__ == "__main__":
    main()
