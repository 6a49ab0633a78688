"""ACCOTrainer with Accelerate's FSDP2 configuration (FSDP inside each machine, ACCO across machines) against
Trainer's HSDP on the same configuration: 4 gloo ranks as 2 machines x 2 (tests/scripts/trainer_script.py --hsdp
sets ``fsdp``, ``fsdp_config`` and ``parallelism_config`` as a user would; the runs differ in the two class names)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from .helpers import rel
from .test_trainer import flat, losses, train

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")
STEPS = 10


def hsdp(out: Path, acco: bool, **options) -> list[dict]:  # noqa: ANN003
    return train(out, acco=acco, world_size=4, hsdp=True, max_steps=options.pop("max_steps", STEPS), **options)


@pytest.fixture(scope="module")
def hsdp_run(tmp_path_factory) -> list[dict]:
    return hsdp(tmp_path_factory.mktemp("hsdp"), acco=False)


@pytest.fixture(scope="module")
def hsdp_sync_run(tmp_path_factory) -> list[dict]:
    return hsdp(tmp_path_factory.mktemp("hsdp_sync"), acco=True, extra={"acco_schedule": "sync"})


def _same_model_on_every_rank(result: list[dict]) -> None:
    for r in range(1, len(result)):  # the full parameters, gathered: the same on every rank
        assert torch.equal(flat(result[r]["params"]), flat(result[0]["params"]))


def test_sync_schedule_equals_trainer_hsdp(hsdp_run: list[dict], hsdp_sync_run: list[dict]) -> None:
    ours = hsdp_sync_run
    assert ours[0]["fsdp_sharded"] and ours[0]["engine_ranks"] == 2  # FSDP over a machine, the rounds across two
    assert losses(ours[0]) == pytest.approx(losses(hsdp_run[0]), rel=1e-5)
    norms = [[h["grad_norm"] for h in r["log_history"] if "loss" in h] for r in (ours[0], hsdp_run[0])]
    assert norms[0] == pytest.approx(norms[1], rel=1e-5)  # the global norm: both mesh dimensions
    assert rel(flat(ours[0]["params"]), flat(hsdp_run[0]["params"])) < 1e-5
    _same_model_on_every_rank(ours)


@pytest.mark.parametrize(
    "settings",
    [{"gradient_checkpointing": True}, {"bf16": True, "fsdp_reduce_fp32": True}, {"bf16": True}],
    ids=["checkpointing", "bf16", "bf16-reduced-in-bf16"],
)
def test_sync_schedule_equals_trainer_hsdp_with(tmp_path: Path, settings: dict) -> None:
    reduce_fp32 = {"fsdp_reduce_fp32": True} if settings.pop("fsdp_reduce_fp32", False) else {}
    theirs = hsdp(tmp_path / "hsdp", acco=False, extra=settings, **reduce_fp32)
    ours = hsdp(tmp_path / "ours", acco=True, extra={"acco_schedule": "sync", **settings}, **reduce_fp32)
    # bf16 with FSDP's policy reducing in fp32 (torchtitan's default): both runs sum every machine's fp32 sums in
    # fp32, so they agree to fp32 rounding. With Accelerate's default policy (reduce_dtype bf16) HSDP also
    # all-reduces across machines in bf16, where ACCO sums in fp32: one bf16 rounding of the machines' sum apart.
    tol = 2e-3 if settings.get("bf16") and not reduce_fp32 else 1e-5
    assert losses(ours[0]) == pytest.approx(losses(theirs[0]), rel=tol)
    assert rel(flat(ours[0]["params"]), flat(theirs[0]["params"])) < tol
    assert all(p.dtype == torch.float32 for p in ours[0]["params"].values())  # an fp32 model stays fp32
    if settings.get("bf16"):  # the policy each run trained with
        reduce = "torch.float32" if reduce_fp32 else "torch.bfloat16"
        assert ours[0]["fsdp_policy"] == theirs[0]["fsdp_policy"]
        assert f"reduce_dtype={reduce}" in ours[0]["fsdp_policy"]
    _same_model_on_every_rank(ours)


def test_a_bf16_model_keeps_bf16_shards_and_trains_as_without_fsdp(tmp_path: Path) -> None:
    """A model built in bf16 with bf16=True: FSDP's shards stay bf16 (Accelerate's own FSDP would upcast them to
    fp32 masters; the engine holds those), so bf16 sums and the bf16 wire are accepted as without FSDP, and the run
    follows ACCO without FSDP on the same bf16 model (the same algorithm; bf16 sums rounded in another order)."""
    bf16 = {"bf16": True, "acco_schedule": "sync", "acco_grad_dtype": "bf16"}
    ours = hsdp(tmp_path / "ours", acco=True, model_dtype="bfloat16", extra=bf16)
    plain = train(tmp_path / "plain", acco=True, world_size=4, max_steps=STEPS, model_dtype="bfloat16", extra=bf16)
    assert ours[0]["fsdp_sharded"] and all(p.dtype == torch.bfloat16 for p in ours[0]["params"].values())
    assert losses(ours[0]) == pytest.approx(losses(plain[0]), rel=1e-2)  # measured: 0.31 % (bf16 losses)
    assert losses(ours[0])[-1] < losses(ours[0])[0] - 0.05
    assert rel(flat(ours[0]["params"]).float(), flat(plain[0]["params"]).float()) < 5e-3  # measured: 7e-4
    _same_model_on_every_rank(ours)


def test_low_memory_loading_gives_every_rank_rank_0s_weights(tmp_path: Path, hsdp_sync_run: list[dict]) -> None:
    """FSDP's low-memory loading (``cpu_ram_efficient_loading``, as accelerate_configs/hsdp_acco.yaml sets it): only
    rank 0 holds the weights (the others' parameters are on the meta device, as from_pretrained leaves them there),
    Accelerate hands each rank its shard of rank 0's: the same run, bit for bit."""
    config = {"version": 2, "reshard_after_forward": True, "cpu_ram_efficient_loading": True}
    ours = hsdp(tmp_path, acco=True, weights_on_rank0_only=True,
                extra={"acco_schedule": "sync", "fsdp_config": config})  # fmt: skip
    assert losses(ours[0]) == losses(hsdp_sync_run[0])
    assert torch.equal(flat(ours[0]["params"]), flat(hsdp_sync_run[0]["params"]))


def test_acco_schedule_equals_acco_without_fsdp(tmp_path: Path) -> None:
    """The acco schedule over FSDP shards is the same algorithm as over whole parameters (which tests/test_trainer.py
    and tests/test_engine.py check against the single-process reference): the same 4 ranks' micro-batches, the same
    estimate and commit. With an evaluation every 3 steps, which reads the committed parameters."""
    plain = train(tmp_path / "plain", acco=True, world_size=4, max_steps=STEPS, eval_steps=3)
    ours = hsdp(tmp_path / "ours", acco=True, eval_steps=3)
    assert losses(ours[0]) == pytest.approx(losses(plain[0]), rel=1e-5)
    assert rel(flat(ours[0]["params"]), flat(plain[0]["params"])) < 1e-5
    evals = [[h["eval_loss"] for h in r["log_history"] if "eval_loss" in h] for r in (ours[0], plain[0])]
    assert len(evals[0]) == 4 and evals[0] == pytest.approx(evals[1], rel=1e-5)  # steps 3, 6, 9 and the last
    counted = [[h.get("acco_global_micro_batches") for h in r["log_history"]] for r in (ours[0], plain[0])]
    assert counted[0] == counted[1] and 16 in counted[0]  # every rank's micro-batches, not one per machine's
    _same_model_on_every_rank(ours)


def test_checkpoint_resume_is_bit_identical_and_save_model_loads_with_from_pretrained(tmp_path: Path) -> None:
    from transformers import LlamaForCausalLM

    straight = hsdp(tmp_path / "straight", acco=True, save_steps=5)
    checkpoint = tmp_path / "straight" / "checkpoint-5"
    for k in range(2):  # each FSDP shard index: its own folder of the engine's shards, one per machine
        assert sorted(p.name for p in (checkpoint / f"fsdp_shard{k}_of_2").iterdir()) == [
            "acco_optimizer_rank0_of_2.pt", "acco_optimizer_rank1_of_2.pt"]  # fmt: skip
    assert (checkpoint / "pytorch_model_fsdp.bin").is_file()  # Trainer's FSDP model file, which its resume loads
    resumed = hsdp(tmp_path / "resumed", acco=True, resume=checkpoint)
    for r in range(4):
        assert torch.equal(flat(resumed[r]["params"]), flat(straight[r]["params"]))
    assert losses(resumed[0])[-5:] == losses(straight[0])[-5:]
    final = LlamaForCausalLM.from_pretrained(tmp_path / "straight" / "final")
    assert all(torch.equal(p, straight[0]["params"][n]) for n, p in final.named_parameters())


def test_sharded_state_dict_checkpoints_resume_bit_identically(tmp_path: Path) -> None:
    """fsdp_state_dict_type SHARDED_STATE_DICT (what a 34B+ run checkpoints with: every rank writes its own part,
    nothing gathered on rank 0): Accelerate's DCP folder beside the engine's shards, and the resume is exact."""
    config = {"version": 2, "reshard_after_forward": True, "state_dict_type": "SHARDED_STATE_DICT"}
    straight = hsdp(tmp_path / "straight", acco=True, save_steps=5, extra={"fsdp_config": config})
    checkpoint = tmp_path / "straight" / "checkpoint-5"
    assert (checkpoint / "pytorch_model_fsdp_0").is_dir() and not (checkpoint / "pytorch_model_fsdp.bin").exists()
    resumed = hsdp(tmp_path / "resumed", acco=True, resume=checkpoint, extra={"fsdp_config": config})
    for r in range(4):
        assert torch.equal(flat(resumed[r]["params"]), flat(straight[r]["params"]))
    assert losses(resumed[0])[-5:] == losses(straight[0])[-5:]
    # the export the docs give for such a run: Accelerate merges the DCP folder into model.safetensors
    import subprocess
    import sys

    from safetensors.torch import load_file

    merge = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "merge-weights",
             str(checkpoint / "pytorch_model_fsdp_0"), str(tmp_path / "merged")]  # fmt: skip
    assert subprocess.run(merge, capture_output=True, timeout=120).returncode == 0
    merged = load_file(str(tmp_path / "merged" / "model.safetensors"))
    assert {k: v.shape for k, v in merged.items()} == {k: v.shape for k, v in straight[0]["params"].items()}


