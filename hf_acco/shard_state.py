"""The shard's state dict: what it holds, how it is checked, re-sharded and merged (pure torch).

One rank's ``ACCOOptimizer.state_dict()`` describes the last optimizer-step boundary: its shard of the master
weights, of the inner optimizer's per-element state, and of the parameters the model computed with from there
(the estimate for acco, the previous θ for dpu), whether a commit round was pending, the counters and the layout.
``consolidate_state_dicts`` merges every rank's into one that loads on any number of ranks;
``hf_acco.checkpoint`` writes and reads the per-rank files.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .buffers import BufferPair
from .comm import Communicator
from .optim import ShardOptimizer
from .rounds import put_own_pieces
from .sharding import FlatLayout, unshard

STATE_FORMAT = 1


class ShardCheckpoint:
    """This rank's state at the last optimizer-step boundary that is not in the master shard, saved and restored.

    ``model``: this rank's shard of the parameters the model computed with from the boundary (acco's estimate,
    dpu's previous θ); ``pending``: whether a commit round was in flight there. With them ``state_dict()``
    describes that boundary exactly even from the middle of a step.
    """

    def __init__(self, layout: FlatLayout, comm: Communicator, shard: ShardOptimizer) -> None:
        self.layout, self.comm, self.shard = layout, comm, shard
        # On the host (pinned on a GPU, so the copy at every step boundary runs asynchronously on the main stream):
        # it is read only when a checkpoint is written, and a shard of fp32 per GPU is memory a large model needs.
        self.model = torch.empty(shard.master.shape, dtype=shard.master.dtype, pin_memory=shard.master.is_cuda)
        self.model.copy_(shard.master)
        self.pending = False

    def state_dict(self, schedule: str, step_count: int, hparams: list[dict[str, Any]]) -> dict[str, Any]:
        if self.shard.master.is_cuda:  # the boundary shard's copy to the host was queued on the main stream
            torch.cuda.current_stream(self.shard.master.device).synchronize()
        flat_state, scalars = self.shard.state_tensors()

        def host(t: torch.Tensor) -> torch.Tensor:
            return t.detach().cpu().clone()

        return {
            "format": STATE_FORMAT,
            "rank": self.comm.rank,
            "layout": self.layout.meta(),
            "schedule": schedule,
            "step_count": step_count,
            "pending_commit": self.pending,
            "hparams": hparams,
            "master": host(self.shard.master),
            "model": host(self.model),
            "optim_state": {k: host(v) for k, v in flat_state.items()},
            "optim_scalars": {k: host(v) for k, v in scalars.items()},
        }

    def check(self, state_dict: Any, schedule: str) -> Callable[[torch.Tensor], torch.Tensor]:
        """Validate ``state_dict``; returns the map from a saved vector to this rank's shard."""
        validate_state(state_dict, self.layout, schedule)
        return shard_getter(state_dict, self.layout, self.comm.rank, self.shard.master.device)

    @torch.no_grad()
    def load(self, state_dict: dict[str, Any], shard: Callable, param_groups: list[dict], buffers: BufferPair) -> bool:
        """Restore master, optimizer state, hyper-parameters and the model (collective: all-gathers).

        Returns whether a commit round was pending: then ``buffers.comm`` holds its output, as if just waited for.
        """
        self.shard.master.copy_(shard(state_dict["master"]))
        self.shard.load_state_tensors(
            {k: shard(v) for k, v in state_dict["optim_state"].items()}, state_dict["optim_scalars"]
        )
        for group, hp in zip(param_groups, state_dict["hparams"]):
            group.update(hp)
        # The model: every rank's shard of what it held at the boundary (estimate, or θ_t for dpu).
        model_shard = shard(state_dict["model"])
        staging = buffers.accum  # free at a step boundary: no full-size buffer of its own
        put_own_pieces(self.layout, staging, model_shard, self.comm.rank)
        self.comm.all_gather(self.layout, None, staging)
        buffers.load_into_model(staging)
        staging.zero_()
        self.model.copy_(model_shard)
        self.pending = state_dict["pending_commit"]
        if self.pending:  # a commit round that was pending at save time: its output is the master shards gathered
            output = buffers.params_of(buffers.comm)
            put_own_pieces(self.layout, output, self.shard.master, self.comm.rank)
            self.comm.all_gather(self.layout, None, output)
        return self.pending


def validate_state(state_dict: Any, layout: FlatLayout, schedule: str) -> None:
    """A ValueError that says what is wrong if ``state_dict`` cannot be loaded into this layout and schedule."""
    if not isinstance(state_dict, dict) or state_dict.get("format") != STATE_FORMAT:
        raise ValueError("Not an hf_acco optimizer state (missing or unknown 'format').")
    layout.check_matches(state_dict["layout"])
    if state_dict["schedule"] != schedule:
        raise ValueError(
            f"The checkpoint was written with schedule {state_dict['schedule']!r}, this run uses "
            f"{schedule!r}. Resume with the same schedule."
        )


def shard_getter(
    state_dict: dict[str, Any], layout: FlatLayout, rank: int, device: torch.device
) -> Callable[[torch.Tensor], torch.Tensor]:
    """Map a saved vector to this rank's shard: directly (same world size) or re-sharded (consolidated)."""
    saved_world = state_dict["layout"]["world_size"]
    if state_dict.get("consolidated"):
        return lambda v: layout.shard_of(layout.pad(v.cpu()), rank).to(device)  # padded on the host
    if saved_world != layout.world_size or state_dict["layout"]["chunk"] != layout.chunk:
        raise ValueError(
            f"This optimizer shard was written by a run with {saved_world} ranks; this run has "
            f"{layout.world_size}. Load every rank's shard and pass consolidate_state_dicts(shards) (or use "
            "hf_acco.checkpoint.load_optimizer_state, which does it) to re-shard."
        )
    if state_dict["rank"] != rank:
        raise ValueError(f"Rank {rank} was given the optimizer shard of rank {state_dict['rank']}.")
    return lambda v: v.to(device)


def consolidate_state_dicts(shards: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge every rank's optimizer state into one, loadable on any number of ranks."""
    if not shards:
        raise ValueError("consolidate_state_dicts needs at least one shard")
    shards = sorted(shards, key=lambda s: s["rank"])
    meta = shards[0]["layout"]
    if [s["rank"] for s in shards] != list(range(meta["world_size"])):
        raise ValueError(f"need the shards of all {meta['world_size']} ranks, got ranks {[s['rank'] for s in shards]}")

    def merge(get) -> torch.Tensor:
        return unshard([get(s) for s in shards], meta["num_buckets"], meta["chunk"], meta["numel"])

    out = {k: v for k, v in shards[0].items() if k not in ("master", "model", "optim_state", "rank")}
    out.update(
        consolidated=True,
        master=merge(lambda s: s["master"]),
        model=merge(lambda s: s["model"]),
        optim_state={k: merge(lambda s, k=k: s["optim_state"][k]) for k in shards[0]["optim_state"]},
    )
    return out
