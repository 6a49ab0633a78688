"""A hand-written Accelerate loop: prepare_acco changes a few lines; save_state/load_state resume exactly."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import set_seed

from hf_acco import prepare_acco
from hf_acco.tools.multiprocess import run_ranks

from .helpers import rel
from .models import batch, tiny_llama

ACCUM, STEPS = 4, 6


def loop(rank: int, world_size: int, acco: bool, schedule: str = "acco", start: int = 0, save: str | None = None,
         load: str | None = None, stop: int = STEPS, weight_decay: float = 0.1, hsdp: bool = False,
         grouped: bool | None = None, ddp_extra: dict | None = None) -> list[torch.Tensor]:  # fmt: skip
    """``hsdp``: Accelerate set up for FSDP2 inside 2 machines of world_size / 2 ranks (as for its HSDP).
    ``grouped``: the torch optimizer's parameter groups of ``user_groups`` (a frozen norm, another learning rate
    for the embeddings), given to ``prepare_acco`` too; False: prepare_acco's own groups (None: as ``acco``).
    ``ddp_extra``: more settings of the plain loop's AdamW (``betas``, ``eps``)."""
    set_seed(0)
    sharding = {}
    if hsdp:
        from accelerate.parallelism_config import ParallelismConfig
        from accelerate.utils import FullyShardedDataParallelPlugin

        from .fsdp_cpu import allow_fsdp_on_cpu

        allow_fsdp_on_cpu()
        shape = ParallelismConfig(dp_replicate_size=2, dp_shard_size=world_size // 2)
        sharding = {"fsdp_plugin": FullyShardedDataParallelPlugin(fsdp_version=2), "parallelism_config": shape}
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM, **sharding)
    model = tiny_llama()
    params = user_groups(model) if grouped else None if acco else model.parameters()
    if acco:  # the changed lines
        model, optimizer = prepare_acco(
            accelerator, model, params=params, lr=1e-2, weight_decay=weight_decay, schedule=schedule,
            max_grad_norm=1.0,
        )  # fmt: skip
    else:
        optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=weight_decay, **(ddp_extra or {}))
        model, optimizer = accelerator.prepare(model, optimizer)
    scheduler = accelerator.prepare(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.1 * s)))
    if load is not None:
        accelerator.load_state(load)
    for t in range(start, stop):
        for i in range(ACCUM):
            with accelerator.accumulate(model):
                loss = model(**batch(accelerator.process_index, t * ACCUM + i)).loss
                accelerator.backward(loss)
                if not acco and accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), 1.0)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
        if save is not None and t + 1 == STEPS // 2:
            accelerator.save_state(save)
    if acco:
        optimizer.optimizer.finalize()  # committed parameters in the model
    return [full(p) for p in accelerator.unwrap_model(model).parameters()]


def user_groups(model: torch.nn.Module) -> list[dict]:
    """A hand-written loop's own groups: the embeddings at another learning rate, the rest at the optimizer's
    default; the final norm frozen (torch's optimizer still numbers it, the engine leaves it out)."""
    model.model.norm.weight.requires_grad_(False)
    embed = model.model.embed_tokens.weight
    return [{"params": [embed], "lr": 3e-3}, {"params": [p for p in model.parameters() if p is not embed]}]


