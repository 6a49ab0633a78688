"""Exact resume from per-rank shard files, re-sharding 2 -> 1, 1 -> 2 and 4 -> 2 -> 3 ranks, and what a bad load
says."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hf_acco import ACCOOptimizer
from hf_acco.engine.checkpoint import load_optimizer_state, save_optimizer_state, shard_filename
from hf_acco.tools.multiprocess import run_ranks

from .helpers import clones, rel
from .models import batch, decay_groups, mean_loss, tiny_llama

HP = {"lr": 1e-2, "betas": (0.9, 0.95), "weight_decay": 0.0}
GLOBAL_MICRO = 8  # micro-batches per optimizer step, all ranks together
VIRTUAL_RANKS = 2
PER_VIRTUAL = {VIRTUAL_RANKS: GLOBAL_MICRO // VIRTUAL_RANKS, 12: 2}  # 12 virtual ranks deal evenly to 1, 2, 3 or 4


def step_batches(rank: int, world_size: int, t: int, virtual: int = VIRTUAL_RANKS) -> list[dict]:
    """This rank's micro-batches of step t: the same global set whatever the world size (``virtual`` ranks'
    worth, dealt out to the real ones), halves kept."""
    per_virtual = PER_VIRTUAL[virtual]
    mine = [v for v in range(virtual) if v % world_size == rank]
    first = [batch(v, t * per_virtual + i) for v in mine for i in range(per_virtual // 2)]
    second = [batch(v, t * per_virtual + i) for v in mine for i in range(per_virtual // 2, per_virtual)]
    return first + second


def build(
    world_size: int,
    schedule: str,
    seed: int = 0,
    virtual: int = VIRTUAL_RANKS,
    fused: bool | None = None,
    comm_dtype: str = "auto",
    gather_dtype: str = "auto",
    error_feedback: bool = False,
    model: torch.nn.Module | None = None,
) -> tuple[torch.nn.Module, ACCOOptimizer]:
    model = tiny_llama(seed=seed) if model is None else model
    micro_batches = PER_VIRTUAL[virtual] * virtual // world_size
    opt = ACCOOptimizer(
        decay_groups(model, 0.1),
        schedule=schedule,
        micro_batches=micro_batches,
        max_grad_norm=1.0,
        fused=fused,
        comm_dtype=comm_dtype,
        gather_dtype=gather_dtype,
        error_feedback=error_feedback,
        **HP,
    )
    return model, opt


def run_steps(model, opt, rank: int, world_size: int, start: int, stop: int, virtual: int = VIRTUAL_RANKS) -> None:
    for t in range(start, stop):
        for b in step_batches(rank, world_size, t, virtual):
            mean_loss(model, b)[0].backward()
            opt.after_backward()
        assert opt.ready_to_step()
        opt.step()


def snapshot(model, opt) -> dict:
    held = clones(model)  # what the model computes with (the estimate)
    with opt.committed_parameters():
        committed = clones(model)
    return {"held": held, "committed": committed}


def train(
    rank: int,
    world_size: int,
    schedule: str,
    start: int,
    stop: int,
    load: str | None,
    save: str | None,
    save_after_micro_batches: int = 0,
    virtual: int = VIRTUAL_RANKS,
    fused: bool | None = None,
    comm_dtype: str = "auto",
    gather_dtype: str = "auto",
    error_feedback: bool = False,
):
    seed = 0 if load is None else 123  # a resumed run starts from other weights: everything must come from the files
    wire = {"comm_dtype": comm_dtype, "gather_dtype": gather_dtype, "error_feedback": error_feedback}
    model, opt = build(world_size, schedule, seed=seed, virtual=virtual, fused=fused, **wire)
    if load is not None:
        load_optimizer_state(opt, load)
    run_steps(model, opt, rank, world_size, start, stop, virtual)
    if save is not None and save_after_micro_batches:  # a pre-emption checkpoint in the middle of step `stop`
        for b in step_batches(rank, world_size, stop)[:save_after_micro_batches]:
            mean_loss(model, b)[0].backward()
            opt.after_backward()
    if save is not None:
        save_optimizer_state(opt, save)
    out = snapshot(model, opt)
    opt.close()
    return out


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


def _resumes_exactly(tmp_path: Path, into_step: int = 0, **kw) -> list[dict]:
    """6 steps straight against 3, a checkpoint (``into_step`` micro-batches into step 4), and 3 more from it:
    every rank's committed and held parameters equal to the bit. Returns the straight run."""
    straight = run_ranks(train, start=0, stop=6, load=None, save=None, **kw)
    run_ranks(train, start=0, stop=3, load=None, save=str(tmp_path), save_after_micro_batches=into_step, **kw)
    resumed = run_ranks(train, start=3, stop=6, load=str(tmp_path), save=None, **kw)
    for r in range(2):
        assert _equal(resumed[r]["committed"], straight[r]["committed"])
        assert _equal(resumed[r]["held"], straight[r]["held"])  # the in-flight estimate too
    return straight


