"""torch's optimizer state dict (plain Trainer's optimizer.pt) to and from the engine's shards: exact both ways, at 1,
2 and 3 ranks, and what a state of another model or optimizer says."""

from __future__ import annotations

import pytest
import torch

from hf_acco import ACCOOptimizer
from hf_acco.engine.checkpoint import load_optimizer_state, save_optimizer_state
from hf_acco.engine.torch_format import (
    optimizer_keys,
    scheduler_with_empty_groups,
    shard_from_torch_state,
    torch_state_from_shards,
)
from hf_acco.tools.checkpoint_cli import main as checkpoint_cli
from hf_acco.tools.multiprocess import run_ranks

from .models import batch, decay_groups, mean_loss, tiny_llama

HP = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-7}
FROZEN_UNTIL_LAST = "model.norm.weight"  # no gradient in the first steps: torch keeps no state for it until then


def torch_run(steps: int, skip_last: bool = False) -> tuple[torch.nn.Module, dict]:
    """A tiny Llama trained ``steps`` steps by torch's AdamW over Trainer's two groups; returns the model and the
    optimizer's state dict. ``skip_last``: one parameter gets no gradient in any step (never stepped)."""
    model = tiny_llama(seed=0)
    opt = torch.optim.AdamW(decay_groups(model, 0.1), **HP)
    for t in range(steps):
        loss = mean_loss(model, batch(0, t))[0]
        loss.backward()
        if skip_last:
            dict(model.named_parameters())[FROZEN_UNTIL_LAST].grad = None
        opt.step()
        opt.zero_grad()
    return model, opt.state_dict()


def import_and_save(rank: int, world_size: int, saved: dict, weights: dict) -> dict:
    model = tiny_llama(seed=1)  # other weights: the engine's master must come from the model as loaded
    model.load_state_dict(weights)
    opt = ACCOOptimizer(decay_groups(model, 0.1), micro_batches=2, **HP)
    opt.load_state_dict(shard_from_torch_state(opt.state_dict(), opt.layout, rank, saved, step_count=3))
    state = opt.state_dict()
    opt.close()
    return state


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_a_torch_optimizer_state_goes_into_the_shards_and_back_unchanged(world_size: int) -> None:
    model, saved = torch_run(3, skip_last=True)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    shards = run_ranks(import_and_save, world_size=world_size, saved=saved, weights=weights)
    assert all(s["step_count"] == 3 for s in shards)
    back = torch_state_from_shards(shards)
    (never,) = set(back["state"]) - set(saved["state"])  # never stepped: none in torch's, zeros and step 0 in ours
    assert all(not v.any() for v in back["state"][never].values())  # (torch's first step from them: the same)
    for n, values in saved["state"].items():
        assert back["state"][n].keys() == values.keys()
        for key, value in values.items():
            assert torch.equal(back["state"][n][key], value), (n, key)
            assert back["state"][n][key].dtype == value.dtype
    for ours, theirs in zip(back["param_groups"], saved["param_groups"]):
        assert ours["params"] == theirs["params"]
        for key in ("lr", "betas", "eps", "weight_decay"):  # (torch fills in its defaults at load)
            assert ours[key] == theirs[key], key
    master = torch.cat([s["master"] for s in shards]) if world_size == 1 else None
    if master is not None:  # the committed parameters are the model's
        flat = torch.cat([p.detach().reshape(-1) for g in decay_groups(model, 0.1) for p in g["params"]])
        assert torch.equal(master[: flat.numel()], flat)


def continue_run(rank: int, world_size: int, saved: dict | None, weights: dict, steps: int) -> dict:
    model = tiny_llama(seed=1)
    model.load_state_dict(weights)
    opt = ACCOOptimizer(decay_groups(model, 0.1), schedule="sync", micro_batches=2, **HP)
    if saved is not None:  # else Adam starts afresh from these weights
        opt.load_state_dict(shard_from_torch_state(opt.state_dict(), opt.layout, rank, saved, step_count=3))
    for t in range(3, 3 + steps):
        for half in (0, 1):  # the step's two micro-batches, averaged: torch's batch(0, t) row by row, halved
            mean_loss(model, {k: v[half : half + 1] for k, v in batch(0, t).items()})[0].backward()
            opt.after_backward()
        opt.step()
    out = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt.close()
    return out


