"""Flat layout of the trainable parameters and its shards (pure torch, no process group).

Every trainable parameter appears once (tied weights are one ``Parameter`` object) at a fixed offset of one
flat index space of ``numel`` elements. The space is padded to ``padded_numel = num_buckets * world_size *
chunk`` and cut into ``num_buckets`` contiguous buckets of ``world_size * chunk`` elements; inside each bucket,
rank ``r`` owns the ``r``-th chunk. A rank's shard is the concatenation of its chunks over the buckets
(``shard_numel = num_buckets * chunk`` elements).

Why buckets interleave ownership: a reduce-scatter or all-gather of bucket ``b`` then reads and writes one
contiguous slice of the flat buffer and one contiguous slice of the shard, so several buckets can be in flight
with no staging copies. With one bucket this is the usual ZeRO-1 contiguous sharding.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

# Automatic bucket size: about TARGET_BUCKETS buckets, each between 256 KiB and 16 MiB of fp32. Several buckets in
# flight keep a link busy in both directions: on a rate-limited link, one 3.4 MB bucket made gloo's reduce-scatter
# + all-gather take 1.4x the wire time of their bytes, 13 buckets of 256 KiB took 1.0x (as one all-reduce does).
# On NCCL buckets are larger: 16 MiB to 1 GiB of fp32. Its reduce-scatter needs no receive buffer, each call costs
# launch work on the host, and a 7B model would otherwise have ~1,700 buckets (3,400 calls a round); here ~28.
TARGET_BUCKETS = 16
MIN_AUTO_BUCKET_NUMEL, MAX_AUTO_BUCKET_NUMEL = 1 << 16, 1 << 22
NCCL_MIN_AUTO_BUCKET_NUMEL, NCCL_MAX_AUTO_BUCKET_NUMEL = 1 << 22, 1 << 28
# Every rank's piece of a bucket starts on a multiple of CHUNK_ALIGN elements (128 bytes of bf16, 256 of fp32): NCCL
# takes a slower path for buffers that are not 16-byte aligned (Llama-2-7B on 8 ranks unaligned: 32,396,229).
CHUNK_ALIGN = 64


def auto_bucket_numel(numel: int, backend: str = "gloo") -> int:
    """Elements per bucket for a flat space of ``numel`` elements when none is given, for a backend."""
    low, high = MIN_AUTO_BUCKET_NUMEL, MAX_AUTO_BUCKET_NUMEL
    if backend == "nccl":
        low, high = NCCL_MIN_AUTO_BUCKET_NUMEL, NCCL_MAX_AUTO_BUCKET_NUMEL
    return min(high, max(low, math.ceil(numel / TARGET_BUCKETS)))


def _chunking(numel: int, bucket_numel: int, world_size: int) -> tuple[int, int]:
    """(chunk, num_buckets) for ``numel`` elements in buckets of about ``bucket_numel`` over ``world_size`` ranks:
    each rank's piece of a bucket a multiple of ``CHUNK_ALIGN`` elements (so maybe fewer buckets)."""
    buckets = max(1, math.ceil(numel / max(1, bucket_numel)))
    chunk = CHUNK_ALIGN * max(1, math.ceil(numel / (buckets * world_size * CHUNK_ALIGN)))
    return chunk, max(1, math.ceil(numel / (world_size * chunk)))


@dataclass(frozen=True)
class Segment:
    """A run of shard elements ``[start, end)`` that belongs to one parameter group (and to one parameter, its index
    in the layout, when ``param`` is not -1)."""

    start: int
    end: int
    group: int
    param: int = -1