def test_a_plain_trainer_hsdp_checkpoint_resumes_under_acco_trainer_with_its_optimizer_state(tmp_path: Path) -> None:
    """Trainer's HSDP checkpoint-5 (FULL_STATE_DICT: optimizer.bin, the whole optimizer state by parameter name),
    resumed by ACCOTrainer with FSDP inside machines: each rank takes its FSDP shard's piece of Adam's moments, so
    ``sync`` goes on as Trainer's HSDP does (measured without the moments: parameters 3.6 % apart). Without FSDP
    inside machines it is refused; a step both trainers saved into one directory is refused too, and so is a plain
    SHARDED_STATE_DICT checkpoint (its optimizer state is a DCP folder), with what to do."""
    plain = hsdp(tmp_path / "plain", acco=False, save_steps=5)
    checkpoint = tmp_path / "plain" / "checkpoint-5"
    assert (checkpoint / "optimizer.bin").is_file() and not (checkpoint / "fsdp_shard0_of_2").exists()
    ours = hsdp(tmp_path / "ours", acco=True, resume=checkpoint, extra={"acco_schedule": "sync"})
    assert losses(ours[0]) == pytest.approx(losses(plain[0]), rel=1e-5)
    assert rel(flat(ours[0]["params"]), flat(plain[0]["params"])) < 1e-5
    _same_model_on_every_rank(ours)
    with pytest.raises(RuntimeError, match="is a plain Trainer FSDP checkpoint: ACCOTrainer resumes it with FSDP"):
        train(tmp_path / "zero1", acco=True, world_size=4, max_steps=STEPS, resume=checkpoint)
    (checkpoint / "fsdp_shard0_of_2").mkdir()  # as if an ACCO run had saved this step here as well
    with pytest.raises(RuntimeError, match="a plain Trainer optimizer.bin .a plain Trainer FSDP run and an ACCO run"):
        hsdp(tmp_path / "both", acco=True, resume=checkpoint)
    config = {"version": 2, "reshard_after_forward": True, "state_dict_type": "SHARDED_STATE_DICT"}
    hsdp(tmp_path / "sharded", acco=False, save_steps=2, max_steps=2, extra={"fsdp_config": config})
    assert (tmp_path / "sharded" / "checkpoint-2" / "optimizer_0").is_dir()
    with pytest.raises(RuntimeError, match=r"with SHARDED_STATE_DICT: its optimizer state \(optimizer_0\) is not"):
        hsdp(tmp_path / "from_sharded", acco=True, resume=tmp_path / "sharded" / "checkpoint-2")