def full(p: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()


def test_sync_schedule_in_an_accelerate_loop_matches_ddp() -> None:
    ddp = run_ranks(loop, backend=None, acco=False, weight_decay=0.0)
    ours = run_ranks(loop, backend=None, acco=True, schedule="sync", weight_decay=0.0)
    assert rel(ours[0], ddp[0]) < 1e-6
    assert all(torch.equal(a, b) for a, b in zip(ours[0], ours[1]))
    assert rel(ours[0], [p.detach() for p in tiny_llama().parameters()]) > 1e-2


def test_save_state_and_load_state_resume_exactly(tmp_path: Path) -> None:
    straight = run_ranks(loop, backend=None, acco=True, save=str(tmp_path))
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "acco_optimizer_rank1_of_2.pt" in names, names
    resumed = run_ranks(loop, backend=None, acco=True, start=STEPS // 2, load=str(tmp_path))
    for r in range(2):
        assert all(torch.equal(a, b) for a, b in zip(resumed[r], straight[r]))


@pytest.mark.parametrize(("schedule", "grouped"), [("sync", False), ("acco", False), ("sync", True)])
def test_fsdp_inside_machines_in_an_accelerate_loop_equals_acco_without_fsdp(schedule: str, grouped: bool) -> None:
    """4 ranks as 2 machines x 2: FSDP inside each, the engine across; the same training as without FSDP (with the
    user's own groups too: found by name among FSDP's parameters)."""
    plain = run_ranks(loop, world_size=4, backend=None, acco=True, schedule=schedule, grouped=grouped)
    ours = run_ranks(loop, world_size=4, backend=None, acco=True, schedule=schedule, hsdp=True, grouped=grouped)
    assert rel(ours[0], plain[0]) < 1e-5
    assert all(all(torch.equal(a, b) for a, b in zip(ours[0], ours[r])) for r in range(1, 4))


def test_prepare_acco_takes_the_torch_optimizers_parameter_groups() -> None:
    """params= the groups the torch optimizer had (their own learning rate, a frozen parameter, the default weight
    decay): ``sync`` equals DDP with that optimizer."""
    ddp = run_ranks(loop, backend=None, acco=False, grouped=True)
    ours = run_ranks(loop, backend=None, acco=True, schedule="sync", grouped=True)
    assert rel(ours[0], ddp[0]) < 1e-6
    norm = [n for n, _ in tiny_llama().named_parameters()].index("model.norm.weight")
    assert torch.equal(ours[0][norm], tiny_llama().model.norm.weight.detach())  # frozen: as it was


def test_a_plain_accelerate_checkpoint_resumes_under_prepare_acco(tmp_path: Path) -> None:
    """A plain (DDP) loop's save_state, loaded after prepare_acco with the same groups: its AdamW moments, step
    counts and settings (betas and eps the ACCO loop does not give: taken from the checkpoint, as torch's
    load_state_dict does) carry on, so ``sync`` continues exactly as DDP would. With prepare_acco's own groups (not
    the optimizer's) every rank refuses it, saying what to pass."""
    settings = {"betas": (0.8, 0.95), "eps": 1e-6}
    ddp = run_ranks(loop, backend=None, acco=False, grouped=True, save=str(tmp_path), ddp_extra=settings)
    assert (tmp_path / "optimizer.bin").is_file()
    ours = run_ranks(loop, backend=None, acco=True, schedule="sync", grouped=True, start=STEPS // 2,
                     load=str(tmp_path))  # fmt: skip
    assert rel(ours[0], ddp[0]) < 1e-6
    with pytest.raises(RuntimeError, match=r"params=\.\.\., as that optimizer was given them"):
        run_ranks(loop, backend=None, acco=True, schedule="sync", grouped=False, start=STEPS // 2,
                  load=str(tmp_path))  # fmt: skip


def compiled_with_a_parameter_listed_twice(rank: int, world_size: int) -> tuple[dict, dict]:
    """A plain AdamW over groups that list one parameter twice (torch numbers it once), one step; then prepare_acco
    with those groups on a model Accelerate compiles (its parameters renamed ``_orig_mod.*``), loading that state."""
    from hf_acco.engine.torch_format import torch_state_from_shards

    model = tiny_llama()
    groups = lambda m: [{"params": [m.lm_head.weight, m.lm_head.weight], "lr": 3e-3},  # noqa: E731
                        {"params": [p for p in m.parameters() if p is not m.lm_head.weight]}]  # fmt: skip
    plain = torch.optim.AdamW(groups(model), lr=1e-2)
    model(**batch(0, 0)).loss.backward()
    plain.step()
    saved = plain.state_dict()
    accelerator = Accelerator(cpu=True, dynamo_backend="eager")
    fresh = tiny_llama()
    _, optimizer = prepare_acco(accelerator, fresh, params=groups(fresh), lr=1e-2, schedule="sync")
    optimizer.checkpoint_dir = "(a plain loop's checkpoint)"  # as accelerator.load_state's hook sets it
    optimizer.load_state_dict(saved)
    loaded = torch_state_from_shards([optimizer.optimizer.state_dict()])
    return saved, loaded


def test_a_plain_state_loads_into_a_compiled_model_with_a_parameter_listed_twice() -> None:
    ((saved, loaded),) = run_ranks(compiled_with_a_parameter_listed_twice, world_size=1, backend=None)
    assert saved["param_groups"][0]["params"] == [1, 1]  # torch: the same number twice, the next group's from 2
    numbers = lambda state: list(dict.fromkeys(n for g in state["param_groups"] for n in g["params"]))  # noqa: E731
    assert len(numbers(saved)) == len(numbers(loaded)) == len(loaded["state"]) == len(saved["state"])
    for theirs, ours in zip(numbers(saved), numbers(loaded)):  # parameter by parameter, in the groups' order
        values = saved["state"][theirs]
        assert all(torch.equal(loaded["state"][ours][k], v) for k, v in values.items() if k != "step")
        assert float(loaded["state"][ours]["step"]) == float(values["step"])  # (the twice-listed one: 2)


def test_fsdp_inside_machines_save_state_and_load_state_resume_exactly(tmp_path: Path) -> None:
    straight = run_ranks(loop, world_size=4, backend=None, acco=True, save=str(tmp_path), hsdp=True)
    assert (tmp_path / "fsdp_shard1_of_2" / "acco_optimizer_rank1_of_2.pt").is_file()
    resumed = run_ranks(loop, world_size=4, backend=None, acco=True, start=STEPS // 2, load=str(tmp_path), hsdp=True)
    for r in range(4):
        assert all(torch.equal(a, b) for a, b in zip(resumed[r], straight[r]))


def paced_loop(rank: int, world_size: int, epochs: int = 2, wire: dict | None = None) -> dict:
    """The loop of accelerate_hook's docstring: rank 1 three times slower, every sample once per epoch."""
    import time

    from hf_acco import acco_dataloader

    set_seed(0)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
    model, optimizer = prepare_acco(
        accelerator, tiny_llama(), accumulation="paced", lr=1e-2, max_grad_norm=1.0, **(wire or {})
    )
    scheduler = accelerator.prepare(torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1 + 0.1 * s)))
    samples = [batch(0, i, size=1) for i in range(37)]
    for i, s in enumerate(samples):
        s["index"] = torch.tensor([i])
    data = acco_dataloader(accelerator, samples, batch_size=2, collate_fn=lambda b: {k: torch.cat([x[k] for x in b])
                           for k in b[0]})  # fmt: skip
    seen, steps, lrs = [], 0, []
    for epoch in range(epochs):
        data.set_epoch(epoch)
        while not data.epoch_done:
            for b in data.step_batches(optimizer):
                time.sleep(0.002 * (1 + 2 * rank))
                seen.append((epoch, *b.pop("index").tolist()))
                accelerator.backward(model(**b).loss)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            steps += 1
            lrs.append(optimizer.param_groups[0]["lr"])
    optimizer.optimizer.finalize()
    return {"seen": seen, "steps": steps, "engine_steps": optimizer.optimizer.step_count,
            "params": [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]}  # fmt: skip


def test_a_paced_accelerate_loop_uses_every_sample_once_at_unequal_speeds() -> None:
    fast, slow = run_ranks(paced_loop, backend=None)
    for epoch in range(2):
        used = sorted(i for r in (fast, slow) for e, *idx in r["seen"] if e == epoch for i in idx)
        assert used == list(range(37))
    assert fast["steps"] == slow["steps"] == fast["engine_steps"] == 2 * 3  # 19 micro-batches, 8 per step
    assert all(torch.equal(a, b) for a, b in zip(fast["params"], slow["params"]))


@pytest.mark.parametrize(("changes", "error_feedback"), [("int8", True), ("int4", False)])
def test_a_paced_accelerate_loop_with_int8_on_the_wire_keeps_the_ranks_identical(
    changes: str, error_feedback: bool
) -> None:
    """int8 gradients, int8 (with error feedback) or int4 parameter changes through prepare_acco, paced at unequal
    speeds."""
    wire = {"comm_dtype": "int8", "gather_dtype": changes, "error_feedback": error_feedback}
    fast, slow = run_ranks(paced_loop, backend=None, wire=wire)
    exact = run_ranks(paced_loop, backend=None)[0]
    for epoch in range(2):
        used = sorted(i for r in (fast, slow) for e, *idx in r["seen"] if e == epoch for i in idx)
        assert used == list(range(37))
    assert all(torch.equal(a, b) for a, b in zip(fast["params"], slow["params"]))
    assert not all(torch.equal(a, b) for a, b in zip(fast["params"], exact["params"]))  # the wire was int8
    assert all(torch.isfinite(p).all() for p in fast["params"])


def dynamic_loop(rank: int, world_size: int) -> tuple[int, float]:
    set_seed(0)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
    model, optimizer = prepare_acco(accelerator, tiny_llama(), accumulation="dynamic", lr=1e-2,
                                    min_micro_batches=ACCUM)  # fmt: skip
    for i in range(3 * ACCUM):
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch(rank, i)).loss)
            optimizer.step()
    steps = optimizer.optimizer.step_count
    optimizer.optimizer.finalize()
    return steps, optimizer.optimizer.totals["micro_batches"]