def test_the_engine_continues_torch_adamw_from_its_state() -> None:
    """One rank, sync: the engine's AdamW from torch's state takes the same steps as torch's AdamW going on."""
    model, saved = torch_run(3)
    weights = {k: v.clone() for k, v in model.state_dict().items()}
    (ours,) = run_ranks(continue_run, world_size=1, saved=saved, weights=weights, steps=2)
    (afresh,) = run_ranks(continue_run, world_size=1, saved=None, weights=weights, steps=2)
    opt = torch.optim.AdamW(decay_groups(model, 0.1), **HP)
    opt.load_state_dict(saved)
    for t in range(3, 5):
        for half in (0, 1):
            (mean_loss(model, {k: v[half : half + 1] for k, v in batch(0, t).items()})[0] / 2).backward()
        opt.step()
        opt.zero_grad()
    for n, p in model.named_parameters():
        torch.testing.assert_close(ours[n], p.detach(), rtol=1e-6, atol=1e-7)
    # the state is what made them equal: Adam started afresh from the same weights takes other steps
    assert max((afresh[n] - p.detach()).abs().max().item() for n, p in model.named_parameters()) > 1e-3


def check_refused(rank: int, world_size: int, saved: dict, **settings) -> str:
    model = tiny_llama(seed=0)
    opt = ACCOOptimizer(decay_groups(model, 0.1), micro_batches=2, **(settings or HP))
    try:
        keys = optimizer_keys(opt.shard.inner, opt.shard.defaults)
        shard_from_torch_state(opt.state_dict(), opt.layout, rank, saved, step_count=1, expected_keys=keys)
    except ValueError as e:
        return str(e)
    finally:
        opt.close()
    return ""


def test_the_per_element_keys_of_an_optimizer_and_a_state_of_another_one_refused() -> None:
    """An engine of another optimizer (SGD keeps no state before its first step) is told from Adam's state."""
    w = torch.nn.Parameter(torch.ones(3))
    adam = ({"exp_avg", "exp_avg_sq"}, {"step"})
    assert optimizer_keys(torch.optim.AdamW([w], lr=0.1), {}) == adam
    amsgrad = optimizer_keys(torch.optim.AdamW([{"params": [w], "amsgrad": True}], lr=0.1), {})
    assert amsgrad == ({"exp_avg", "exp_avg_sq", "max_exp_avg_sq"}, {"step"})
    assert optimizer_keys(torch.optim.SGD([w], lr=0.1, momentum=0.9), {}) == ({"momentum_buffer"}, set())
    nadam = optimizer_keys(torch.optim.NAdam([w], lr=0.1), {})
    assert nadam[0] == adam[0] and nadam[1] == {"step", "mu_product"}  # Adam's moments, one more scalar
    before = torch.random.get_rng_state()
    optimizer_keys(torch.optim.AdamW([w], lr=0.1), {})
    assert torch.equal(torch.random.get_rng_state(), before)
    _, saved = torch_run(1)
    said = run_ranks(check_refused, world_size=1, saved=saved, optimizer_cls=torch.optim.SGD, momentum=0.9)[0]
    assert "keeps ['exp_avg', 'exp_avg_sq'] per element and ['step'] per parameter, this run's optimizer" in said
    said = run_ranks(check_refused, world_size=1, saved=saved, optimizer_cls=torch.optim.NAdam, lr=0.1)[0]
    assert "this run's optimizer ['exp_avg', 'exp_avg_sq'] and ['mu_product', 'step']" in said


