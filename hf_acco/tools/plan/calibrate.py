"""Fit the planner's collective constants on your own cluster, with a short run of the engine's own collectives.

    torchrun --nnodes 4 --nproc_per_node 8 --node_rank R --master_addr HOST --master_port 29500 \\
        -m hf_acco.tools.plan.calibrate --link_gbit 100 --out constants.json
    python -m hf_acco.plan ... --constants constants.json

Every rank times, for a few sizes, ACCO's round (the engine's reduce-scatter of fp32 gradients and all-gather of
the parameters, its ``Communicator``, NCCL on GPUs and gloo on CPUs) and an all-reduce (DDP's), with nothing else
running. Rank 0 fits each kind's latency (``alpha``) and share of the link rate (``efficiency``) by
``plan.fit``, with ``--link_gbit`` as the rate each rank's traffic is held to (between machines: one machine's
network, all its NICs, as ``--inter_gbit``; on one machine: a GPU's link, as ``--intra_gbit``), and writes the file
``--constants`` reads. The step overheads stay 0: they are a training run's own.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from dataclasses import asdict, replace
from functools import partial

import torch
import torch.distributed as dist

from hf_acco.comm.communicator import Communicator
from hf_acco.comm.sharding import FlatLayout
from hf_acco.tools.cli_types import POSITIVE_FLOAT, POSITIVE_INT
from hf_acco.tools.collectives import one_collective
from hf_acco.tools.plan.model import fit


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m hf_acco.tools.plan.calibrate", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--link_gbit", type=POSITIVE_FLOAT, required=True, help="the link the collectives are held to")
    p.add_argument("--sizes", type=POSITIVE_FLOAT, nargs="+", default=[2**22, 2**24, 2**26],
                   help="elements (fp32) of each measured collective")  # fmt: skip
    p.add_argument("--repeats", type=POSITIVE_INT, default=5)
    p.add_argument("--out", default="constants.json")
    return p


def _time(run: Callable[[], object], device: torch.device, repeats: int) -> float:
    seconds = []
    for _ in range(repeats + 1):  # the first one warms up (connections, NCCL's communicators)
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        seconds.append(time.perf_counter() - t0)
    slowest = torch.tensor([statistics.median(seconds[1:])], device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)  # a collective ends when its slowest rank does
    return float(slowest.item())


def measure(sizes: list[float], repeats: int, device: torch.device) -> list[dict]:
    """Seconds of a round and of an all-reduce of each size, over every rank (collective)."""
    points = []
    for size in sizes:
        numel = int(size)
        for kind in ("round", "all_reduce"):
            comm = Communicator()
            layout = FlatLayout([torch.empty(numel, device=device)], ["calibration"], [0], comm.world_size)
            flat, shard = layout.new_flat(device), torch.zeros(layout.shard_numel, device=device)
            flat.normal_()
            seconds = _time(partial(one_collective, comm, kind, layout, flat, shard), device, repeats)
            points.append({"kind": kind, "world_size": comm.world_size, "bytes": 4 * numel, "seconds": seconds})
            comm.destroy()
    return points


def main(argv: list[str] | None = None) -> dict:
    args = make_parser().parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    initialised_here = not dist.is_initialized()
    if initialised_here:  # (torchrun or accelerate launch set the environment)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    try:
        points = measure(args.sizes, args.repeats, device)
        for pt in points:
            pt["link_mbit"] = args.link_gbit * 1000
        constants = fit(points)
        where = f"{dist.get_world_size()} ranks, {dist.get_backend()}, link {args.link_gbit:g} Gbit/s"
        constants = replace(constants, source=f"calibrated on this cluster ({where}; hf_acco.tools.plan.calibrate)")
        out = {**asdict(constants), "points": points}
        if dist.get_rank() == 0:
            with open(args.out, "w", encoding="utf-8") as f:
                json.dump(out, f, indent=1)
            print(f"alpha {constants.alpha_s}, efficiency {constants.efficiency}: written to {args.out}")
        return out
    finally:
        if initialised_here:
            dist.destroy_process_group()


if __name__ == "__main__":
    main()
