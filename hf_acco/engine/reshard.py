"""Re-sharding the engine's state in memory when the ranks change at a step boundary: from the R ranks that held it
to the R' of a new engine, without files. The runs are the ones a re-sharding load reads from the shard files
(``shard_state.runs_from``: for each new rank, which range of which old rank's shard lands where in its own), sent
point to point by the member that holds each old shard. The state each new rank gets is the one ``reshard`` gives
from the files (``shard_state.resharded`` builds both), so a new engine that loads it continues as a resume on R'
ranks from a checkpoint of the R would.

Who takes part (the members of ``group``, one call each): every member that holds an old rank's shard (its own
``state_dict()``; a member that leaves hands its shard over this way, a replica held for a lost rank would too), and
every rank of the new engine (a member that joins holds nothing). Each old rank's shard is sent by the first member
that holds it. Memory: a sender's messages are copies of the ranges it sends; a receiver holds its new shard, and
each message until it is placed.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hf_acco.comm.sharding import FlatLayout
from hf_acco.comm.transfer import check_host_group, gather_objects, member_rank, send_receive
from hf_acco.engine.shard_state import PER_RANK, merge_param_scalars, resharded, runs_from, shard_vectors


def reshard_in_memory(
    held: list[dict[str, Any]], layout: FlatLayout, new_rank: int | None, group: dist.ProcessGroup | None = None
) -> dict[str, Any] | None:
    """This member's state in ``layout`` (the new engine's layout, the same on every member; ``new_rank``: this
    member's rank in it, None where it leaves), from the old shards ``held`` here (``ACCOOptimizer.state_dict()``
    at a step boundary, host tensors: gloo's point to point). Collective over ``group``; returns None where this
    member leaves. Raises the same error on every member where an old shard is held by none, or the new ranks are
    not 0..R'-1 once each."""
    check_host_group(group)
    me = member_rank(group)
    heads = {s["rank"]: _head(s) for s in held}
    everyone = gather_objects({"new_rank": new_rank, "heads": heads}, group)
    holders: dict[int, int] = {}
    for member, record in enumerate(everyone):
        for old_rank in record["heads"]:
            holders.setdefault(old_rank, member)
    _check(everyone, holders, layout)
    first = everyone[holders[0]]["heads"][0]  # old rank 0's: what is not per element comes from it, as from files
    members = {r["new_rank"]: m for m, r in enumerate(everyone) if r["new_rank"] is not None}  # new rank -> member
    dtypes = first["dtypes"]  # each vector's, by shard_vectors' names
    names, getters = list(dtypes), shard_vectors(first["state"])
    shards = {s["rank"]: s for s in held}
    sends, receives, local = [], [], []
    out = {name: torch.zeros(layout.shard_numel, dtype=dtypes[name]) for name in names} if new_rank is not None else {}
    for target in range(layout.world_size):  # every message, in the same order on both of its sides
        by_old: dict[int, list[tuple[int, int, int]]] = {}
        for old_rank, old_start, start, n in runs_from(first["state"]["layout"], layout, target):
            by_old.setdefault(old_rank, []).append((old_start, start, n))
        for old_rank, runs in sorted(by_old.items()):
            source, dest = holders[old_rank], members[target]
            for name in names:
                if source == me:
                    vector = getters[name](shards[old_rank])
                    message = torch.cat([vector[s : s + n] for s, _, n in runs])
                    if dest == me:
                        local.append((name, runs, message))
                    else:
                        sends.append((dest, message))
                elif dest == me:
                    message = torch.empty(sum(n for _, _, n in runs), dtype=dtypes[name])
                    receives.append((source, message))
                    local.append((name, runs, message))
    send_receive(sends, [(peer, t) for peer, t in receives], group)
    if new_rank is None:
        return None
    for name, runs, message in local:  # each message's runs into this member's new shard
        at = 0
        for _, start, n in runs:
            out[name][start : start + n].copy_(message[at : at + n])
            at += n
    old_shards = [everyone[holders[q]]["heads"][q]["state"] for q in sorted(holders)]
    return resharded(first["state"], merge_param_scalars(old_shards), layout, new_rank, out)


def _head(state: dict[str, Any]) -> dict[str, Any]:
    """What every member learns of an old shard: all but what ``resharded`` leaves out or cuts anew (its counters,
    settings, layout record, each parameter's scalars), and the dtypes of its vectors."""
    small = {k: v for k, v in state.items() if k not in ("master", "model", "optim_state", *PER_RANK)}
    return {
        "state": small | {"optim_state": dict.fromkeys(state["optim_state"])},  # (the names: resharded's keys)
        "dtypes": {name: get(state).dtype for name, get in shard_vectors(state).items()},
    }


def _check(everyone: list[dict[str, Any]], holders: dict[int, int], layout: FlatLayout) -> None:
    """The same verdict on every member (each sees every member's record)."""
    if not holders:
        raise ValueError("An in-memory re-shard needs the old ranks' shards, and no member holds any.")
    world = next(iter(everyone[holders[min(holders)]]["heads"].values()))["state"]["layout"]["world_size"]
    missing = sorted(set(range(world)) - set(holders))
    if missing:
        raise ValueError(
            f"No member holds the optimizer shards of old ranks {missing} (of {world}): they are lost. Resume "
            "from the last checkpoint instead (load_optimizer_state re-shards it onto the new ranks)."
        )
    joined = sorted(r["new_rank"] for r in everyone if r["new_rank"] is not None)
    if joined != list(range(layout.world_size)):
        raise ValueError(
            f"The members' new ranks are {joined}; a new engine of {layout.world_size} ranks needs each of "
            f"0..{layout.world_size - 1} once. Give each member that stays its rank in the new group, and None to "
            "one that leaves."
        )
    first = everyone[holders[0]]["heads"][0]
    layout.check_matches(first["state"]["layout"])
    odd = sorted(q for r in everyone for q, head in r["heads"].items() if head["dtypes"] != first["dtypes"])
    if odd:  # (a sender would fail after the others posted their receives)
        raise ValueError(
            f"The optimizer shards of old ranks {odd} hold other state vectors than old rank 0's "
            f"({sorted(first['dtypes'])}): they are not one run's shards. Re-shard the shards of one run."
        )