def test_prepare_acco_in_dynamic_mode_steps_on_its_own() -> None:
    """The engine ends its steps itself (auto_step), not at Accelerate's windows: with at least 4 micro-batches
    per half, 12 micro-batches hold at most one step (Accelerate's windows of 4 would have made 3)."""
    results = run_ranks(dynamic_loop, backend=None)
    assert all(steps <= 1 for steps, _ in results)  # (ranks may be a round apart before finalize: timing decides)
    assert all(total == 3 * ACCUM for _, total in results)  # every micro-batch counted, the last ones in finalize


def save_copies(rank: int, world_size: int, directory: str) -> dict:
    """The copies of model parameters each rank makes during accelerator.save_state (new tensors of a parameter's
    size; its optimizer shard is written into shard-sized tensors)."""
    from .test_boundary import Sizes

    set_seed(0)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM)
    model, optimizer = prepare_acco(accelerator, tiny_llama(), lr=1e-2)
    for i in range(2 * ACCUM):
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch(rank, i)).loss)
            optimizer.step()
    engine = optimizer.optimizer
    sizes = {p.numel() for p in model.parameters()} - {engine.layout.shard_numel, engine.layout.padded_numel}
    with Sizes() as made:
        accelerator.save_state(directory)
    with engine.committed_parameters():
        committed = {n: p.detach().clone() for n, p in model.named_parameters()}
    copies = [op for op, n in made.made if n in sizes and "copy_" not in op]
    return {"copies": copies, "committed": committed}