def test_a_checkpoint_resumes_on_another_number_of_machines_not_another_fsdp_sharding(tmp_path: Path) -> None:
    two = hsdp(tmp_path / "two", acco=True, save_steps=5)
    checkpoint = tmp_path / "two" / "checkpoint-5"
    three = train(tmp_path / "three", acco=True, world_size=6, hsdp=True, machines=3, max_steps=STEPS,
                  resume=checkpoint)  # fmt: skip
    assert three[0]["engine_ranks"] == 3  # each FSDP shard's engine state re-sharded over 3 machines
    after = [h["loss"] for h in three[0]["log_history"] if "loss" in h and h["step"] > 5]
    assert len(after) == 5  # it goes on from the 2-machine state (not from scratch): where that run was
    assert after[0] == pytest.approx(losses(two[0])[5], rel=0.03) and after[0] < losses(two[0])[0] - 0.05
    with pytest.raises(RuntimeError, match="written with FSDP over 2 ranks per machine; this run has no FSDP"):
        train(tmp_path / "plain", acco=True, world_size=4, max_steps=STEPS, resume=checkpoint)
    train(tmp_path / "ddp", acco=False, world_size=2, max_steps=1, save_steps=1)  # plain Trainer's checkpoint
    with pytest.raises(RuntimeError, match="is a plain Trainer checkpoint: ACCOTrainer resumes those without FSDP"):
        hsdp(tmp_path / "from_ddp", acco=True, resume=tmp_path / "ddp" / "checkpoint-1")


