"""ACCO in a hand-written Accelerate loop: ``prepare_acco`` and a few unchanged lines.

    model, optimizer = prepare_acco(accelerator, model, lr=3e-4, weight_decay=0.1)
    scheduler = accelerator.prepare(get_scheduler(...optimizer...))
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            optimizer.step()            # every micro-batch, as usual: ACCO counts it; steps at the window's end
            scheduler.step()
            optimizer.zero_grad()
    accelerator.save_state(dir)         # committed model weights + one optimizer shard file per rank
    accelerator.load_state(dir)

Why ``optimizer.step()``: Accelerate has no hook at the end of a backward, but the usual loop calls
``optimizer.step()`` after every backward and Accelerate forwards it only at the end of an accumulation window;
the wrapper counts each call as one micro-batch and forwards the window's end to the ACCO optimizer.

Slower and faster GPUs together, as ACCOTrainer's ``acco_accumulation="paced"`` does it: ``accumulation="paced"``
and the micro-batches each rank claims (``acco_dataloader``; every sample once per epoch, a global batch of
``num_processes x gradient_accumulation_steps`` micro-batches per step)::

    model, optimizer = prepare_acco(accelerator, model, accumulation="paced", lr=3e-4)
    data = acco_dataloader(accelerator, dataset, batch_size=8, collate_fn=collate)
    for epoch in range(epochs):
        data.set_epoch(epoch)
        while not data.epoch_done:
            for batch in data.step_batches(optimizer):       # this rank's share of the step, as fast as it goes
                accelerator.backward(model(**to_device(batch)).loss)
                optimizer.step()                             # counts the micro-batch; the data ends the step
            scheduler.step()

``accumulation="dynamic"`` (each rank computes until the round in flight is done: the global batch varies) steps
on its own: ``optimizer.step()`` only counts micro-batches there.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from accelerate.optimizer import AcceleratedOptimizer
from torch.utils.data import DataLoader

from accelerate import Accelerator
from hf_acco.comm.groups import agreed_key, check_world_size, claims_store, ensure_process_group
from hf_acco.comm.module_buffers import BufferSync
from hf_acco.engine.checkpoint import import_torch_state, load_optimizer_state, save_optimizer_state
from hf_acco.engine.core import ACCOOptimizer
from hf_acco.engine.torch_format import over_kept_parameters, steps_taken
from hf_acco.integrations import fsdp
from hf_acco.pacing.claims import ClaimingBatchSampler
from hf_acco.pacing.pacer import Pacer

logger = logging.getLogger(__name__)


class ACCOAcceleratedOptimizer(AcceleratedOptimizer):
    """Accelerate's optimizer wrapper around an ACCOOptimizer: counts micro-batches, saves per-rank shards."""

    def __init__(self, optimizer: ACCOOptimizer, accelerator: Accelerator, numbering: list[list[str]]) -> None:
        super().__init__(optimizer, device_placement=False, scaler=accelerator.scaler)
        self.checkpoint_dir: str | None = None
        # accelerator.backward divides the loss by gradient_accumulation_steps: weigh micro-batches the same way
        self.micro_batch_weight = 1.0 / accelerator.gradient_accumulation_steps
        self.numbering = numbering  # each group's parameter names as a torch optimizer numbers them, frozen included

    def step(self, closure: Any = None) -> None:
        self.optimizer.after_backward(self.micro_batch_weight)
        if self.gradient_state.sync_gradients:
            self.optimizer.step()

    def state_dict(self) -> dict[str, Any]:
        # accelerator.save_state writes this on rank 0 only; the real state is in the per-rank shard files
        return {"hf_acco": "optimizer state in acco_optimizer_rank*_of_*.pt"}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        if self.checkpoint_dir is None:
            raise RuntimeError("Load ACCO optimizer state with accelerator.load_state(dir) (after prepare_acco).")
        directory, self.checkpoint_dir = self.checkpoint_dir, None
        if "hf_acco" in state_dict:  # after Accelerate loaded the model weights
            load_optimizer_state(self.optimizer, directory)
        else:  # a plain Accelerate loop's checkpoint: its torch optimizer's state (the same on every rank)
            self._import(state_dict, directory)

    def _import(self, saved: dict[str, Any], directory: str) -> None:
        keep = []  # each numbered parameter the engine kept (trainable; one listed twice: its first place)
        for names, group in zip(self.numbering, self.optimizer.param_groups):
            kept, mask = set(group.get("param_names", [])), []
            for name in names:
                mask.append(name in kept)
                kept.discard(name)
            keep.append(mask)
        state = saved.get("state") if isinstance(saved, dict) else None  # (a damaged file fails in the import)
        values = (
            [v for p in state.values() if isinstance(p, dict) for v in p.values()] if isinstance(state, dict) else []
        )
        if any(torch.is_tensor(v) and v.device.type != "cpu" for v in values):
            logger.warning(
                "accelerator.load_state put the whole torch optimizer state of %s on every device before ACCO "
                "keeps each rank's shard of it: for a large model, accelerator.load_state(dir, map_location='cpu')",
                directory,
            )

        def explain(e: Exception) -> Exception:
            return ValueError(
                f"Could not load the optimizer state of {directory} (a plain Accelerate checkpoint: a torch "
                f"optimizer's state) into ACCO: {e} Pass prepare_acco the parameters or parameter groups of the "
                "optimizer that wrote it (params=..., as that optimizer was given them), or load only its model "
                "weights."
            )

        steps = import_torch_state(
            self.optimizer, lambda: (over_kept_parameters(saved, keep), steps_taken(saved)), explain
        )
        logger.info("Loaded a torch optimizer's state from %s into ACCO (%d steps)", directory, steps)


