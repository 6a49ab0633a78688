"""What the packed round's two passes cost at a step boundary on this device, beside the exact path's: the hand-over
of the sums to the round and the load of its output into the model, for one GPU's engine shard of gpu_check's
~0.95B Llama (its shapes, from a model on the meta device; bf16 model, fp32 sums) on ``--ranks`` machines.

    python benchmarks/packed_round.py                      # on a GPU; gpu_check.py runs it as one of its parts
    python benchmarks/packed_round.py --device cpu --tiny  # the plumbing, and a CPU proxy of the costs

Passes, each over the whole model:

* ``pack_sums``: the packed hand-over (``deltas.PackedRound.pack_sums``): the fp32 sums rounded to bf16, quantised
  blockwise into the round's int8 rows. Since the hand-over lends the sums to the round, it runs on the round's
  thread and stream, beside the next half's compute;
* ``cast_copy``: the exact path's hand-over of the same sums into a bf16 round buffer (``LentSums``, on the round's
  stream too);
* ``apply``: the packed load (``PackedRound.apply``): every rank's int8 change dequantised and added to the model,
  in place, on the main stream at the boundary (the critical path: docs/hsdp.md says why it stays there);
* ``load``: the exact path's load, the round's bf16 output copied into the model (``BufferPair.load_into_model``).

Per pass: milliseconds (the median of ``--passes``, between CUDA events on a GPU, by the host's clock on a CPU), and
the operations it dispatches (counted with torch's dispatcher on the first pass, views included: an upper bound on
its kernel launches, each of which is host time on the thread that runs the pass). A measurement of one device, not
a test.
"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))


def measure(device: str, tiny: bool, ranks: int, passes: int) -> dict:
    import torch
    from accumulate_kernels import median_seconds, shapes
    from torch.utils._python_dispatch import TorchDispatchMode

    from hf_acco.comm import quant
    from hf_acco.comm.deltas import PackedRound
    from hf_acco.comm.sharding import FlatLayout

    class Launches(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204 - torch's protocol
            self.count += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    params = [torch.randn(s, device=device).to(torch.bfloat16) for s in shapes(tiny)]
    layout = FlatLayout(params, [str(i) for i in range(len(params))], [0] * len(params), ranks, None, backend="nccl")
    comm = SimpleNamespace(rank=0, world_size=ranks, max_inflight=4)
    packed = PackedRound(layout, comm, params, 8, torch.bfloat16)  # type: ignore[arg-type]
    sums = layout.new_flat(device, dtype=torch.float32).normal_()
    rows = packed.new_buffer(device)
    wire = layout.new_flat(device, dtype=torch.bfloat16)
    changes = torch.randn(layout.num_buckets, ranks, layout.chunk, device=device) * 1e-3
    for b in range(layout.num_buckets):  # every rank's change of bucket b, packed where the round gathers them
        packed._changes(rows, b).copy_(quant.pack(changes[b], bits=8))
    views = layout.views(wire)
    passes_of = {
        "pack_sums": lambda: packed.pack_sums(rows, sums, torch.bfloat16),
        "cast_copy": lambda: wire.copy_(sums),
        "apply": lambda: packed.apply(rows),
        "load": lambda: torch._foreach_copy_(params, views),
    }
    cuda = device == "cuda"
    out: dict = {"device": device, "ranks": ranks, "numel": layout.numel, "buckets": layout.num_buckets, "passes": {}}
    for name, run in passes_of.items():
        with Launches() as launches:
            run()  # (also the warm-up)
        out["passes"][name] = {"ms": median_seconds(run, passes, cuda) * 1e3, "ops": launches.count}
    return out


def main(argv: list[str] | None = None) -> int:
    from accumulate_kernels import parser, report

    p = parser("packed_round.py", __doc__)
    p.add_argument("--ranks", type=int, default=8, help="machines in the rounds' group (buckets of that many pieces)")
    args = p.parse_args(argv)
    return report("packed_round.py", argv, measure(args.device, args.tiny, args.ranks, args.passes), args.out)


if __name__ == "__main__":
    sys.exit(main())