@pytest.mark.parametrize(
    "settings",
    [{"acco_schedule": "dpu"}, {"acco_comm_dtype": "int8"}, {"acco_comm_dtype": "int8", "acco_gather_dtype": "int8"}],
    ids=["dpu", "int8-gradients", "int8-gradients-and-changes"],
)
def test_other_schedules_and_int8_between_machines_train_and_keep_the_ranks_identical(
    tmp_path: Path, settings: dict
) -> None:
    ours = hsdp(tmp_path, acco=True, extra=settings)
    got = losses(ours[0])
    assert all(torch.isfinite(torch.tensor(got))) and got[-1] < got[0] - 0.1
    _same_model_on_every_rank(ours)


def test_lora_over_fsdp_equals_trainer_hsdp(tmp_path: Path) -> None:
    theirs = hsdp(tmp_path / "hsdp", acco=False, lora=True)
    ours = hsdp(tmp_path / "ours", acco=True, lora=True, extra={"acco_schedule": "sync"})
    assert losses(ours[0]) == pytest.approx(losses(theirs[0]), rel=1e-5)
    assert rel(flat(ours[0]["params"]), flat(theirs[0]["params"])) < 1e-5
    lora_b = [p for n, p in ours[0]["params"].items() if "lora_B" in n]
    assert lora_b and all(p.abs().sum() > 0 for p in lora_b)


