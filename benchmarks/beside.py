"""What the engine's rounds take from the compute beside them: 2 ranks on the benchmark's shaped link.

    python benchmarks/beside.py [--mbit 185] [--phases 4] [--rounds 12] [--out FILE]
    PYTHONPATH=<a worktree of another commit> python benchmarks/beside.py ...   # that commit's code

Each rank computes the benchmark's micro-batch (its model, batch and sequence; forward and backward) on its main
thread. In a ``beside`` phase the engine's own round body runs ``--rounds`` rounds back to back on a background
thread (estimate and commit alternately, on random gradient sums), as in a fixed-mode acco step whose link is the
bound; in an ``alone`` phase nothing else runs. The two kinds of phase alternate, so the machine's drift hits both.
Written (``--out``, default ``outputs/beside.json``) and printed, per rank: the median micro-batch alone and beside,
their ratio (the benchmark's ``compute in run / alone`` without the rest of a training step) and the median round
beside the compute. ``--mbit`` near the headline setting's link (``python -m hf_acco.bench`` prints it) makes a
round's wire time about half a step's compute. Steadier than the benchmark's step for changes of a few percent; a
measurement, not a test. Needs root and iproute2 (network namespaces), as the benchmark does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

MODEL = {"seed": 0, "hidden": 128, "layers": 3, "heads": 2, "seq": 128}  # hf_acco.tools.bench's defaults
BATCH = 8
ALONE_MICRO_BATCHES = 12


def _rounds(opt: Any, count: int, walls: list[float]) -> None:
    import torch

    from hf_acco.engine.core import RoundKind

    buffers = opt.buffers
    for i in range(count):
        kind = RoundKind.COMMIT if i % 2 else RoundKind.ESTIMATE
        buf, lent = buffers.hand_over(swap=kind is RoundKind.COMMIT)
        if lent is not None:  # the round's copy of the sums (random gradients overwrite it below)
            lent.take()
        buffers.grads_of(buf).normal_(generator=torch.Generator().manual_seed(i))
        start = time.perf_counter()
        opt._round(kind, buffers.grads_of(buf), buffers.params_of(buf), [4.0, 4.0, 0.0], opt._hparams(),
                   threading.Event(), "beside")  # fmt: skip
        walls.append(time.perf_counter() - start)
        buffers.restart(kind is RoundKind.COMMIT)


def _rank(phases: int, rounds: int) -> dict[str, Any]:
    """One rank: alternate alone and beside phases; the first micro-batch and round of a phase are not counted."""
    import torch
    import torch.distributed as dist

    from hf_acco.engine.core import ACCOOptimizer
    from hf_acco.tools.bench.worker import build_model

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    model, shards = build_model(MODEL), build_model(MODEL)
    opt = ACCOOptimizer(shards.parameters(), micro_batches=4, max_grad_norm=1.0, lr=2e-3, weight_decay=0.0)
    ids = torch.randint(0, 256, (BATCH, MODEL["seq"]), generator=torch.Generator().manual_seed(dist.get_rank()))

    def micro_batch() -> float:
        start = time.perf_counter()
        model(input_ids=ids, labels=ids).loss.backward()
        return time.perf_counter() - start

    alone: list[float] = []
    beside: list[float] = []
    walls: list[float] = []
    for _ in range(phases):
        dist.barrier()
        alone += [micro_batch() for _ in range(ALONE_MICRO_BATCHES)][1:]
        dist.barrier()
        phase_walls: list[float] = []
        thread = threading.Thread(target=_rounds, args=(opt, rounds, phase_walls))
        thread.start()
        times = []
        while thread.is_alive():
            times.append(micro_batch())
        thread.join()
        beside += times[1:]
        walls += phase_walls[1:]
        model.zero_grad(set_to_none=True)
    opt.close()
    dist.destroy_process_group()
    if not beside or not walls:
        raise SystemExit("too few micro-batches or rounds in a beside phase to time: raise --rounds")
    ms = lambda xs: 1e3 * statistics.median(xs)  # noqa: E731
    return {
        "micro_batch_alone_ms": ms(alone),
        "micro_batch_beside_ms": ms(beside),
        "beside_over_alone": statistics.median(beside) / statistics.median(alone),
        "round_beside_ms": ms(walls),
        "micro_batches": [len(alone), len(beside)],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mbit", type=float, default=185.0, help="the link's rate each way (0: unshaped loopback)")
    p.add_argument("--phases", type=int, default=4, help="alone and beside phases, alternated")
    p.add_argument("--rounds", type=int, default=12, help="rounds per beside phase")
    p.add_argument("--out", default="outputs/beside.json")
    args = p.parse_args(argv)
    from hf_acco.tools.bench.link import Link, unavailable

    if (why := unavailable()) is not None:
        raise SystemExit(f"benchmarks/beside.py needs the benchmark's shaped link: {why}")
    import hf_acco

    code = Path(hf_acco.__file__).resolve().parent.parent
    git = ["git", "-C", str(code), "rev-parse", "--short", "HEAD"]
    commit = subprocess.run(git, capture_output=True, text=True).stdout.strip() or None
    shaped = Link(loopback=not args.mbit)
    with tempfile.TemporaryDirectory() as tmp, shaped as link:
        if args.mbit:
            link.shape(args.mbit)
        procs = []
        for rank in range(2):
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": "0", "OMP_NUM_THREADS": "1",
                   "MASTER_ADDR": link.master_addr(), "MASTER_PORT": "29631", "GLOO_SOCKET_IFNAME": link.device(rank),
                   "BESIDE_RESULT": f"{tmp}/{rank}.json", "PYTHONPATH": str(code)}  # fmt: skip
            argv_rank = [sys.executable, __file__, "--rank", str(args.phases), str(args.rounds)]
            procs.append(subprocess.Popen(link.wrap(rank, argv_rank), env=env))
        if any(proc.wait() for proc in procs):
            raise SystemExit("a rank of benchmarks/beside.py failed (its error is above)")
        per_rank = [json.loads(Path(f"{tmp}/{rank}.json").read_text()) for rank in range(2)]
    command = "python benchmarks/beside.py " + " ".join(sys.argv[1:] if argv is None else argv)
    result = {"command": command.strip(), "code_commit": commit, "mbit": args.mbit, "model": MODEL, "batch": BATCH,
              "phases": args.phases, "rounds_per_phase": args.rounds, "ranks": per_rank}  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1) + "\n")
    for rank, r in enumerate(per_rank):
        print(f"rank {rank}: micro-batch alone {r['micro_batch_alone_ms']:.1f} ms, beside the rounds "
              f"{r['micro_batch_beside_ms']:.1f} ms ({r['beside_over_alone']:.3f}x); round beside the compute "
              f"{r['round_beside_ms']:.1f} ms")  # fmt: skip
    print(f"written to {out}")


if __name__ == "__main__":
    if sys.argv[1:2] == ["--rank"]:
        phases, rounds = int(sys.argv[2]), int(sys.argv[3])
        Path(os.environ["BESIDE_RESULT"]).write_text(json.dumps(_rank(phases, rounds)))
    else:
        main()
