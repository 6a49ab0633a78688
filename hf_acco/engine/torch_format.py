"""The optimizer state as torch's optimizers save it, to and from this engine's shards (pure torch).

torch's ``Optimizer.state_dict()`` (what plain Trainer writes as ``optimizer.pt``) holds each parameter's state by
its number, the parameters numbered in the order of the parameter groups, with each group's hyper-parameters. The
engine's layout lists the same trainable parameters in the same order (``trainable_parameters``: group by group),
so parameter ``k`` of group ``j`` is the same parameter on both sides where the groups are the same (ACCOTrainer gives
the engine Trainer's two, an empty one too; their sizes are checked, and the names where the state has them).

* ``shard_from_torch_state``: this rank's shard state from such a state dict (a plain Trainer checkpoint resumed
  under ACCO). Each rank reads only its own ranges of the saved tensors (memory-mapped by ``torch.load``).
* ``local_state_from_full``: a state dict by parameter name with whole tensors (plain Trainer's FSDP checkpoint)
  as the numbered state of this rank's FSDP pieces, which ``shard_from_torch_state`` then takes.
* ``torch_state_from_shards``: torch's state dict from every rank's shard (an ACCO checkpoint resumed by plain
  Trainer), built parameter by parameter from the (memory-mapped) shards; the whole result is in memory at the end
  (torch's format is one file): about two fp32 values per parameter for Adam.

Per-element state (Adam's moments) moves exactly, in the master's dtype; each parameter's scalar state (``step``)
with it; a parameter torch never stepped has no state on either side.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping, Sequence
from typing import Any

import torch

from hf_acco.comm.sharding import FlatLayout
from hf_acco.engine.shard_state import merge_param_scalars

FROM_SHARDS = "hf_acco_from_shards"  # in a state dict made from shards: their world size and step count
# torch's own implementation switches, not hyper-parameters of the update: the running optimizer's are kept
_IMPLEMENTATION = ("foreach", "fused", "capturable", "differentiable", "params", "param_names")


def shard_runs(layout: FlatLayout, rank: int) -> list[tuple[int, int, int, int]]:
    """(parameter index, start in this rank's shard, start in the parameter's flat elements, length) of each run of
    this rank's shard that holds one parameter's elements."""
    runs = []
    for i, start, end in layout.shard_param_pieces(rank):
        bucket, offset = divmod(start, layout.chunk)
        first = bucket * layout.bucket_size + rank * layout.chunk + offset - layout.offsets[i]
        runs.append((i, start, first, end - start))
    return runs


def _group_members(groups: Sequence[int]) -> list[tuple[int, list[int]]]:
    """(group index, the layout's parameter indices in it) of each non-empty group, in order."""
    members: dict[int, list[int]] = {}
    for i, g in enumerate(groups):
        members.setdefault(g, []).append(i)
    return sorted(members.items())


def _numbering(
    layout: FlatLayout, saved: dict[str, Any], num_groups: int
) -> tuple[dict[int, int], dict[int, dict[str, Any]]]:
    """{torch's parameter number: the layout's index}, and {group index: the saved group}; a ValueError that says
    what differs when the saved groups (``num_groups`` here, empty ones included) are not this layout's."""
    if not isinstance(saved, dict) or not {"state", "param_groups"} <= set(saved):
        raise ValueError("Not a torch optimizer state dict (it has no 'state' and 'param_groups').")
    groups = list(saved["param_groups"])
    members = dict(_group_members(layout.groups))
    sizes, ours = [len(g["params"]) for g in groups], [len(members.get(g, [])) for g in range(num_groups)]
    if sizes != ours:
        raise ValueError(
            f"The optimizer state has parameter groups of {sizes} parameters, this run's optimizer {ours} (weight "
            "decay / no decay, trainable parameters only). Resume it with the model, trainable parameters (LoRA "
            "config, frozen layers) and optimizer grouping of the run that wrote it."
        )
    for g, group in enumerate(groups):
        names, indices = group.get("param_names"), members.get(g, [])
        if names is not None and list(names) != [layout.names[i] for i in indices]:
            raise ValueError(
                f"The optimizer state's parameter names ({names[:3]}...) are not this run's "
                f"({[layout.names[i] for i in indices[:3]]}...): it was written for another model."
            )
    numbering = {int(n): i for g, group in enumerate(groups) for n, i in zip(group["params"], members.get(g, []))}
    return numbering, dict(enumerate(groups))


def _split_keys(layout: FlatLayout, state: dict[int, dict[str, Any]], numbering: dict[int, int]) -> tuple[set, set]:
    """(per-element keys, scalar keys) of a torch state: a per-element value has its parameter's shape."""
    element, scalar = set(), set()
    for n, values in state.items():
        shape = tuple(layout.shapes[numbering[int(n)]])
        for key, value in values.items():
            if not torch.is_tensor(value):
                continue
            if tuple(value.shape) == shape and math.prod(shape) != 1:  # (an empty FSDP piece too)
                element.add(key)
            elif value.numel() == 1:
                scalar.add(key)
    return element, scalar - element


def optimizer_keys(
    inner: torch.optim.Optimizer, defaults: dict[str, Any], device: torch.device | str = "cpu"
) -> tuple[set[str], set[str]]:
    """(per-element, scalar) state keys ``inner``'s optimizer keeps (Adam: ``exp_avg``, ``exp_avg_sq``; ``step``):
    from one step of its class (built as ``inner`` was, with ``defaults``), each group's settings, on parameters of
    two elements (torch makes its state at a first step). The random generators are left as they were."""
    groups = [{k: v for k, v in g.items() if k not in ("params", "param_names")} for g in inner.param_groups]
    probes = [torch.zeros(2, device=device, requires_grad=True) for _ in groups]
    for p in probes:
        p.grad = torch.ones_like(p)
    cuda = [torch.device(device)] if torch.device(device).type == "cuda" else []
    with torch.random.fork_rng(devices=cuda):
        probe = type(inner)([{**g, "params": [p]} for g, p in zip(groups, probes)], **defaults)
        probe.step()
    element: set[str] = set()
    scalar: set[str] = set()
    for p in probes:
        for key, value in probe.state[p].items():
            if torch.is_tensor(value):
                (element if value.shape == p.shape else scalar).add(key)
    return element, scalar


def shard_from_torch_state(
    template: dict[str, Any],
    layout: FlatLayout,
    rank: int,
    saved: dict[str, Any],
    step_count: int,
    expected_keys: tuple[set[str], set[str]] | None = None,
    settings: Collection[str] = (),
) -> dict[str, Any]:
    """This rank's shard state (loadable by ``ACCOOptimizer.load_state_dict``) with the optimizer state of a torch
    state dict ``saved`` over the same trainable parameters: its per-element state, each parameter's scalars, its
    groups' hyper-parameters, as torch's ``load_state_dict`` takes them (those the engine's groups have, and the
    ``settings`` its inner optimizer keeps, ``betas`` say, where the engine's groups leave them to its defaults;
    the running optimizer's implementation switches kept); the master and the model
    from the model as it is (``template``: this engine's ``state_dict()`` at a step boundary, whose ``model`` is
    this rank's pieces of the model's parameters); ``step_count`` optimizer steps done. ``expected_keys``: the
    (per-element, scalar) keys this run's optimizer keeps (``optimizer_keys``); a state with others is refused."""
    numbering, groups = _numbering(layout, saved, len(template["hparams"]))
    state: dict[int, dict[str, Any]] = {int(n): v for n, v in saved["state"].items()}
    unknown = sorted(set(state) - set(numbering))
    if unknown:
        raise ValueError(f"The optimizer state has state for parameter numbers {unknown[:5]} that no group holds.")
    element, scalar = _split_keys(layout, state, numbering)
    ours = expected_keys if expected_keys is not None else (set(template["optim_state"]), scalar)
    if state and (element, scalar) != ours:
        raise ValueError(
            f"The optimizer state keeps {sorted(element)} per element and {sorted(scalar)} per parameter, this run's "
            f"optimizer {sorted(ours[0])} and {sorted(ours[1])}: resume it with the optimizer (optim) of the run that "
            "wrote it."
        )
    master = template["master"]
    by_index = {numbering[n]: values for n, values in state.items()}
    for i, values in by_index.items():
        for key in element:
            value = values.get(key)
            if value is None or tuple(value.shape) != tuple(layout.shapes[i]):
                got = "none" if value is None else f"shape {tuple(value.shape)}"
                raise ValueError(
                    f"The optimizer state of {layout.names[i]} has {key!r} of {got}, the parameter is "
                    f"{tuple(layout.shapes[i])}: it was written for another model (or another order of parameters)."
                )
    vectors = {key: torch.zeros_like(master) for key in element}
    for i, start, first, length in shard_runs(layout, rank):
        if i not in by_index:
            continue  # never stepped: zeros, and no scalars (below)
        for key, vector in vectors.items():
            vector[start : start + length].copy_(by_index[i][key].reshape(-1)[first : first + length])
    param_scalars = {key: torch.full((len(layout.names),), math.nan, dtype=torch.float64) for key in scalar}
    scalars: dict[str, torch.Tensor] = {}
    for i, values in by_index.items():
        for key in scalar:
            value = values[key]
            param_scalars[key][i] = float(value)
            scalars.setdefault(key, torch.as_tensor(value).detach().clone().reshape(()))
    hparams = [dict(hp) for hp in template["hparams"]]
    for g, group in groups.items():
        known = set(hparams[g]) | set(settings)
        hparams[g].update({k: v for k, v in group.items() if k in known and k not in _IMPLEMENTATION})
    out = dict(template)
    out.update(
        step_count=step_count,
        pending_commit=False,
        hparams=hparams,
        master=template["model"].to(master.dtype),  # the model's parameters as loaded: the committed ones
        optim_state=vectors or template["optim_state"],
        optim_scalars=scalars or template["optim_scalars"],
        optim_param_scalars=param_scalars,
    )
    out.pop("int8_residual", None)  # no rounding carried over: a fresh residual
    return out


def steps_taken(saved: dict[str, Any]) -> int:
    """The optimizer steps a torch state dict has done: the largest ``step`` of its parameters (torch's optimizers
    count each parameter's steps; 0 where none keeps one, e.g. SGD without momentum)."""
    steps = [float(v["step"]) for v in saved.get("state", {}).values() if "step" in v]
    return int(max(steps, default=0))


def _checked_groups(saved: Any, sizes: Sequence[int], why: str = "") -> list[dict[str, Any]]:
    """The parameter groups of a torch optimizer state dict whose groups hold ``sizes`` parameters; else a
    ValueError that says what differs (``why``: what that means, appended)."""
    if not isinstance(saved, dict) or not {"state", "param_groups"} <= set(saved):
        raise ValueError("Not a torch optimizer state dict (it has no 'state' and 'param_groups').")
    groups = list(saved["param_groups"])
    theirs = [len(g["params"]) for g in groups]
    if theirs != list(sizes):
        ours = list(sizes)
        raise ValueError(
            f"The optimizer state has parameter groups of {theirs} parameters, this run's optimizer {ours}{why}."
        )
    return groups


def over_kept_parameters(saved: dict[str, Any], keep: Sequence[Sequence[bool]]) -> dict[str, Any]:
    """The state dict of a torch optimizer over only the kept parameters of its groups, renumbered as torch numbers
    them: ``keep[g][k]`` says whether parameter ``k`` of group ``g`` is kept (the engine leaves frozen ones out of
    its groups; torch's optimizer numbers them and keeps no state for them while they have no gradient). Raises a
    ValueError when the groups' sizes are not ``keep``'s."""
    why = " (frozen ones included): it was written with other parameter groups or for another model"
    groups = _checked_groups(saved, [len(k) for k in keep], why)
    state, numbers, out_groups = saved["state"], iter(range(sum(map(sum, keep)))), []
    renumbered: dict[int, Any] = {}
    for group, kept in zip(groups, keep):
        params = []
        for n, k in zip(group["params"], kept):
            if k:
                params.append(next(numbers))
                if n in state:
                    renumbered[params[-1]] = state[n]
        names = group.get("param_names")
        out_groups.append(
            {**group, "params": params}
            | ({} if names is None else {"param_names": [m for m, k in zip(names, kept) if k]})
        )
    return {**saved, "state": renumbered, "param_groups": out_groups}


def local_state_from_full(
    saved: dict[str, Any],
    groups: Sequence[Sequence[str]],
    pieces: Mapping[str, tuple[slice, ...]],
    shapes: Mapping[str, Sequence[int]],
) -> dict[str, Any]:
    """A torch optimizer state dict keyed by parameter name, with whole tensors (``get_optimizer_state_dict`` with
    ``full_state_dict``: what Trainer's FSDP checkpoint holds in ``optimizer.bin``), as the numbered state dict of an
    optimizer over this rank's pieces of those parameters: ``groups`` the parameter names of each of its groups, in
    its order; ``pieces`` each parameter's index into the whole tensor (its FSDP local shard), ``shapes`` its whole
    shape. Each saved group must hold the same parameters as the group of the same place, each per-element tensor
    the parameter's whole shape (ValueError)."""
    saved_groups = _checked_groups(saved, [len(g) for g in groups])
    state, out_groups, number = {}, [], 0
    for names, group in zip(groups, saved_groups):
        if set(group["params"]) != set(names):
            missing = sorted(set(names) - set(group["params"]))[:3]
            raise ValueError(f"The optimizer state's groups hold other parameters than this run's (not {missing}...).")
        out_groups.append({**group, "params": list(range(number, number + len(names))), "param_names": list(names)})
        for name in names:
            if name in saved["state"]:
                values, whole = saved["state"][name], tuple(shapes[name])
                wrong = [k for k, v in values.items() if torch.is_tensor(v) and v.dim() and tuple(v.shape) != whole]
                if wrong:
                    raise ValueError(
                        f"The optimizer state of {name} has {wrong[0]!r} of shape {tuple(values[wrong[0]].shape)}, "
                        f"the parameter is {whole}: it was written for another model."
                    )
                state[number] = {
                    k: v[pieces[name]] if torch.is_tensor(v) and v.dim() else v for k, v in values.items()
                }
            number += 1
    return {"state": state, "param_groups": out_groups}


def torch_state_from_shards(shards: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """torch's ``Optimizer.state_dict()`` of the optimizer over the whole model, from every rank's shard (one run,
    any order): each parameter's per-element state and scalars (a parameter never stepped has none), the groups'
    hyper-parameters, the groups as the engine was given them (ACCOTrainer: Trainer's two, an empty one included)."""
    shards = sorted(shards, key=lambda s: s["rank"])
    meta = shards[0]["layout"]
    if [s["rank"] for s in shards] != list(range(meta["world_size"])):
        raise ValueError(f"need the shards of all {meta['world_size']} ranks, got ranks {[s['rank'] for s in shards]}")
    layout = FlatLayout.from_meta(meta)
    pieces: dict[int, list[tuple[int, int, int, int]]] = {}  # parameter -> (rank, shard start, its start, length)
    for rank in range(layout.world_size):
        for i, start, first, length in shard_runs(layout, rank):
            pieces.setdefault(i, []).append((rank, start, first, length))
    scalars = merge_param_scalars(list(shards))
    templates = shards[0]["optim_scalars"]
    for key, value in templates.items():  # a shard written before each parameter had its own: the shared one
        scalars.setdefault(key, torch.full((len(layout.names),), float(value), dtype=torch.float64))
    keys = {k: v.dtype for s in shards for k, v in s["optim_state"].items()}  # every rank's (SGD: made when stepped)
    state: dict[int, dict[str, Any]] = {}
    for i, shape in enumerate(layout.shapes):
        if any(math.isnan(float(v[i])) for v in scalars.values()):
            continue  # never stepped: torch keeps no state for it
        values: dict[str, Any] = {}
        for key, dtype in keys.items():
            flat = torch.zeros(math.prod(shape), dtype=dtype)  # a rank that never made this key: zeros there
            for rank, start, first, length in pieces.get(i, []):
                if key in shards[rank]["optim_state"]:
                    flat[first : first + length].copy_(shards[rank]["optim_state"][key][start : start + length])
            values[key] = flat.reshape(shape)
        for key, vector in scalars.items():
            template = templates.get(key)
            values[key] = torch.tensor(float(vector[i]), dtype=template.dtype if template is not None else None)
        state[i] = values
    members = dict(_group_members(layout.groups))
    param_groups = [{**hp, "params": members.get(g, [])} for g, hp in enumerate(shards[0]["hparams"])]
    made_from = {"world_size": layout.world_size, "step_count": shards[0]["step_count"]}  # torch's load ignores it
    return {"state": state, "param_groups": param_groups, FROM_SHARDS: made_from}


# A learning-rate scheduler's lists with one entry per parameter group (torch's LambdaLR, ReduceLROnPlateau)
_PER_GROUP = ("base_lrs", "_last_lr", "lr_lambdas", "min_lrs")


def scheduler_with_empty_groups(state: dict[str, Any], sizes: Sequence[int]) -> dict[str, Any]:
    """A scheduler's state over only the non-empty groups of an optimizer whose groups have ``sizes`` parameters
    (ACCOTrainer checkpoints of hf_acco 0.1.0 kept no empty group) for that optimizer: an empty group gets its
    neighbour's entry (Trainer sets both alike). A state with an entry per group is returned as it is."""
    kept = [n for n in sizes if n]
    if len(kept) == len(sizes):
        return state
    out = dict(state)
    for key in _PER_GROUP:
        value = state.get(key)
        if isinstance(value, list) and len(value) == len(kept) and value:
            entries = iter(value)
            out[key] = [next(entries) if n else value[0] for n in sizes]
    return out