def _group_names(model: torch.nn.Module, params: Any) -> list[dict[str, Any]]:
    """``params`` (what a torch optimizer takes: parameters, (name, parameter) pairs, or dicts of them with
    per-group settings) as groups with each parameter's name in ``model`` (``param_names``) and no ``params``."""
    names = {id(p): n for n, p in model.named_parameters()}
    listed = list(params)
    groups = listed if listed and isinstance(listed[0], dict) else [{"params": listed}]
    out = []
    for group in groups:
        members = group["params"]
        members = [members] if torch.is_tensor(members) else list(members)
        tensors = [m[1] if isinstance(m, tuple) else m for m in members]
        unknown = [tuple(t.shape) for t in tensors if id(t) not in names]
        if unknown:
            raise ValueError(
                f"params holds tensors that are not parameters of the model given to prepare_acco (shapes "
                f"{unknown[:3]}): pass that model's own parameters (model.parameters(), or groups of them)."
            )
        settings = {k: v for k, v in group.items() if k not in ("params", "param_names")}
        out.append({**settings, "param_names": [names[id(t)] for t in tensors]})
    return out


def prepare_acco(
    accelerator: Accelerator,
    model: torch.nn.Module,
    *,
    params: Any = None,
    weight_decay: float | None = None,
    broadcast_buffers: bool | None = None,
    **acco_kwargs: Any,
) -> tuple[torch.nn.Module, ACCOAcceleratedOptimizer]:
    """Prepare ``model`` (no DDP) and build its ACCO optimizer for a hand-written Accelerate loop.

    ``params``: what the torch optimizer this replaces was given (``model.parameters()``, or groups of
    ``model``'s parameters with their own ``lr``, ``weight_decay``, ...); frozen ones are left out, as they get no
    gradient. Without it: every trainable parameter, weight decay on matrices and embeddings, not on biases and
    norm weights (one-dimensional parameters). ``weight_decay``: without ``params``, the matrices' (default 0);
    with them, the default of groups that set none (default: the optimizer's own). ``acco_kwargs`` go to
    [`ACCOOptimizer`] (``lr``, ``schedule``, ``max_grad_norm``, ...); ``micro_batches`` defaults to the accelerator's
    ``gradient_accumulation_steps``; ``accumulation="dynamic"`` ends its steps itself (``auto_step``).
    ``broadcast_buffers`` (DDP's; unset: True with fixed accumulation): rank 0's buffers (BatchNorm's running
    statistics) before the first forward of each accumulation window, as DDP's forward does; False keeps each rank's
    own, as it is with dynamic or paced accumulation, whose ranks compute different numbers of micro-batches.
    Collective: every rank.

    ``accelerator.load_state`` resumes an ACCO checkpoint, and also a plain Accelerate loop's checkpoint (its torch
    optimizer's state: the moments, step counts and group settings carry on) where ``params`` has that optimizer's
    groups; not with FSDP inside machines. It reads the whole state on every rank: for a large model,
    ``accelerator.load_state(dir, map_location="cpu")``.

    Returns ``(model, optimizer)``: the prepared model, and Accelerate's optimizer wrapper around the engine
    (``optimizer.optimizer`` is the [`ACCOOptimizer`]: ``finalize()``, ``committed_parameters()``, ...). Raises
    ``ValueError`` for ``params`` that are not ``model``'s, for ``broadcast_buffers=True`` under FSDP or with
    accumulation other than ``"fixed"``.

    With Accelerate set up for FSDP2 over several machines (``fsdp_version: 2`` and a parallelism config of
    ``dp_replicate_size`` machines x ``dp_shard_size`` GPUs each), FSDP shards the model inside each machine and the
    engine's rounds run across machines (docs/hsdp.md); ``accumulation`` must be ``"fixed"``. ``save_state`` then
    writes Accelerate's FSDP model files with the parameters the model holds (with ``schedule="acco"`` the
    estimate; for the committed ones, ``accelerator.get_state_dict(model)`` inside
    ``optimizer.optimizer.committed_parameters()``) and the engine's shards in a folder per FSDP shard. Call
    ``save_state`` at a step boundary (after the window's last ``optimizer.step()``); for a save in the middle of a
    step pass ``boundary_copy=True`` (a pinned host copy of each GPU's shard of the model at every step boundary).
    """
    check_world_size(accelerator.num_processes)
    ensure_process_group(accelerator.device)
    named_groups = None if params is None else _group_names(model, params)  # by name: FSDP replaces the parameters
    sharded = fsdp.hsdp_layout(accelerator) is not None  # FSDP2 inside each machine, ACCO across (docs/hsdp.md)
    if sharded:
        if broadcast_buffers:
            raise ValueError("broadcast_buffers=True with FSDP: FSDP shards the modules; pass broadcast_buffers=None.")
        model = fsdp.shard_within_machines(accelerator, model)
        accelerator._models.append(model)  # as prepare() registers it: save_state/load_state write and read it
        acco_kwargs.setdefault("group", fsdp.replicate_group(accelerator))
        # no pinned host copy of the boundary's shard unless asked for (a mid-step save_state needs it): a GPU's
        # engine shard in the model's dtype, pinned, on every GPU (70B on 8 x 8: 32 GiB a machine)
        acco_kwargs.setdefault("boundary_copy", False)
        fsdp.sync_every_micro_batch(accelerator)
    else:
        model = accelerator.prepare_model(model, evaluation_mode=True)  # autocast and placement; ACCO averages
    if named_groups is not None:
        by_name = dict(accelerator.unwrap_model(model, keep_torch_compile=False).named_parameters())
        groups = [{**g, "params": [by_name[n] for n in g["param_names"]]} for g in named_groups]
        if weight_decay is not None:
            acco_kwargs.setdefault("weight_decay", weight_decay)
    else:
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        groups = [
            {"params": [p for _, p in named if p.ndim >= 2], "param_names": [n for n, p in named if p.ndim >= 2],
             "weight_decay": weight_decay or 0.0},
            {"params": [p for _, p in named if p.ndim < 2], "param_names": [n for n, p in named if p.ndim < 2],
             "weight_decay": 0.0},
        ]  # fmt: skip
        groups = [g for g in groups if g["params"]]
    numbering = [list(g["param_names"]) for g in groups]  # before the engine leaves the frozen ones out
    acco_kwargs.setdefault("micro_batches", accelerator.gradient_accumulation_steps)
    if acco_kwargs.get("accumulation") == "dynamic":
        acco_kwargs.setdefault("auto_step", True)  # its steps end with the round, not with Accelerate's windows
    fixed = acco_kwargs.get("accumulation", "fixed") == "fixed"
    if broadcast_buffers and not fixed:
        raise ValueError(
            f"broadcast_buffers=True needs accumulation='fixed': with {acco_kwargs['accumulation']!r} ranks compute "
            "different numbers of micro-batches and never meet before the same forward. Pass "
            "broadcast_buffers=False (each rank keeps its own buffers)."
        )
    engine = ACCOOptimizer(groups, **acco_kwargs)
    if broadcast_buffers is not False and fixed and accelerator.num_processes > 1 and not sharded:  # DDP's
        BufferSync(model, lambda: accelerator.sync_gradients)
    optimizer = ACCOAcceleratedOptimizer(engine, accelerator, numbering)
    optimizer._is_accelerate_prepared = True
    if not sharded:  # registered for save_state / load_state (with FSDP they would save it as a torch optimizer's
        optimizer = accelerator.prepare_optimizer(optimizer)  # state dict, whose loading steps it: the hooks do)

    def save_hook(models: list[torch.nn.Module], weights: list[dict], output_dir: str) -> None:
        if sharded:  # Accelerate wrote the FSDP model files already, with the parameters the model holds
            save_optimizer_state(engine, output_dir)
            return
        # The model files get the committed parameters, not the estimate the model computes with: a copy of them on
        # the host, made by the process that writes them (Accelerate's save(): the main process, or each node's first
        # with save_on_each_node). The others keep Accelerate's references to the model, which they never write.
        on_each_node = accelerator.project_configuration.save_on_each_node
        if accelerator.is_main_process or (on_each_node and accelerator.is_local_main_process):
            with engine.committed_parameters():
                for i, m in enumerate(models):
                    if i < len(weights) and m is model:
                        state = accelerator.get_state_dict(m, unwrap=False)
                        weights[i] = {k: v.detach().to("cpu", copy=True) for k, v in state.items()}
        save_optimizer_state(engine, output_dir)

    def load_hook(models: list[torch.nn.Module], input_dir: str) -> None:
        if sharded:  # after Accelerate loaded the FSDP model files (it calls no load_state_dict of an optimizer
            load_optimizer_state(engine, input_dir)  # it does not hold)
            return
        optimizer.checkpoint_dir = input_dir  # loaded by ACCOAcceleratedOptimizer.load_state_dict, later

    accelerator.register_save_state_pre_hook(save_hook)
    accelerator.register_load_state_pre_hook(load_hook)
    return model, optimizer


