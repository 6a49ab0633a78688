"""Engine benchmarks on 2 gloo ranks on this machine: overlap, bytes per round, memory per rank.

    python benchmarks/engine.py overlap            # step time of acco vs sync with a slowed round
    python benchmarks/engine.py bytes              # bytes one round moves on gloo, per reduce-scatter spelling
    python benchmarks/engine.py memory             # peak resident memory per rank, acco vs sync
    python benchmarks/engine.py lifecycle          # peak RSS per rank: train, evaluate, save, resume 4 -> 2 ranks
    python benchmarks/engine.py overlap --device cuda --world-size 1   # the CUDA side-stream path on one GPU

Each prints a Markdown table and writes JSON next to ``--out``. Medians of repeated steps; settings measured
side by side in one run. These are measurements, not tests: the machine is shared and noisy.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from hf_acco import ACCOOptimizer  # noqa: E402
from hf_acco.comm.communicator import Communicator  # noqa: E402
from hf_acco.comm.sharding import FlatLayout  # noqa: E402
from hf_acco.tools.bench.link import tx_bytes  # noqa: E402
from hf_acco.tools.multiprocess import run_ranks  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.doubles import DelayedCommunicator  # noqa: E402  (the test double: a round that takes longer)


def build_model(hidden: int, layers: int, vocab: int = 512):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=256,
    )
    return LlamaForCausalLM(config)


def _micro_batch(model, device, g, batch: int, seq: int) -> None:
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g).to(device)
    model(input_ids=ids, labels=ids).loss.backward()


def _sync_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---- overlap ----------------------------------------------------------------------------------------------


def overlap_rank(rank: int, world_size: int, args: dict) -> dict:
    torch.set_num_threads(1)
    device = torch.device("cuda", rank) if args["device"] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    model = build_model(args["hidden"], args["layers"]).to(device)
    g = torch.Generator().manual_seed(rank)
    k, steps = args["micro_batches"], args["steps"]
    mb = lambda: _micro_batch(model, device, g, args["batch"], args["seq"])  # noqa: E731

    # compute alone: k micro-batches with no round anywhere
    for _ in range(2):
        mb()
    times = []
    for _ in range(steps):
        _sync_device(device)
        t0 = time.perf_counter()
        for _ in range(k):
            mb()
        _sync_device(device)
        times.append(time.perf_counter() - t0)
    model.zero_grad(set_to_none=True)
    t_compute = statistics.median(times)
    half = t_compute / 2
    rows = []
    for factor in args["delays"]:
        delay = factor * half
        for schedule in ("sync", "acco"):
            comm = DelayedCommunicator(delay)
            opt = ACCOOptimizer(model.parameters(), lr=1e-4, schedule=schedule, micro_batches=k, communicator=comm)
            step_times, waits, rounds = [], [], []
            t_prev = None
            for step in range(steps + 2):
                for _ in range(k):
                    mb()
                    opt.after_backward()
                opt.step()
                _sync_device(device)
                now = time.perf_counter()
                if step >= 2 and t_prev is not None:  # skip start-up
                    step_times.append(now - t_prev)
                    waits.append(opt.last_step_stats["wait_s"])
                    rounds.append(opt.last_step_stats["round_s"] / (2 if schedule == "acco" else 1))
                t_prev = now
            opt.close()
            t_round = statistics.median(rounds)
            rows.append(
                {
                    "schedule": schedule,
                    "delay_over_half": factor,
                    "delay_s": delay,
                    "t_compute_s": t_compute,
                    "t_round_s": t_round,
                    "step_time_s": statistics.median(step_times),
                    "exposed_comm_s": statistics.median(waits),
                    # the bound if rounds overlap: two rounds per step, each behind one half
                    "max_bound_s": 2 * max(half, t_round) if schedule == "acco" else t_compute + t_round,
                    "sum_s": t_compute + (2 if schedule == "acco" else 1) * t_round,
                }
            )
    return {"rows": rows}


def cmd_overlap(args: argparse.Namespace) -> list[dict]:
    cuda = args.device == "cuda"
    rows = run_ranks(
        overlap_rank,
        world_size=args.world_size,
        timeout=1800,
        backend="nccl" if cuda else "gloo",
        start_method="spawn" if cuda else "fork",
        args=vars(args),
    )[0]["rows"]
    print(
        "| schedule | delay / half | T_compute (s) | T_round (s) | step (s) | max bound (s) | sum (s) | exposed (s) |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['schedule']} | {r['delay_over_half']:.1f} | {r['t_compute_s']:.3f} | {r['t_round_s']:.3f} | "
            f"{r['step_time_s']:.3f} | {r['max_bound_s']:.3f} | {r['sum_s']:.3f} | {r['exposed_comm_s']:.3f} |"
        )
    return rows


# ---- bytes per round --------------------------------------------------------------------------------------


def bytes_rank(rank: int, world_size: int, numel: int, repeats: int) -> list[dict]:
    torch.set_num_threads(1)
    params = [torch.zeros(numel)]
    out = []
    for spelling in ("all_to_all", "native", "all_reduce"):
        comm = Communicator(reduce_scatter="native" if spelling == "all_reduce" else spelling)
        layout = FlatLayout(params, ["w"], [0], world_size)
        flat, shard = layout.new_flat("cpu"), torch.zeros(layout.shard_numel)
        flat.normal_()
        dist.barrier(comm.group)
        before = tx_bytes("lo")
        t0 = time.perf_counter()
        for _ in range(repeats):
            if spelling == "all_reduce":
                comm.all_reduce(flat)
            else:
                comm.reduce_scatter(layout, flat, shard)
                comm.all_gather(layout, shard, flat)
        seconds = (time.perf_counter() - t0) / repeats
        dist.barrier(comm.group)
        sent = (tx_bytes("lo") - before) / repeats  # both ranks' traffic: every packet on lo is counted once
        out.append({"spelling": spelling, "buffer_bytes": numel * 4, "wire_bytes_all_ranks": sent, "seconds": seconds})
    return out


def cmd_bytes(args: argparse.Namespace) -> list[dict]:
    if os.environ.get("HF_ACCO_IN_NETNS") != "1":
        # a private network namespace: the loopback counters then see only this benchmark's traffic
        code = (
            "ip link set lo up && HF_ACCO_IN_NETNS=1 GLOO_SOCKET_IFNAME=lo "
            f"{sys.executable} {Path(__file__).resolve()} bytes --numel {args.numel} --repeats {args.repeats} "
            f"--out {args.out}"
        )
        try:
            subprocess.run(["unshare", "-n", "sh", "-c", code], check=True)
        except (FileNotFoundError, subprocess.CalledProcessError) as e:
            sys.exit(f"needs root and util-linux `unshare` for a private network namespace: {e}")
        return json.loads(Path(args.out).read_text())
    rows = run_ranks(bytes_rank, numel=args.numel, repeats=args.repeats, timeout=600)[0]
    allreduce = next(r for r in rows if r["spelling"] == "all_reduce")["wire_bytes_all_ranks"]
    print("| collectives of one round | buffer (MB) | bytes on the wire, both ranks (MB) | vs one all-reduce | s |")
    print("|---|---|---|---|---|")
    for r in rows:
        name = {
            "all_to_all": "all-to-all reduce-scatter + all-gather (gloo default)",
            "native": "native reduce-scatter + all-gather",
            "all_reduce": "one all-reduce (reference)",
        }[r["spelling"]]
        print(
            f"| {name} | {r['buffer_bytes'] / 1e6:.1f} | {r['wire_bytes_all_ranks'] / 1e6:.1f} | "
            f"{r['wire_bytes_all_ranks'] / allreduce:.2f}x | {r['seconds']:.3f} |"
        )
    return rows


# ---- memory -----------------------------------------------------------------------------------------------


def memory_rank(rank: int, world_size: int, schedule: str, hidden: int, layers: int) -> dict:
    import resource

    torch.set_num_threads(1)
    model = build_model(hidden, layers, vocab=4096)
    numel = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(rank)
    opt = ACCOOptimizer(model.parameters(), lr=1e-4, schedule=schedule, micro_batches=2)
    for _ in range(3):
        for _ in range(2):
            _micro_batch(model, torch.device("cpu"), g, 1, 32)
            opt.after_backward()
        opt.step()
    opt.synchronize()
    engine = opt.buffers.accum.nbytes + (opt.buffers.wire.nbytes if opt.buffers.separate else 0)
    flat_state, _ = opt.shard.state_tensors()
    engine += opt.shard.master.nbytes + opt.shard.grad.nbytes + sum(v.nbytes for v in flat_state.values())
    opt.close()
    return {
        "schedule": schedule,
        "trainable_params": numel,
        "engine_bytes": engine,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
    }


def cmd_memory(args: argparse.Namespace) -> list[dict]:
    rows = []
    for schedule in ("sync", "acco", "dpu"):
        rows.append(run_ranks(memory_rank, schedule=schedule, hidden=args.hidden, layers=args.layers, timeout=900)[0])
    full = rows[0]["trainable_params"] * 4
    print(
        f"trainable parameters: {rows[0]['trainable_params'] / 1e6:.1f} M; one fp32 full-size buffer = "
        f"{full / 1e6:.1f} MB"
    )
    print("| schedule | engine buffers (MB) | peak RSS rank 0 (MB) | RSS minus sync's (MB) | in full buffers |")
    print("|---|---|---|---|---|")
    for r in rows:
        delta = r["peak_rss_bytes"] - rows[0]["peak_rss_bytes"]
        print(
            f"| {r['schedule']} | {r['engine_bytes'] / 1e6:.1f} | {r['peak_rss_bytes'] / 1e6:.1f} | "
            f"{delta / 1e6:.1f} | {delta / full:.2f} |"
        )
    return rows


def _rss() -> int:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def lifecycle_rank(rank: int, world_size: int, hidden: int, layers: int, directory: str, load: bool) -> dict:
    """Peak RSS after each phase: build and train 3 steps, evaluate (committed parameters), save, or (``load``)
    build and resume from ``directory``, then one more step."""
    from hf_acco.engine.checkpoint import load_optimizer_state, save_optimizer_state

    torch.set_num_threads(1)
    model = build_model(hidden, layers, vocab=4096)
    g = torch.Generator().manual_seed(rank)
    opt = ACCOOptimizer(model.parameters(), lr=1e-4, micro_batches=2, bucket_numel=1 << 22)
    phases = {"built": _rss()}

    def step() -> None:
        for _ in range(2):
            _micro_batch(model, torch.device("cpu"), g, 1, 32)
            opt.after_backward()
        opt.step()

    if load:
        load_optimizer_state(opt, directory)
        phases["resumed"] = _rss()
        step()
        phases["stepped"] = _rss()
    else:
        for _ in range(3):
            step()
        phases["trained"] = _rss()
        with opt.committed_parameters():
            sum(float(p.detach().sum()) for p in model.parameters())  # an evaluation reads the parameters
        phases["evaluated"] = _rss()
        save_optimizer_state(opt, directory)
        phases["saved"] = _rss()
    numel = opt.layout.numel
    opt.close()
    return {"rank": rank, "world_size": world_size, "numel": numel, "peak_rss_bytes": phases}


def cmd_lifecycle(args: argparse.Namespace) -> list[dict]:
    import tempfile

    with tempfile.TemporaryDirectory() as directory:
        kw = {"hidden": args.hidden, "layers": args.layers, "directory": directory, "timeout": 1800}
        saved = run_ranks(lifecycle_rank, world_size=4, load=False, **kw)
        resumed = run_ranks(lifecycle_rank, world_size=2, load=True, **kw)
    numel = saved[0]["numel"]
    print(f"trainable parameters: {numel / 1e6:.1f} M; one fp32 full-size vector = {numel * 4 / 1e6:.1f} MB")
    print("| ranks | rank | phase | peak RSS (MB) |")
    print("|---|---|---|---|")
    for r in saved + resumed:
        for phase, rss in r["peak_rss_bytes"].items():
            print(f"| {r['world_size']} | {r['rank']} | {phase} | {rss / 1e6:.0f} |")
    return saved + resumed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("overlap", help="acco vs sync step time with a slowed round")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--micro-batches", type=int, default=4)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--delays", type=float, nargs="+", default=[0.0, 0.5, 1.0, 2.0], help="round delay / half")
    p.add_argument("--out", default="outputs/bench_overlap.json")
    p = sub.add_parser("bytes", help="bytes one round moves on gloo (needs root: private network namespace)")
    p.add_argument("--numel", type=int, default=4 << 20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", default="outputs/bench_bytes.json")
    p = sub.add_parser("memory", help="peak resident memory per rank, acco vs sync vs dpu")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--out", default="outputs/bench_memory.json")
    p = sub.add_parser("lifecycle", help="peak RSS per rank: train, evaluate, save, a 4 -> 2 re-sharding resume")
    p.add_argument("--hidden", type=int, default=768)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--out", default="outputs/bench_lifecycle.json")
    args = parser.parse_args()
    commands = {"overlap": cmd_overlap, "bytes": cmd_bytes, "memory": cmd_memory, "lifecycle": cmd_lifecycle}
    rows = commands[args.command](args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if os.environ.get("HF_ACCO_IN_NETNS") == "1" or args.command != "bytes":
        command = " ".join(["python", "benchmarks/engine.py", *sys.argv[1:]])
        Path(args.out).write_text(json.dumps({"command": command, "rows": rows}, indent=2))


if __name__ == "__main__":
    main()