def test_a_state_of_another_model_or_optimizer_is_refused_with_what_differs() -> None:
    model, saved = torch_run(1)
    one_group = {"state": saved["state"], "param_groups": [
        {**saved["param_groups"][0], "params": saved["param_groups"][0]["params"] + saved["param_groups"][1]["params"]}
    ]}  # fmt: skip
    sgd_model = tiny_llama(seed=0)
    sgd = torch.optim.SGD(decay_groups(sgd_model, 0.1), lr=0.1, momentum=0.9)
    mean_loss(sgd_model, batch(0, 0))[0].backward()
    sgd.step()
    said = run_ranks(check_refused, world_size=1, saved=one_group)[0]
    assert "parameter groups of" in said and "trainable parameters" in said
    said = run_ranks(check_refused, world_size=1, saved=sgd.state_dict())[0]
    assert "momentum_buffer" in said and "optim" in said
    said = run_ranks(check_refused, world_size=1, saved={"weights": 1})[0]
    assert "Not a torch optimizer state dict" in said
    square = next(n for n, v in saved["state"].items() if v["exp_avg"].dim() == 2 and v["exp_avg"].shape[0] > 1)
    transposed = {**saved, "state": {**saved["state"], square: {
        **saved["state"][square], "exp_avg": saved["state"][square]["exp_avg"].reshape(1, -1)}}}  # fmt: skip
    said = run_ranks(check_refused, world_size=1, saved=transposed)[0]
    assert "'exp_avg' of shape (1," in said and "another model" in said


def test_a_scheduler_of_an_engine_without_its_empty_group_loads_into_one_with_it() -> None:
    """hf_acco 0.1.0's ACCOTrainer kept no empty group (LoRA: no adapter weight without decay), nor its scheduler;
    Trainer's optimizer has both groups, and now the engine too."""
    from transformers import get_cosine_schedule_with_warmup

    def scheduler(groups: list[dict]) -> torch.optim.lr_scheduler.LRScheduler:
        opt = torch.optim.AdamW(groups, lr=1e-3)
        sched = get_cosine_schedule_with_warmup(opt, 2, 10)
        for _ in range(3):
            opt.step()
            sched.step()
        return sched

    w = torch.nn.Parameter(torch.ones(2))
    both = scheduler([{"params": [w], "weight_decay": 0.1}, {"params": [], "weight_decay": 0.0}]).state_dict()
    old = scheduler([{"params": [w], "weight_decay": 0.1}]).state_dict()
    assert scheduler_with_empty_groups(old, [1, 0]) == both
    assert scheduler_with_empty_groups(both, [1, 0]) == both  # an entry per group already: unchanged


def old_and_new(rank: int, world_size: int, directory: str) -> dict:
    """A run of hf_acco 0.1.0's ACCOTrainer where only norm weights train (Trainer's decay group empty, left out of
    the engine), saved; then an engine given both of Trainer's groups, as ACCOTrainer now does, loads it."""

    def model_and_groups() -> tuple[torch.nn.Module, list[dict]]:
        model = tiny_llama(seed=0)
        for p in model.parameters():
            p.requires_grad_(p.ndim < 2)  # norms only: nothing in the decay group
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        return model, [  # Trainer's two groups, with their names, as ACCOTrainer gives them
            {"params": [], "param_names": [], "weight_decay": 0.1},
            {"params": [p for _, p in named], "param_names": [n for n, _ in named], "weight_decay": 0.0},
        ]

    model, groups = model_and_groups()
    old = ACCOOptimizer([g for g in groups if g["params"]], micro_batches=2, lr=3e-3)  # as 0.1.0 built it
    for t in range(2):
        for half in (0, 1):
            mean_loss(model, batch(rank, 2 * t + half))[0].backward()
            old.after_backward()
        old.step()
    path = save_optimizer_state(old, directory)
    state = torch.load(path, weights_only=True)
    state.pop("empty_groups_kept")  # 0.1.0 wrote no such key
    torch.save(state, path)
    saved = old.state_dict()
    old.close()
    model, groups = model_and_groups()
    new = ACCOOptimizer(groups, micro_batches=2, lr=1e-1)  # Trainer's two groups, the first one empty
    load_optimizer_state(new, directory)
    loaded = new.state_dict()
    new.close()
    return {"saved": saved, "loaded": loaded}