def acco_dataloader(
    accelerator: Accelerator,
    dataset: Any,
    batch_size: int,
    *,
    seed: int = 0,
    shuffle: bool = True,
    drop_last: bool = False,
    micro_batches: int | None = None,
    **loader_kwargs: Any,
) -> Pacer:
    """The micro-batches of a paced ACCO loop (``prepare_acco(..., accumulation="paced")``), claimed by each rank at
    its own pace from one seeded order of ``dataset`` (map-style): every sample once per epoch.

    ``micro_batches``: per optimizer step over all ranks (default ``num_processes x gradient_accumulation_steps``).
    ``loader_kwargs`` go to the DataLoader (``collate_fn``, ``num_workers``, ...). Call ``set_epoch`` before every
    epoch; ``state_dict()`` at a step boundary is the position to resume from (``load_state_dict``), on any
    number of ranks. Collective: every rank (they agree on the claim counter's name).
    """
    ensure_process_group(accelerator.device)
    store = claims_store()
    sampler = ClaimingBatchSampler(store, len(dataset), batch_size, seed=seed, drop_last=drop_last, shuffle=shuffle,
                                   num_replicas=accelerator.num_processes, key=agreed_key("claims"))  # fmt: skip
    loader = DataLoader(dataset, batch_sampler=sampler, **loader_kwargs)
    return Pacer(loader, sampler, micro_batches or accelerator.num_processes * accelerator.gradient_accumulation_steps)