@pytest.mark.parametrize("schedule", ["acco", "dpu", "sync"])
def test_resume_is_bit_identical(tmp_path: Path, schedule: str) -> None:
    straight = run_ranks(train, schedule=schedule, start=0, stop=8, load=None, save=None)
    run_ranks(train, schedule=schedule, start=0, stop=4, load=None, save=str(tmp_path))
    resumed = run_ranks(train, schedule=schedule, start=4, stop=8, load=str(tmp_path), save=None)
    for r in range(2):
        assert _equal(resumed[r]["committed"], straight[r]["committed"])
        assert _equal(resumed[r]["held"], straight[r]["held"])  # the in-flight estimate too
    assert not _equal(straight[0]["committed"], [p.detach() for p in tiny_llama().parameters()])


@pytest.mark.parametrize("into_step", [0, 3])
def test_fused_adamw_resume_is_bit_identical(tmp_path: Path, into_step: int) -> None:
    """Trainer's default optimizer (optim="adamw_torch_fused" is AdamW(fused=True)): its state placed by torch's own
    policy on load, the estimate computed by the fused kernel the commit runs."""
    straight = _resumes_exactly(tmp_path, into_step, schedule="acco", fused=True)
    unfused = run_ranks(train, start=0, stop=6, load=None, save=None, schedule="acco")
    assert rel(unfused[0]["committed"], straight[0]["committed"]) < 1e-5  # the same algorithm, another kernel


@pytest.mark.parametrize("schedule", ["acco", "dpu"])
@pytest.mark.parametrize("into_step", [1, 3])  # of 4 micro-batches per rank: in half A, in half B
def test_checkpoint_from_the_middle_of_a_step_resumes_exactly(tmp_path: Path, schedule: str, into_step: int) -> None:
    _resumes_exactly(tmp_path, into_step, schedule=schedule)


@pytest.mark.parametrize(
    ("schedule", "into_step", "comm_dtype", "gather_dtype", "error_feedback"),
    [
        ("acco", 0, "int8", "auto", False),
        ("acco", 3, "int8", "int8", True),
        ("sync", 0, "int8", "int8", True),
        ("dpu", 1, "auto", "int8", False),
        ("acco", 3, "int8", "int4", False),
    ],
)
def test_int8_on_the_wire_resumes_exactly(
    tmp_path: Path, schedule: str, into_step: int, comm_dtype: str, gather_dtype: str, error_feedback: bool
) -> None:
    """int8 gradients, int8 or int4 parameter changes (a pending commit round's output rebuilt on load from the same
    base, the boundary's model, as the round built it) and error feedback (its residual saved and restored; in the
    middle of a step, the boundary's: only commit rounds change it)."""
    wire = {"comm_dtype": comm_dtype, "gather_dtype": gather_dtype, "error_feedback": error_feedback}
    straight = _resumes_exactly(tmp_path, into_step, schedule=schedule, **wire)
    exact = run_ranks(train, start=0, stop=6, load=None, save=None, schedule=schedule)
    assert not _equal(exact[0]["committed"], straight[0]["committed"])  # the quantisation is in the run
    if error_feedback:
        saved = torch.load(next(tmp_path.glob("*rank0*")), weights_only=True)
        assert saved["int8_residual"].abs().max() > 0


@pytest.mark.parametrize(("before", "after"), [(2, 1), (1, 2)])
def test_reshard_continues_the_trajectory(tmp_path: Path, before: int, after: int) -> None:
    straight = run_ranks(train, world_size=before, schedule="acco", start=0, stop=6, load=None, save=None)
    run_ranks(train, world_size=before, schedule="acco", start=0, stop=3, load=None, save=str(tmp_path))
    resumed = run_ranks(train, world_size=after, schedule="acco", start=3, stop=6, load=str(tmp_path), save=None)
    assert rel(resumed[0]["committed"], straight[0]["committed"]) < 1e-5
    assert rel(resumed[0]["held"], straight[0]["held"]) < 1e-5
    moved = rel(straight[0]["committed"], [p.detach() for p in tiny_llama().parameters()])
    assert moved > 1e-2


def test_reshard_4_then_2_then_3_ranks_continues_the_trajectory(tmp_path: Path) -> None:
    """An odd world size pads the shards; 12 virtual ranks of 2 micro-batches each (one per half) are dealt to 4,
    2 and 3 real ones: the same 24 micro-batches per step in every run."""
    kw = {"schedule": "acco", "virtual": 12, "save": None, "load": None}
    straight = run_ranks(train, world_size=4, start=0, stop=6, **kw)
    run_ranks(train, world_size=4, start=0, stop=2, **{**kw, "save": str(tmp_path / "a")})
    run_ranks(train, world_size=2, start=2, stop=4, **{**kw, "load": str(tmp_path / "a"), "save": str(tmp_path / "b")})
    resumed = run_ranks(train, world_size=3, start=4, stop=6, **{**kw, "load": str(tmp_path / "b")})
    for r in resumed:
        assert rel(r["committed"], straight[0]["committed"]) < 1e-5
        assert _equal(r["committed"], resumed[0]["committed"])