def test_save_state_copies_the_model_on_the_writing_process_only(tmp_path: Path) -> None:
    """Only the main process writes the model file: the others make no copy of the model's parameters."""
    from safetensors.torch import load_file

    main, other = run_ranks(save_copies, backend=None, directory=str(tmp_path))
    assert main["copies"] and other["copies"] == []
    saved = load_file(tmp_path / "model.safetensors")
    assert all(torch.equal(saved[n], p) for n, p in main["committed"].items())  # the committed θ, not θ̃


def bn_loop(rank: int, world_size: int, acco: bool, broadcast: bool | None = None) -> dict:
    """BatchNorm statistics and a tower used in some steps only (dropin_script.Combined), in a hand-written loop."""
    from accelerate.utils import DistributedDataParallelKwargs

    from .scripts.dropin_script import Combined

    ddp_kwargs = {"find_unused_parameters": True} | ({} if broadcast is None else {"broadcast_buffers": broadcast})
    handlers = [DistributedDataParallelKwargs(**ddp_kwargs)]
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2, kwargs_handlers=handlers)
    torch.manual_seed(0)
    model = Combined()
    if acco:  # the changed lines
        kwargs = {} if broadcast is None else {"broadcast_buffers": broadcast}
        model, optimizer = prepare_acco(accelerator, model, lr=1e-2, weight_decay=0.1, schedule="sync", **kwargs)
    else:
        decay = [p for p in model.parameters() if p.ndim >= 2]
        rest = [p for p in model.parameters() if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(groups, lr=1e-2))
    g = torch.Generator().manual_seed(rank)
    for t in range(8):
        for _ in range(2):
            with accelerator.accumulate(model):
                x = torch.randn(4, 8, generator=g)
                use_b = torch.full((4,), float(t % 3 == 1))
                accelerator.backward(model(x, torch.tanh(x[:, 0]), use_b)["loss"])
                optimizer.step()
                optimizer.zero_grad()
    if acco:
        optimizer.optimizer.finalize()
    inner = accelerator.unwrap_model(model)
    return {"params": [p.detach().clone() for p in inner.parameters()],
            "buffers": [b.detach().clone() for b in inner.buffers()]}  # fmt: skip


