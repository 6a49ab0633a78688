"""The shard's state dict: what it holds, how it is checked, re-sharded and merged (pure torch).

One rank's ``ACCOOptimizer.state_dict()`` describes the last optimizer-step boundary: its shard of the master
weights, of the inner optimizer's per-element state, and of the parameters the model computed with from there
(the estimate for acco, the previous θ for dpu), whether a commit round was pending, the counters and the layout.
``consolidate_state_dicts`` merges every rank's into one that loads on any number of ranks;
``hf_acco.engine.checkpoint`` writes and reads the per-rank files.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch

from hf_acco.comm.communicator import Communicator
from hf_acco.comm.quant import ErrorFeedback
from hf_acco.comm.sharding import FlatLayout, unshard
from hf_acco.engine.buffers import BufferPair, model_dtype
from hf_acco.engine.optim import ShardOptimizer
from hf_acco.engine.rounds import put_own_pieces

STATE_FORMAT = 1


class BoundaryState:
    """This rank's state at the last optimizer-step boundary that is not in the master shard, saved and restored.

    The boundary's model shard (this rank's pieces of the parameters the model computed with from the boundary:
    acco's estimate, dpu's previous θ, sync's θ) is read from the model itself, which holds it until the model is
    next loaded. Only acco loads the model in the middle of a step (θ_t at the A→B boundary), so only acco keeps a
    copy: ``capture`` takes it on the commit round's thread at the start of each acco step (see ``RoundInFlight``),
    into host memory in the model's dtype (pinned on a GPU), off the main stream. ``pending``: whether a commit
    round was in flight at the boundary. With them ``state_dict()`` describes that boundary exactly even from the
    middle of a step.
    """

    def __init__(
        self,
        layout: FlatLayout,
        comm: Communicator,
        shard: ShardOptimizer,
        params: list,
        keep_copy: bool,
        feedback: ErrorFeedback | None = None,
    ) -> None:
        self.layout, self.comm, self.shard, self.params = layout, comm, shard, params
        self.feedback = feedback  # int8 gradients' residual: this rank's, saved and restored with the shard
        self.param_dtype = model_dtype(params)
        self._pieces = layout.shard_param_pieces(comm.rank)  # (parameter, shard start, shard end)
        self.copy: torch.Tensor | None = None  # acco: the boundary's model shard, once captured
        if keep_copy:
            cuda = shard.master.is_cuda
            self.copy = torch.zeros(layout.shard_numel, dtype=self.param_dtype, pin_memory=cuda)
            self._stream = torch.cuda.Stream(shard.master.device) if cuda else None
        self.captured = False
        self.pending = False

    def _model_pieces(self) -> list[tuple[torch.Tensor, int, int]]:
        """(this rank's run of one parameter, as a view of it; its shard start and end)."""
        layout, rank, out = self.layout, self.comm.rank, []
        for i, start, end in self._pieces:
            bucket, offset = divmod(start, layout.chunk)
            flat = bucket * layout.bucket_size + rank * layout.chunk + offset - layout.offsets[i]
            out.append((self.params[i].detach().reshape(-1)[flat : flat + end - start], start, end))
        return out

    def capture(self) -> torch.cuda.Event | None:
        """Copy this rank's pieces of the model into ``copy``. Called on the commit round's thread, whose stream
        has waited for the launch's ``ready`` event (recorded after the boundary loaded the model): on a GPU the
        copies run on a stream of their own, concurrently with the round's collectives, and the returned event
        (recorded after them) is waited for by the round's stream before its ``done`` event. Invariant: the main
        thread writes the model again only after waiting for ``done`` (the A→B load, eval, a resume), and reads
        ``copy`` only after ``state_dict``'s synchronisation, so neither side sees the other's half-done work."""
        if self.copy is None:
            raise AssertionError("capture() is for the acco schedule")  # only acco moves the model mid-step
        event = None
        stream = self._stream
        if stream is not None:
            stream.wait_stream(torch.cuda.current_stream(stream.device))  # after the round's wait for ``ready``
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for source, start, end in self._model_pieces():
                self.copy[start:end].copy_(source, non_blocking=stream is not None)
            if stream is not None:
                event = torch.cuda.Event()
                event.record(stream)
        self.captured = True
        return event

    def model_shard(self, moved: bool, held: torch.Tensor | None = None) -> torch.Tensor:
        """The boundary's model shard on the host: the copy when the model has moved on since, else the model's;
        ``held``: where the model's own parameters wait while it holds others (evaluation), flat."""
        if held is not None:  # bucket by bucket: no shard-sized temporary on the device
            out = torch.empty(self.layout.shard_numel, dtype=self.param_dtype)
            for b in range(self.layout.num_buckets):
                out[b * self.layout.chunk : (b + 1) * self.layout.chunk].copy_(
                    self.layout.piece(held, b, self.comm.rank)
                )
            return out
        if moved:
            if self.copy is None:
                raise RuntimeError(
                    "state_dict() was called in the middle of an acco optimizer step, after its half boundary moved "
                    "the model, and this engine keeps no copy of the boundary's model (boundary_copy=False). Save "
                    "at a step boundary (after step()), or build the optimizer with boundary_copy=True."
                )
            if not self.captured:
                raise AssertionError("the model moved mid-step without a copy of its boundary state")
            return self.copy.clone()
        out = torch.zeros(self.layout.shard_numel, dtype=self.param_dtype)
        for source, start, end in self._model_pieces():
            out[start:end].copy_(source)
        return out

    def state_dict(
        self, schedule: str, step_count: int, hparams: list[dict[str, Any]], moved: bool, held: torch.Tensor | None
    ) -> dict:
        if self.shard.master.is_cuda:  # the copies to the host were queued on the device's streams
            torch.cuda.synchronize(self.shard.master.device)
        flat_state, scalars = self.shard.state_tensors()

        def host(t: torch.Tensor) -> torch.Tensor:
            return t.detach().to("cpu", copy=True)

        state = {
            "format": STATE_FORMAT,
            "rank": self.comm.rank,
            "layout": self.layout.meta(),
            "schedule": schedule,
            "step_count": step_count,
            "pending_commit": self.pending,
            "hparams": hparams,
            "master": host(self.shard.master),
            "model": self.model_shard(moved, held),  # in the model's dtype
            "optim_state": {k: host(v) for k, v in flat_state.items()},
            "optim_scalars": {k: host(v) for k, v in scalars.items()},
            # each parameter's own (a parameter left out of steps for want of a gradient counts fewer), NaN where
            # this rank holds none of it: a re-sharding load takes each parameter's from a rank that holds it
            "optim_param_scalars": self.shard.param_scalars(),
            "empty_groups_kept": True,  # (hf_acco 0.1.0's ACCOTrainer gave the engine no empty group)
        }
        if self.feedback is not None:  # updated by commit rounds only: the boundary's, also in the middle of a step
            state["int8_residual"] = host(self.feedback.residual)
        return state

    def check(self, state_dict: Any, schedule: str) -> Callable[[torch.Tensor], torch.Tensor]:
        """Validate ``state_dict``; returns the map from a saved vector to this rank's shard."""
        validate_state(state_dict, self.layout, schedule)
        return shard_getter(state_dict, self.layout, self.comm.rank, self.shard.master.device)

    @torch.no_grad()
    def load(
        self,
        state_dict: dict[str, Any],
        shard: Callable,
        param_groups: list[dict],
        buffers: BufferPair,
        committed_output: Callable[[torch.Tensor], None],
    ) -> bool:
        """Restore master, optimizer state, hyper-parameters and the model (collective: all-gathers).

        Returns whether a commit round was pending: then ``buffers.wire`` holds its output, as if just waited for
        (``committed_output``, as the round's own all-gather made it: from the model just loaded, its base).
        """
        self.shard.master.copy_(shard(state_dict["master"]))
        self.shard.load_state_tensors(
            {k: shard(v) for k, v in state_dict["optim_state"].items()},
            state_dict["optim_scalars"],
            state_dict.get("optim_param_scalars"),
            copy=False,  # ``shard`` made each a new tensor on the device: one copy of each moment, not two
        )
        for group, hp in zip(param_groups, state_dict["hparams"]):
            group.update(hp)
        # The model: every rank's shard of what it held at the boundary (estimate, or θ_t for dpu).
        model_shard = shard(state_dict["model"])
        staging = buffers.accum  # free at a step boundary: no full-size buffer of its own
        put_own_pieces(self.layout, staging, model_shard, self.comm.rank)
        self.comm.all_gather(self.layout, None, staging)
        buffers.load_into_model(staging)
        buffers.release_accum()
        if self.copy is not None:  # the model may move at the next A→B boundary: keep its state here
            self.copy.copy_(model_shard)
            self.captured = True
        if self.feedback is not None:  # this rank's own rounding: none after a re-sharding (consolidated) load
            saved = state_dict.get("int8_residual")
            if saved is not None and saved.shape == self.feedback.residual.shape:
                self.feedback.residual.copy_(saved)
            else:
                self.feedback.residual.zero_()
        self.pending = state_dict["pending_commit"]
        if self.pending:  # a commit round that was pending at save time: its output is the master shards gathered
            committed_output(buffers.params_of(buffers.wire))
        return self.pending


def with_empty_groups(state: dict[str, Any], layout: FlatLayout, hparams: list[dict[str, Any]]) -> dict[str, Any]:
    """A shard of hf_acco 0.1.0's ACCOTrainer, which gave the engine only Trainer's non-empty groups, for an engine
    given all of them (``hparams``: its groups' settings): the saved groups renumbered as ``layout`` numbers them,
    an empty group keeping this engine's settings. Any other state is returned as it is."""
    used = sorted(set(layout.groups))  # this engine's non-empty groups, in order
    if state.get("empty_groups_kept") or len(state["hparams"]) != len(used) or len(used) == len(hparams):
        return state
    meta = {**state["layout"], "groups": [used[g] for g in state["layout"]["groups"]]}
    renumbered = [dict(hp) for hp in hparams]
    for old, new in enumerate(used):
        renumbered[new] = state["hparams"][old]
    return {**state, "layout": meta, "hparams": renumbered}


def torch_keys(param_groups: list[dict[str, Any]]) -> dict[str, Any]:
    """torch's own keys of an optimizer state dict, for tools and callbacks that read them: ``param_groups`` (the
    hyper-parameters, each parameter by its index, as torch numbers them) and ``state``, empty: the per-element
    state is sharded, in ``optim_state``. A resume reads neither."""
    groups, first = [], 0
    for group in param_groups:
        indices = list(range(first, first + len(group["params"])))
        groups.append({**{k: v for k, v in group.items() if k != "params"}, "params": indices})
        first += len(indices)
    return {"param_groups": groups, "state": {}}


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
            f"This optimizer shard was written by a run with {saved_world} ranks and chunks of "
            f"{state_dict['layout']['chunk']} elements; this run has {layout.world_size} and {layout.chunk}. "
            "Load every rank's shard and pass consolidate_state_dicts(shards) (or use "
            "hf_acco.engine.checkpoint.load_optimizer_state, which does it) to re-shard."
        )
    if state_dict["rank"] != rank:
        raise ValueError(f"Rank {rank} was given the optimizer shard of rank {state_dict['rank']}.")
    return lambda v: v.to(device, copy=True)  # a new tensor: the engine takes it over, the caller's stays theirs