def _construct(tmp_path: Path, world_size: int, **settings) -> list[dict]:  # noqa: ANN003
    """ACCOTrainer's construction on every rank; each rank's error message, if it raised."""
    import json

    extra = json.dumps(settings)

    def build(rank: int, world: int, out: str) -> dict:
        from accelerate.parallelism_config import ParallelismConfig

        from hf_acco import ACCOConfig, ACCOTrainer

        from .fsdp_cpu import allow_fsdp_on_cpu
        from .models import tiny_llama
        from .scripts.trainer_script import make_dataset

        allow_fsdp_on_cpu()
        options = json.loads(extra)
        shape = options.pop("shape")
        try:
            args = ACCOConfig(output_dir=out, use_cpu=True, report_to=[], fsdp=True,
                              parallelism_config=ParallelismConfig(dp_replicate_size=shape[0], dp_shard_size=shape[1]),
                              **options)  # fmt: skip
            ACCOTrainer(model=tiny_llama(), args=args, train_dataset=make_dataset(8, 0))
        except ValueError as e:
            return {"error": str(e)}
        return {"error": None}

    from hf_acco.tools.multiprocess import run_ranks

    return run_ranks(build, world_size=world_size, backend=None, out=str(tmp_path), timeout=120)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"shape": [1, 2]}, "needs several machines"),
        ({"shape": [1, 2], "fsdp_config": {"version": 1}}, "runs inside FSDP2 only"),
        ({"shape": [2, 2], "fsdp_config": {"cpu_offload": True}}, "CPU offload is not supported"),
        ({"shape": [2, 2], "fsdp_config": {"activation_checkpointing": True}}, "gradient_checkpointing=True"),
        ({"shape": [2, 2], "acco_accumulation": "dynamic"}, "the ranks of a machine must compute the same"),
        ({"shape": [2, 2], "save_on_each_node": True}, "save_on_each_node=True with FSDP"),
    ],
)
def test_what_fsdp_mode_cannot_run_is_refused_at_construction(tmp_path: Path, settings: dict, message: str) -> None:
    import re

    results = _construct(tmp_path, settings["shape"][0] * settings["shape"][1], **settings)
    assert all(r["error"] is not None and re.search(message, r["error"]) for r in results), results


def test_an_accelerate_config_file_sets_the_same_mode(tmp_path: Path) -> None:
    """accelerate_configs/hsdp_acco.yaml (2 machines x 8 GPUs) launched as 2 x 2 CPU ranks on one machine: the
    FSDP plugin and parallelism config come from the launcher's environment, none from the training arguments."""
    import json
    import os

    from .helpers import ROOT, accelerate_launch

    from_args = hsdp(tmp_path / "args", acco=True)
    overrides = ("--num_machines", "1", "--num_processes", "4", "--machine_rank", "0", "--mixed_precision", "no",
                 "--parallelism_config_dp_shard_size", "2")  # fmt: skip
    accelerate_launch(
        ROOT / "tests/scripts/trainer_script.py", "--acco", "--fsdp_on_cpu", "--max_steps", str(STEPS),
        "--output_dir", str(tmp_path / "file"), config="accelerate_configs/hsdp_acco.yaml", launcher_args=overrides,
        env={"PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"},
    )  # fmt: skip
    history = json.loads((tmp_path / "file" / "log_history.json").read_text())
    launched = [h["loss"] for h in history if "loss" in h]
    assert launched == pytest.approx(losses(from_args[0]), rel=1e-6)
    assert (tmp_path / "file" / "final" / "model.safetensors").is_file()
    ranks = [json.loads((tmp_path / "file" / f"rank{r}_micro_batches.json").read_text()) for r in range(4)]
    assert all(r["fsdp_sharded"] and r["engine_ranks"] == 2 for r in ranks)  # FSDP in a machine, rounds across