class FlatLayout:
    """Where each trainable parameter lives in the flat buffers, and which elements each rank owns.

    Args:
        params: the trainable parameters, each once.
        names: one name per parameter (used in checkpoints and error messages).
        groups: the parameter-group index of each parameter (weight decay etc. are per group).
        world_size: number of ranks the space is sharded over.
        bucket_numel: target number of elements per bucket (all ranks together); ``None``: automatic
            (:func:`auto_bucket_numel`) for ``backend``.
    """

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        names: Sequence[str],
        groups: Sequence[int],
        world_size: int,
        bucket_numel: int | None = None,
        backend: str = "gloo",
    ) -> None:
        if not params:
            raise ValueError(
                "ACCO found no trainable parameters: every parameter has requires_grad=False. "
                "Unfreeze at least one parameter (or attach a LoRA adapter) before building the optimizer."
            )
        if not (len(params) == len(names) == len(groups)):
            raise ValueError("params, names and groups must have the same length")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        _check_no_shared_storage(params, names)
        self.params = list(params)
        self._set_entries(names, groups, [tuple(p.shape) for p in params])
        if bucket_numel is None:
            bucket_numel = auto_bucket_numel(self.numel, backend)
        self.bucket_numel = bucket_numel  # as asked (or chosen): buckets of about this many elements (aligned)
        self._set_geometry(world_size, *_chunking(self.numel, bucket_numel, world_size))

    @classmethod
    def from_meta(cls, meta: dict) -> FlatLayout:
        """The layout a checkpoint recorded (``meta()``), without parameters: for tools that read its shards."""
        layout = cls.__new__(cls)
        layout.params = []
        layout._set_entries(meta["names"], meta["groups"], [tuple(s) for s in meta["shapes"]])
        if layout.numel != meta["numel"]:
            raise ValueError(
                f"an inconsistent layout record: its shapes hold {layout.numel} elements, not {meta['numel']}"
            )
        layout.bucket_numel = meta["world_size"] * meta["chunk"]
        layout._set_geometry(meta["world_size"], meta["chunk"], meta["num_buckets"])
        return layout

    def resized(self, world_size: int) -> FlatLayout:
        """These parameters over ``world_size`` ranks with the bucket size this layout was built with: the layout of
        an engine built with the same settings on that many ranks (the automatic size depends on no world size).
        A layout read from a checkpoint (``from_meta``, no parameters) resizes too."""
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        layout = FlatLayout.__new__(FlatLayout)
        layout.params = list(self.params)
        layout._set_entries(self.names, self.groups, list(self.shapes))
        layout.bucket_numel = self.bucket_numel
        layout._set_geometry(world_size, *_chunking(self.numel, self.bucket_numel, world_size))
        return layout

    def _set_entries(self, names: Sequence[str], groups: Sequence[int], shapes: list[tuple[int, ...]]) -> None:
        """Each parameter's name, group, shape, size and offset in the flat space."""
        self.names, self.groups, self.shapes = list(names), list(groups), shapes
        self.numels = [math.prod(s) for s in shapes]
        self.offsets = [0]
        for n in self.numels[:-1]:
            self.offsets.append(self.offsets[-1] + n)
        self.numel = sum(self.numels)

    def _set_geometry(self, world_size: int, chunk: int, num_buckets: int) -> None:
        """The buckets: ``num_buckets`` of one ``chunk`` per rank."""
        self.world_size, self.chunk, self.num_buckets = world_size, chunk, num_buckets
        self.bucket_size = world_size * chunk
        self.padded_numel = num_buckets * self.bucket_size
        self.shard_numel = num_buckets * chunk

    # ---- flat buffers -------------------------------------------------------------------------------------

    def new_flat(self, device: torch.device | str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.zeros(self.padded_numel, device=device, dtype=dtype)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Per-parameter views (shaped like the parameters) into a flat buffer."""
        return [flat[o : o + n].view(s) for o, n, s in zip(self.offsets, self.numels, self.shapes)]

    def flatten(self, tensors: Iterable[torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """Copy per-parameter tensors into ``out`` (padding untouched), casting to its dtype."""
        torch._foreach_copy_(self.views(out), [t.detach() for t in tensors])
        return out

    def bucket(self, flat: torch.Tensor, b: int) -> torch.Tensor:
        return flat[b * self.bucket_size : (b + 1) * self.bucket_size]

    def piece(self, flat: torch.Tensor, b: int, rank: int) -> torch.Tensor:
        """Rank ``rank``'s chunk of bucket ``b`` inside a flat buffer (contiguous)."""
        start = b * self.bucket_size + rank * self.chunk
        return flat[start : start + self.chunk]

    def shard_piece(self, shard: torch.Tensor, b: int) -> torch.Tensor:
        """Bucket ``b``'s chunk inside a shard (contiguous)."""
        return shard[b * self.chunk : (b + 1) * self.chunk]

    # ---- shards -------------------------------------------------------------------------------------------

    def shard_of(self, flat: torch.Tensor, rank: int) -> torch.Tensor:
        """A copy of rank ``rank``'s shard of a padded flat buffer."""
        return flat.view(self.num_buckets, self.world_size, self.chunk)[:, rank].reshape(-1).clone()

    def unshard(self, shards: Sequence[torch.Tensor]) -> torch.Tensor:
        """The unpadded flat vector (``numel`` elements) from every rank's shard, in rank order."""
        if len(shards) != self.world_size:
            raise ValueError(f"need {self.world_size} shards, got {len(shards)}")
        return unshard(shards, self.num_buckets, self.chunk, self.numel)

    def pad(self, full: torch.Tensor) -> torch.Tensor:
        """An unpadded flat vector padded with zeros to ``padded_numel``."""
        out = torch.zeros(self.padded_numel, dtype=full.dtype, device=full.device)
        out[: full.numel()] = full
        return out

    def shard_param_pieces(self, rank: int) -> list[tuple[int, int, int]]:
        """(parameter index, start, end) of each run of this rank's shard that holds one parameter's elements."""
        pieces = []
        for b in range(self.num_buckets):
            lo = b * self.bucket_size + rank * self.chunk
            hi = lo + self.chunk
            for i, (off, n) in enumerate(zip(self.offsets, self.numels)):
                start, end = max(lo, off), min(hi, off + n)
                if start < end:
                    pieces.append((i, b * self.chunk + (start - lo), b * self.chunk + (end - lo)))
        return pieces

    def shard_param_segments(self, rank: int) -> list[Segment]:
        """This rank's shard as one segment per run of one parameter's elements (in shard order): what the shard
        optimizer steps, so that a parameter without a gradient can be left alone as torch's optimizers leave it."""
        return [Segment(a, b, self.groups[i], i) for i, a, b in self.shard_param_pieces(rank)]

    def shard_segments(self, rank: int) -> list[Segment]:
        """Maximal runs of this rank's shard that hold real (non-padding) elements of one group."""
        segments: list[Segment] = []
        for b in range(self.num_buckets):
            lo = b * self.bucket_size + rank * self.chunk  # flat index of the shard piece's start
            hi = lo + self.chunk
            for off, n, g in zip(self.offsets, self.numels, self.groups):
                start, end = max(lo, off), min(hi, off + n)
                if start >= end:
                    continue
                s_start = b * self.chunk + (start - lo)
                s_end = s_start + (end - start)
                if segments and segments[-1].end == s_start and segments[-1].group == g:
                    segments[-1] = Segment(segments[-1].start, s_end, g)
                else:
                    segments.append(Segment(s_start, s_end, g))
        return segments

    # ---- identity -----------------------------------------------------------------------------------------

    def meta(self) -> dict:
        """What a checkpoint records to check that it fits the model it is loaded into."""
        return {
            "names": list(self.names),
            "shapes": [list(s) for s in self.shapes],
            "groups": list(self.groups),
            "numel": self.numel,
            "world_size": self.world_size,
            "num_buckets": self.num_buckets,
            "chunk": self.chunk,
        }

    def check_matches(self, meta: dict) -> None:
        """Raise a clear error if a checkpoint's layout describes other parameters than this one."""
        mine = self.meta()
        if meta["names"] != mine["names"] or meta["shapes"] != mine["shapes"]:
            detail = _first_difference(meta["names"], meta["shapes"], mine["names"], mine["shapes"])
            raise ValueError(
                "The ACCO checkpoint does not match this model's trainable parameters "
                f"({detail}). Load it into the same model with the same trainable parameters "
                "(same LoRA config / frozen layers), or start without resuming."
            )
        if meta["groups"] != mine["groups"]:
            raise ValueError(
                "The ACCO checkpoint assigns parameters to different optimizer groups (weight decay / no decay) "
                "than this run. Use the same optimizer grouping as the run that wrote it."
            )


def unshard(shards: Sequence[torch.Tensor], num_buckets: int, chunk: int, numel: int) -> torch.Tensor:
    """The unpadded flat vector from every rank's shard (rank order) of a layout with this geometry."""
    stacked = torch.stack([s.reshape(num_buckets, chunk) for s in shards], dim=1)
    return stacked.reshape(-1)[:numel]


def _check_no_shared_storage(params: Sequence[torch.Tensor], names: Sequence[str]) -> None:
    """Distinct Parameter objects that share memory would get separate gradients: refuse them."""
    spans = []
    for p, name in zip(params, names):
        if p.numel() == 0:
            continue
        start = p.data_ptr()
        spans.append((start, start + p.numel() * p.element_size(), name))
    spans.sort()
    for (_s0, e0, n0), (s1, _e1, n1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise ValueError(
                f"Parameters {n0!r} and {n1!r} are distinct objects that share memory. Tie weights by making "
                "them the same Parameter object (as `tie_weights()` does), so ACCO counts them once."
            )


def _first_difference(names_a, shapes_a, names_b, shapes_b) -> str:
    for i, (na, sa, nb, sb) in enumerate(zip(names_a, shapes_a, names_b, shapes_b)):
        if na != nb or list(sa) != list(sb):
            return f"parameter {i}: checkpoint has {na} {list(sa)}, model has {nb} {list(sb)}"
    return f"checkpoint has {len(names_a)} trainable parameters, model has {len(names_b)}"


def trainable_parameters(param_groups: list[dict[str, Any]]) -> list[tuple[str, torch.Tensor, int]]:
    """(name, parameter, group index) of each trainable parameter, each object once; frozen ones removed from
    the groups (which are edited in place)."""
    seen: set[int] = set()
    out = []
    for gi, group in enumerate(param_groups):
        names = group.get("param_names") or [f"group{gi}.param{i}" for i in range(len(group["params"]))]
        kept, kept_names = [], []
        for name, p in zip(names, group["params"]):
            if not p.requires_grad or id(p) in seen:
                continue
            seen.add(id(p))
            out.append((name, p, gi))
            kept.append(p)
            kept_names.append(name)
        group["params"] = kept
        if "param_names" in group:
            group["param_names"] = kept_names
    if not out:
        raise ValueError(
            "ACCO found no trainable parameters: every parameter has requires_grad=False. Unfreeze at least one "
            "parameter (or attach a LoRA adapter) before building the optimizer."
        )
    return out