def runs_from(meta: dict[str, Any], layout: FlatLayout, rank: int) -> list[tuple[int, int, int, int]]:
    """Where this rank's shard in ``layout`` lies in the shards of the layout ``meta`` describes: (old rank, start in
    its shard, start in ours, length), one run per piece of an old rank's chunk."""
    old_chunk = meta["chunk"]
    old_bucket = meta["world_size"] * old_chunk
    runs = []
    for b in range(layout.num_buckets):
        lo = b * layout.bucket_size + rank * layout.chunk
        f, hi = lo, min(lo + layout.chunk, layout.numel)
        while f < hi:
            old_b, rest = divmod(f, old_bucket)
            old_rank, offset = divmod(rest, old_chunk)
            n = min(hi - f, old_chunk - offset)
            runs.append((old_rank, old_b * old_chunk + offset, b * layout.chunk + f - lo, n))
            f += n
    return runs


def reshard(shards: list[dict[str, Any]], layout: FlatLayout, rank: int) -> dict[str, Any]:
    """This rank's state in ``layout`` from every rank's shard of a run with another layout (world size or chunk),
    reading only the ranges this rank owns now: with memory-mapped shards (``torch.load(..., mmap=True)``) a rank
    reads its share of the files, and no full-size vector is ever built."""
    shards = sorted(shards, key=lambda s: s["rank"])
    meta = shards[0]["layout"]
    if [s["rank"] for s in shards] != list(range(meta["world_size"])):
        raise ValueError(f"need the shards of all {meta['world_size']} ranks, got ranks {[s['rank'] for s in shards]}")
    layout.check_matches(meta)  # the same parameters in the same groups, before anything is read
    runs = runs_from(meta, layout, rank)

    def take(get: Callable[[dict], torch.Tensor]) -> torch.Tensor:
        out = torch.zeros(layout.shard_numel, dtype=get(shards[0]).dtype)
        for old_rank, old_start, start, n in runs:
            out[start : start + n].copy_(get(shards[old_rank])[old_start : old_start + n])
        return out

    vectors = {name: take(get) for name, get in shard_vectors(shards[0]).items()}
    return resharded(shards[0], merge_param_scalars(shards), layout, rank, vectors)