def load_into(rank: int, world_size: int, directory: str, model_kind: str) -> str:
    """Try to resume; return the error message (or "loaded"), checking that a failed load changed nothing."""
    if model_kind == "other-shape":
        from transformers import LlamaConfig, LlamaForCausalLM

        torch.manual_seed(0)
        config = LlamaConfig(
            vocab_size=80,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=2,
            max_position_embeddings=16,
        )
        model = LlamaForCausalLM(config)
    else:
        model = tiny_llama()
        if model_kind == "frozen-embeddings":
            model.get_input_embeddings().weight.requires_grad_(False)
    opt = ACCOOptimizer(decay_groups(model, 0.1), micro_batches=4, **HP)
    master_before = opt.shard.master.clone()
    params_before = clones(model)
    try:
        load_optimizer_state(opt, directory)
        return "loaded"
    except (ValueError, FileNotFoundError, RuntimeError) as e:
        assert torch.equal(opt.shard.master, master_before), "a failed load changed the optimizer"
        assert _equal([p.detach() for p in model.parameters()], params_before), "a failed load changed the model"
        return f"{type(e).__name__}: {e}"
    finally:
        opt.close()


@pytest.mark.parametrize(
    ("damage", "model_kind", "messages"),
    [
        (None, "other-shape", ["does not match this model's trainable parameters"] * 2),
        (None, "frozen-embeddings", ["does not match this model's trainable parameters"] * 2),
        # rank 0 has its own shard (as on a per-node checkpoint): the rank that lacks one says which
        ("missing", "same", ["Another rank could not load", "lacks the optimizer shards of ranks [1]"]),
        ("tampered", "same", ["Another rank could not load", "is damaged"]),
        ("empty-dir", "same", ["No ACCO optimizer shards"] * 2),
        (None, "same", ["loaded", "loaded"]),
    ],
)
def test_bad_checkpoint_gives_a_clear_error_and_changes_nothing(
    tmp_path: Path, damage: str | None, model_kind: str, messages: list[str]
) -> None:
    run_ranks(train, schedule="acco", start=0, stop=1, load=None, save=str(tmp_path))
    if damage == "missing":
        (tmp_path / shard_filename(1, 2)).unlink()
    elif damage == "tampered":
        path = tmp_path / shard_filename(1, 2)
        path.write_bytes(path.read_bytes()[:-100])
    elif damage == "empty-dir":
        for f in tmp_path.iterdir():
            f.unlink()
    got = run_ranks(load_into, directory=str(tmp_path), model_kind=model_kind, timeout=60)
    for text, expected in zip(got, messages):
        assert expected in text, got


def test_checkpoint_files_load_with_weights_only(tmp_path: Path) -> None:
    run_ranks(train, schedule="acco", start=0, stop=2, load=None, save=str(tmp_path))
    for r in range(2):
        state = torch.load(tmp_path / shard_filename(r, 2), weights_only=True)
        assert state["rank"] == r and state["pending_commit"] is True
    assert not [f for f in tmp_path.iterdir() if ".tmp" in f.name]


def reshard_made(rank: int, world_size: int, directory: str) -> dict:
    from hf_acco.engine.checkpoint import _read_shards
    from hf_acco.engine.shard_state import reshard

    from .test_boundary import Sizes

    model, opt = build(world_size, "acco", seed=123, virtual=12)
    states = _read_shards(Path(directory), rank, world_size, opt.layout.chunk)  # memory-mapped
    with Sizes() as made:
        state = reshard(states, opt.layout, rank)
    opt.load_state_dict(state)
    vectors = 2 + len(state["optim_state"])  # master, model, the moments
    real = sum(b - a for _, a, b in opt.layout.shard_param_pieces(rank))
    out = {"made": made.made, "shard": opt.layout.shard_numel, "numel": opt.layout.numel, "real": real}
    out["vectors"] = vectors
    opt.close()
    return out


def test_a_resharding_resume_materialises_only_this_ranks_ranges(tmp_path: Path) -> None:
    """4 -> 2 ranks: each rank reads its new ranges out of the four memory-mapped shards; no full-size vector (a
    7B model's master, model and moments would be ~100 GB per rank) is built."""
    run_ranks(train, world_size=4, schedule="acco", start=0, stop=2, load=None, save=str(tmp_path), virtual=12)
    for r in run_ranks(reshard_made, world_size=2, directory=str(tmp_path)):
        assert max(n for _, n in r["made"]) <= r["shard"] < r["numel"]
        copied = sum(n for op, n in r["made"] if "copy_" in op)
        assert copied == r["vectors"] * r["real"]