@pytest.mark.parametrize("broadcast", [None, False], ids=["broadcast_unset", "broadcast_false"])
def test_prepare_acco_keeps_buffers_and_unused_parameters_as_ddp(broadcast: bool | None) -> None:
    ddp = run_ranks(bn_loop, backend=None, acco=False, broadcast=broadcast)
    ours = run_ranks(bn_loop, backend=None, acco=True, broadcast=broadcast)
    for r in range(2):
        assert rel(ours[r]["buffers"], ddp[r]["buffers"]) < 1e-5
        assert rel(ours[r]["params"], ddp[r]["params"]) < 1e-5


def _boundary_copy(rank: int, world_size: int, asked: bool | None) -> dict:
    """prepare_acco under FSDP inside 2 machines of 2: whether the engine keeps the pinned host copy of the
    boundary's shard, and what a save in the middle of a step (after the half boundary moved the model) does."""
    from accelerate.parallelism_config import ParallelismConfig
    from accelerate.utils import FullyShardedDataParallelPlugin

    from .fsdp_cpu import allow_fsdp_on_cpu

    allow_fsdp_on_cpu()
    set_seed(0)
    shape = ParallelismConfig(dp_replicate_size=2, dp_shard_size=world_size // 2)
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM, parallelism_config=shape,
                              fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=2))  # fmt: skip
    extra = {} if asked is None else {"boundary_copy": asked}
    model, optimizer = prepare_acco(accelerator, tiny_llama(), lr=1e-2, **extra)
    for i in range(2 * ACCUM - 1):  # one step, then past the next one's half boundary: the model has moved on
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch(accelerator.process_index, i)).loss)
            optimizer.step()
    engine = optimizer.optimizer
    try:
        engine.state_dict()
        mid_step = "saved"
    except RuntimeError as e:
        mid_step = str(e)
    engine.close()
    return {"copy": engine._boundary_copy, "mid_step": mid_step}


def test_under_fsdp_a_hand_written_loop_keeps_no_pinned_boundary_copy_unless_asked() -> None:
    """The pinned host copy of each GPU's shard at every step boundary (what a save in the middle of an acco step
    needs) is opt-in under FSDP inside machines (70B on 8 x 8: 32 GiB pinned a machine); without it such a save
    says what to do, on every rank; with ``boundary_copy=True`` it saves."""
    default = run_ranks(_boundary_copy, world_size=4, backend=None, asked=None)
    assert all(not r["copy"] and "boundary_copy=True" in r["mid_step"] for r in default), default
    asked = run_ranks(_boundary_copy, world_size=4, backend=None, asked=True)
    assert all(r["copy"] and r["mid_step"] == "saved" for r in asked), asked