def test_a_shard_of_hf_acco_0_1_0_without_trainers_empty_group_loads_into_an_engine_with_it(tmp_path) -> None:
    for result in run_ranks(old_and_new, world_size=2, directory=str(tmp_path)):
        saved, loaded = result["saved"], result["loaded"]
        assert len(saved["hparams"]) == 1 and len(loaded["hparams"]) == 2
        assert loaded["hparams"][1]["lr"] == saved["hparams"][0]["lr"]  # the saved group's settings, renumbered
        assert set(loaded["layout"]["groups"]) == {1}
        assert torch.equal(loaded["master"], saved["master"])
        for key, value in saved["optim_state"].items():
            assert torch.equal(loaded["optim_state"][key], value)
    with pytest.raises(SystemExit):  # to-trainer cannot tell where the empty group was: it says what to do
        checkpoint_cli(["to-trainer", str(tmp_path)])


def test_a_full_state_by_name_becomes_the_state_of_this_ranks_pieces() -> None:
    """Trainer's FSDP optimizer.bin (whole tensors by parameter name) as the numbered state of one FSDP shard's
    pieces: each per-element tensor cut where torch.chunk puts the shard (uneven and empty chunks too), scalars
    kept, the groups renumbered in this run's order; other groups and another whole shape refused."""
    from hf_acco.engine.torch_format import local_state_from_full
    from hf_acco.integrations.fsdp import chunk_slice

    for size in range(0, 12):
        for parts in (1, 2, 3, 4, 8):
            chunks = torch.chunk(torch.arange(size), parts) if size else ()
            for index in range(parts):
                got = torch.arange(size)[chunk_slice(size, parts, index)]
                want = chunks[index] if index < len(chunks) else torch.arange(0)
                assert torch.equal(got, want), (size, parts, index)
    whole = {"w": torch.arange(15.0).reshape(5, 3), "b": torch.arange(3.0)}
    saved = {"state": {n: {"step": torch.tensor(4.0), "exp_avg": t, "exp_avg_sq": t * 2} for n, t in whole.items()},
             "param_groups": [{"lr": 0.1, "params": ["w"]}, {"lr": 0.2, "params": ["b"]}]}  # fmt: skip
    pieces = {"w": (chunk_slice(5, 2, 1), slice(0, 3)), "b": (chunk_slice(3, 4, 3),)}  # rows 3-4; an empty chunk
    shapes = {"w": (5, 3), "b": (3,)}
    local = local_state_from_full(saved, [["w"], ["b"]], pieces, shapes)
    assert torch.equal(local["state"][0]["exp_avg"], whole["w"][3:5]) and local["state"][1]["exp_avg"].numel() == 0
    assert float(local["state"][0]["step"]) == 4.0 and [g["params"] for g in local["param_groups"]] == [[0], [1]]
    assert [g["lr"] for g in local["param_groups"]] == [0.1, 0.2]
    with pytest.raises(ValueError, match="groups hold other parameters"):
        local_state_from_full(saved, [["b"], ["w"]], pieces, shapes)
    with pytest.raises(ValueError, match=r"of shape \(5, 3\), the parameter is \(6, 3\)"):
        local_state_from_full(saved, [["w"], ["b"]], pieces, {**shapes, "w": (6, 3)})


def test_an_empty_fsdp_piece_still_has_its_per_element_state() -> None:
    """A rank whose FSDP pieces are all empty (a parameter smaller than the machine's ranks) still tells Adam's
    per-element keys from its scalars, as the other ranks do (they must agree, or the import is refused there only)."""
    from hf_acco.comm.sharding import FlatLayout
    from hf_acco.engine.torch_format import _split_keys

    layout = FlatLayout([torch.empty(0, 3)], ["head"], [0], 1)
    state = {0: {"step": torch.tensor(2.0), "exp_avg": torch.empty(0, 3), "exp_avg_sq": torch.empty(0, 3)}}
    assert _split_keys(layout, state, {0: 0}) == ({"exp_avg", "exp_avg_sq"}, {"step"})
