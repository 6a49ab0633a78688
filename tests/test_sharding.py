"""The flat layout: each trainable parameter once, padding, shards, segments, identity checks."""

from __future__ import annotations

import pytest
import torch

from hf_acco.comm.sharding import CHUNK_ALIGN, FlatLayout

from .models import tiny_llama


def _layout(params, world_size=2, bucket_numel=1 << 20, groups=None):
    names = [f"p{i}" for i in range(len(params))]
    return FlatLayout(params, names, groups or [0] * len(params), world_size, bucket_numel)


@pytest.mark.parametrize(("world_size", "bucket_numel"), [(1, 1 << 20), (2, 1 << 20), (3, 7), (4, 50)])
def test_shards_cover_every_element_once(world_size: int, bucket_numel: int) -> None:
    params = [torch.randn(5, 3), torch.randn(7), torch.randn(2, 2, 2)]
    layout = _layout(params, world_size, bucket_numel)
    assert layout.padded_numel % world_size == 0
    assert layout.padded_numel - layout.numel < layout.num_buckets * world_size * CHUNK_ALIGN
    assert layout.chunk % CHUNK_ALIGN == 0
    flat = layout.flatten(params, layout.new_flat("cpu"))
    shards = [layout.shard_of(flat, r) for r in range(world_size)]
    assert all(s.numel() == layout.shard_numel for s in shards)
    assert torch.equal(layout.unshard(shards), flat[: layout.numel])
    for p, v in zip(params, layout.views(flat)):
        assert torch.equal(p, v)


def test_segments_follow_groups_and_skip_padding() -> None:
    params = [torch.randn(10), torch.randn(3), torch.randn(8)]
    layout = _layout(params, world_size=2, bucket_numel=8, groups=[0, 1, 0])
    flat = layout.new_flat("cpu")
    marks = torch.cat([torch.full((10,), 0.0), torch.full((3,), 1.0), torch.full((8,), 0.0)])
    flat[: layout.numel] = marks + 10  # 10 = group 0, 11 = group 1, 0 = padding
    covered = 0
    for r in range(2):
        shard = layout.shard_of(flat, r)
        for seg in layout.shard_segments(r):
            assert torch.all(shard[seg.start : seg.end] == 10 + seg.group)
            covered += seg.end - seg.start
    assert covered == layout.numel


def test_model_tied_and_frozen_parameters() -> None:
    model = tiny_llama(tie=True)
    model.model.layers[0].mlp.up_proj.weight.requires_grad_(False)
    trainable = [p for p in model.parameters() if p.requires_grad]
    assert model.lm_head.weight is model.model.embed_tokens.weight
    layout = _layout(trainable)
    expected = sum(p.numel() for p in model.parameters() if p.requires_grad)  # parameters() dedups tied weights
    assert layout.numel == expected


def test_distinct_parameters_sharing_memory_are_refused() -> None:
    base = torch.nn.Parameter(torch.randn(6))
    alias = torch.nn.Parameter(base.data[:3])
    with pytest.raises(ValueError, match="share memory"):
        _layout([base, alias])


def test_no_trainable_parameters_is_refused() -> None:
    with pytest.raises(ValueError, match="no trainable parameters"):
        _layout([])


def test_layout_mismatch_is_explained() -> None:
    a = _layout([torch.randn(4, 4), torch.randn(4)])
    b = _layout([torch.randn(4, 5), torch.randn(4)])
    with pytest.raises(ValueError, match=r"parameter 0: checkpoint has p0 \[4, 5\], model has p0 \[4, 4\]"):
        a.check_matches(b.meta())


@pytest.mark.parametrize(("world_size", "bucket_numel"), [(2, 1 << 20), (3, 7)])
def test_param_pieces_cover_each_parameter_once(world_size: int, bucket_numel: int) -> None:
    params = [torch.randn(5, 3), torch.randn(7), torch.randn(2, 2, 2)]
    layout = _layout(params, world_size, bucket_numel)
    flat = layout.flatten(params, layout.new_flat("cpu"))
    squares = torch.zeros(len(params))
    for r in range(world_size):
        shard = layout.shard_of(flat, r)
        for i, a, b in layout.shard_param_pieces(r):
            squares[i] += shard[a:b].square().sum()
    assert torch.allclose(squares, torch.stack([p.square().sum() for p in params]))


def test_automatic_bucket_size() -> None:
    """About 16 buckets, each between 2**16 and 2**22 elements: small models still get several in flight."""
    from hf_acco.comm.sharding import auto_bucket_numel

    assert auto_bucket_numel(850_000) == 1 << 16  # 13 buckets
    assert auto_bucket_numel(32_000_000) == 2_000_000  # 16 buckets
    assert auto_bucket_numel(10**9) == 1 << 22  # 239 buckets of 16 MiB
    assert auto_bucket_numel(100) == 1 << 16  # one bucket
    layout = _layout([torch.zeros(850_000)], world_size=2, bucket_numel=None)
    assert layout.num_buckets == 13 and layout.padded_numel >= 850_000


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_every_piece_is_aligned_for_nccl(backend: str) -> None:
    """Llama-2-7B's 6,738,415,616 parameters on 8 ranks: unaligned, a chunk was 32,396,229 elements and every piece
    but rank 0's started off a 16-byte boundary (NCCL's slow path). Now each piece starts on a multiple of 64
    elements, in bf16 and fp32 alike, and no bucket is padding only."""
    layout = FlatLayout([torch.empty(6_738_415_616, device="meta")], ["all"], [0], 8, backend=backend)
    assert layout.chunk % 64 == 0
    for b in range(layout.num_buckets):
        for r in range(8):
            assert (b * layout.bucket_size + r * layout.chunk) * 2 % 16 == 0
    assert (layout.num_buckets - 1) * layout.bucket_size < layout.numel <= layout.padded_numel
    assert layout.padded_numel - layout.numel < layout.num_buckets * 8 * 64