PER_RANK = ("int8_residual",)  # a rank's own: its rounding of the rows it quantised, meaningless on another rank


def shard_vectors(state: dict[str, Any]) -> dict[str, Callable[[dict], torch.Tensor]]:
    """The vectors of a shard that a re-shard cuts anew, each by a name and how to read it from a shard: the master,
    the model and each of the inner optimizer's state vectors."""
    getters = {"master": lambda s: s["master"], "model": lambda s: s["model"]}
    return getters | {f"optim_state.{k}": _optim_state(k) for k in state["optim_state"]}


def resharded(
    first: dict[str, Any], scalars: dict[str, torch.Tensor], layout: FlatLayout, rank: int, vectors: dict
) -> dict[str, Any]:
    """Rank ``rank``'s state in ``layout``: old rank 0's shard ``first`` for what is not per element, each
    parameter's scalars (``merge_param_scalars``), and its new ``vectors`` by ``shard_vectors``' names."""
    out = {k: v for k, v in first.items() if k not in ("master", "model", "optim_state", *PER_RANK)}
    out.update(
        rank=rank,
        layout=layout.meta(),
        optim_param_scalars=scalars,
        master=vectors["master"],
        model=vectors["model"],
        optim_state={k: vectors[f"optim_state.{k}"] for k in first["optim_state"]},
    )
    return out


def merge_param_scalars(shards: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
    """Every parameter's scalar state (``step``, ...) from the shards that hold a piece of it (they agree: the
    decision to leave a parameter out is taken by all ranks together); NaN for a parameter never stepped."""
    merged: dict[str, torch.Tensor] = {}
    for s in shards:
        for key, vector in (s.get("optim_param_scalars") or {}).items():
            into = merged.setdefault(key, vector.clone())
            missing = torch.isnan(into)
            into[missing] = vector[missing]
    return merged


def _optim_state(key: str) -> Callable[[dict], torch.Tensor]:
    """A shard's vector of the inner optimizer's state ``key``."""
    return lambda shard: shard["optim_state"][key]


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

    per_rank = ("master", "model", "optim_state", "rank", *PER_RANK)
    out = {k: v for k, v in shards[0].items() if k not in per_rank}
    out.update(
        consolidated=True,
        optim_param_scalars=merge_param_scalars(shards),
        master=merge(lambda s: s["master"]),
        model=merge(lambda s: s["model"]),
        optim_state={k: merge(lambda s, k=k: s["optim_state"][k]) for k in shards[0]["optim_state"]},
    )
    return out
