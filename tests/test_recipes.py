"""The recipes: Alpaca prompts and labels, --help, and end-to-end runs through `accelerate launch`."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from hf_acco.tasks.alpaca import (
    PROMPT_NO_INPUT,
    PROMPT_WITH_INPUT,
    build_word_tokenizer,
    check_records,
    format_prompt,
    generated_alpaca,
    load_records,
    tokenize_example,
)

from .helpers import accelerate_launch, load_script

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT.parent / "shared" / "data"
RECORD = {"instruction": "Reverse the order of these words.", "input": "apple river", "output": "river apple"}
NO_INPUT = {"instruction": "Name a color.", "input": "", "output": "red"}


def _tokenizer():
    return build_word_tokenizer([format_prompt(r) + " " + r["output"] for r in (RECORD, NO_INPUT)])


def test_prompt_template_with_and_without_input() -> None:
    assert format_prompt(RECORD) == PROMPT_WITH_INPUT.format(instruction=RECORD["instruction"], input="apple river")
    assert "### Input:" in format_prompt(RECORD)
    assert format_prompt(NO_INPUT) == PROMPT_NO_INPUT.format(instruction="Name a color.")
    assert "### Input:" not in format_prompt(NO_INPUT)
    assert format_prompt(NO_INPUT).startswith("Below is an instruction that describes a task. Write a response")


@pytest.mark.parametrize("record", [RECORD, NO_INPUT], ids=["with-input", "without-input"])
def test_only_the_response_and_its_eos_are_learned(record: dict) -> None:
    tok = _tokenizer()
    example = tokenize_example(record, tok, max_length=512)
    prompt = tok(format_prompt(record), add_special_tokens=False)["input_ids"]
    response = tok(record["output"], add_special_tokens=False)["input_ids"]
    assert example["input_ids"] == prompt + response + [tok.eos_token_id]
    assert example["labels"] == [-100] * len(prompt) + response + [tok.eos_token_id]


def test_truncation_keeps_the_end_of_sequence_token() -> None:
    tok = _tokenizer()
    full = tokenize_example(RECORD, tok, max_length=512)
    cut = tokenize_example(RECORD, tok, max_length=len(full["input_ids"]) - 1)
    assert len(cut["input_ids"]) == len(full["input_ids"]) - 1
    assert cut["input_ids"][-1] == cut["labels"][-1] == tok.eos_token_id
    assert cut["input_ids"][:-1] == full["input_ids"][: len(cut["input_ids"]) - 1]


def test_generated_set_answers_are_right() -> None:
    records = generated_alpaca(500, seed=1)
    for r in records:
        words = r["input"].split()
        if r["instruction"].startswith("Reverse"):
            assert r["output"].split() == words[::-1]
        elif r["instruction"].startswith("Sort"):
            assert r["output"].split() == sorted(words, key=int)
        elif r["instruction"].startswith("What is the sum"):
            assert int(r["output"]) == int(words[0]) + int(words[1])
        elif r["instruction"].startswith("Repeat"):
            assert r["output"].split() == words * 3
        else:
            assert r["output"] == min(words)
    assert generated_alpaca(50, seed=1) == records[:50]  # deterministic


def test_bad_datasets_are_explained(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_records(tmp_path / "nope.json")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "x", "output": "y"}) + "\n")
    with pytest.raises(ValueError, match=r"example 0 lacks \['instruction'\]"):
        load_records(bad)
    with pytest.raises(ValueError, match="holds no example"):
        check_records([], "empty.json")


@pytest.mark.skipif(not (DATA / "alpaca").is_dir(), reason="../shared/data/alpaca is absent")
def test_the_shipped_alpaca_sample_loads() -> None:
    records = load_records(DATA / "alpaca" / "alpaca_data_first200.json")
    assert len(records) == 200 and records[0]["instruction"] == "Give three tips for staying healthy."


@pytest.mark.parametrize("recipe", sorted((ROOT / "recipes").glob("*.py")), ids=lambda p: p.name)
def test_every_recipe_has_a_working_help(recipe: Path) -> None:
    done = subprocess.run([sys.executable, str(recipe), "--help"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "usage" in done.stdout.lower()


@pytest.mark.parametrize("recipe", ["alpaca_finetune.py", "pretrain_clm.py"])
def test_the_training_recipes_show_their_defaults_and_refuse_a_schedule_method_would_override(
    recipe: str, capsys: pytest.CaptureFixture
) -> None:
    """Their own training defaults come before the command line: --help lists them; the schedule is --method's.
    (In this process: test_every_recipe_has_a_working_help runs each recipe's --help as a command.)"""
    main = load_script(ROOT / "recipes" / recipe).main
    with pytest.raises(SystemExit) as shown:
        main(["--help"])
    out = capsys.readouterr().out
    assert shown.value.code == 0 and "This recipe's defaults" in out and "--max_steps 300" in " ".join(out.split())
    spellings = [["--acco_schedule", "sync"], ["--acco_schedule=sync"], ["--acco-schedule", "dpu"], ["--acco_sch=dpu"]]
    for given in spellings:  # every spelling argparse takes: dashes, =, an abbreviation
        with pytest.raises(SystemExit) as refused:
            main(given)
        said = capsys.readouterr().err
        assert refused.value.code == 2 and "sets the schedule with --method" in said, said[-2000:]


def launch(recipe: str, *args: str, timeout: float = 200) -> subprocess.CompletedProcess:
    return accelerate_launch(ROOT / "recipes" / recipe, *args, timeout=timeout)


@pytest.mark.timeout(3 * 200 + 60)  # 3 launches, each given 200 s
def test_alpaca_recipe_trains_saves_resumes_and_lambada_scores_its_output(tmp_path: Path) -> None:
    out = tmp_path / "alpaca"
    common = ["--output_dir", str(out), "--num_generated", "600", "--heldout", "40", "--max_steps", "8"]
    launch("alpaca_finetune.py", *common, "--save_strategy", "steps", "--save_steps", "4")
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == 2 and metrics["steps"] == 8
    assert metrics["heldout_loss"] < metrics["heldout_loss_before"]
    assert 0.0 <= metrics["exact_match_after"] <= 1.0
    assert (out / "model.safetensors").is_file() and (out / "loss_curve.png").is_file()
    assert (out / "checkpoint-4" / "acco_optimizer_rank1_of_2.pt").is_file()
    # resume from the middle (`true`: the latest complete checkpoint, here checkpoint-4 once checkpoint-8 is gone):
    # ends at the same step count, from the checkpoint's state
    shutil.rmtree(out / "checkpoint-8")
    launch("alpaca_finetune.py", *common, "--resume_from_checkpoint", "true")
    resumed = json.loads((out / "metrics.json").read_text())
    assert resumed["steps"] == 8
    assert resumed["heldout_loss"] == pytest.approx(metrics["heldout_loss"], rel=1e-4)
    # LAMBADA on the fine-tuned model (its word-level tokenizer maps unknown words to <unk>)
    lambada = tmp_path / "lambada.jsonl"
    lambada.write_text(
        "".join(json.dumps({"text": f"{r['input']} {r['output']}"}) + "\n" for r in generated_alpaca(30))
    )
    launch("lambada_eval.py", "--model_name_or_path", str(out), "--dataset_path", str(lambada),
           "--output_dir", str(tmp_path / "lambada"))  # fmt: skip
    scores = json.loads((tmp_path / "lambada" / "metrics.json").read_text())
    assert scores["num_docs"] == 30 and {"lambada_acc", "lambada_ppl"} <= set(scores)


@pytest.mark.timeout(260)
def test_alpaca_recipe_with_fsdp_inside_machines_from_the_config_file(tmp_path: Path) -> None:
    """accelerate_configs/hsdp_acco.yaml as 2 "machines" x 2 CPU ranks, a bf16 model with ACCO's leanest settings:
    the recipe trains, evaluates and saves; its exact match after training generates in step on every rank (each
    forward is a collective under FSDP; 22 held-out records do not split evenly over 4 ranks)."""
    shim = tmp_path / "shim"  # (test only: Accelerate runs FSDP on GPUs; tests/fsdp_cpu.py lets it on CPU ranks)
    shim.mkdir()
    (shim / "sitecustomize.py").write_text(
        f"import sys\nsys.path.insert(0, {str(ROOT)!r})\nfrom tests.fsdp_cpu import allow_fsdp_on_cpu\n"
        "allow_fsdp_on_cpu()\n"
    )
    out = tmp_path / "out"
    overrides = ("--num_machines", "1", "--num_processes", "4", "--machine_rank", "0",
                 "--main_process_ip", "127.0.0.1", "--parallelism_config_dp_shard_size", "2")  # fmt: skip
    accelerate_launch(
        ROOT / "recipes" / "alpaca_finetune.py", "--num_generated", "300", "--heldout", "22", "--max_steps", "4",
        "--dtype", "bfloat16", "--bf16", "--acco_grad_dtype", "bf16", "--acco_comm_dtype", "int8",
        "--output_dir", str(out), config="accelerate_configs/hsdp_acco.yaml", launcher_args=overrides,
        env={"PYTHONPATH": str(shim)}, timeout=200,
    )  # fmt: skip
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["world_size"] == 4 and metrics["steps"] == 4 and "exact_match_after" in metrics
    assert metrics["heldout_loss"] < metrics["heldout_loss_before"]
    assert (out / "model.safetensors").is_file()


@pytest.mark.timeout(2 * 200 + 60)  # 2 launches, each given 200 s
def test_alpaca_recipe_ddp_baseline_averages_gradients_like_sync(tmp_path: Path) -> None:
    """The baseline is real DDP: its held-out loss equals our synchronous ZeRO-1's (the same maths). Calling
    trainer.evaluate() before train() once left Trainer's model without DDP, each rank on its own gradients."""
    results = {}
    for method in ("ddp", "sync"):
        out = tmp_path / method
        launch("alpaca_finetune.py", "--num_generated", "300", "--heldout", "20", "--max_steps", "4",
               "--per_device_train_batch_size", "4", "--method", method, "--output_dir", str(out))  # fmt: skip
        results[method] = json.loads((out / "metrics.json").read_text())
    ddp, sync = results["ddp"], results["sync"]
    assert ddp["heldout_loss_before"] == pytest.approx(sync["heldout_loss_before"], rel=1e-6)
    assert ddp["heldout_loss"] == pytest.approx(sync["heldout_loss"], rel=1e-4)
    assert ddp["heldout_loss"] < ddp["heldout_loss_before"]


@pytest.mark.timeout(2 * 200 + 60)  # 2 launches, each given 200 s
def test_alpaca_recipe_through_trl_sync_equals_sfttrainer_under_ddp(tmp_path: Path) -> None:
    """--trl: the same recipe through TRL's SFTTrainer (prompt-completion records, its tokenization): ACCO's sync
    gives TRL+DDP's held-out loss, and the run records exact match before and after."""
    pytest.importorskip("trl", reason="TRL is not installed (pip install -e '.[trl]')")
    results = {}
    for method in ("ddp", "sync"):
        out = tmp_path / method
        launch("alpaca_finetune.py", "--trl", "--num_generated", "300", "--heldout", "20", "--max_steps", "4",
               "--per_device_train_batch_size", "4", "--method", method, "--output_dir", str(out),
               "--gradient_checkpointing", "false", "--bf16", "false")  # fmt: skip
        results[method] = json.loads((out / "metrics.json").read_text())
    ddp, sync = results["ddp"], results["sync"]
    assert ddp["trl"] and sync["trl"] and {"exact_match_before", "exact_match_after"} <= set(sync)
    assert ddp["heldout_loss_before"] == pytest.approx(sync["heldout_loss_before"], rel=1e-6)
    assert ddp["heldout_loss"] == pytest.approx(sync["heldout_loss"], rel=1e-4)
    assert sync["heldout_loss"] < sync["heldout_loss_before"]


@pytest.mark.skipif(not (DATA / "alpaca").is_dir(), reason="../shared/data/alpaca is absent")
@pytest.mark.timeout(3 * 200 + 60)  # 3 launches, each given 200 s
def test_alpaca_recipe_lora_on_the_shipped_sample_and_the_ddp_baseline(tmp_path: Path) -> None:
    sample = str(DATA / "alpaca" / "alpaca_data_first200.json")
    for method, extra in (("acco", ["--use_lora"]), ("ddp", [])):
        out = tmp_path / method
        launch("alpaca_finetune.py", "--dataset_path", sample, "--heldout", "20", "--max_steps", "4",
               "--method", method, "--output_dir", str(out), *extra)  # fmt: skip
        metrics = json.loads((out / "metrics.json").read_text())
        assert metrics["method"] == method and "exact_match_after" not in metrics
    adapter = tmp_path / "acco"
    assert (adapter / "adapter_model.safetensors").is_file()
    # the adapter of a model built by the recipe comes with that model, and names it: it can be used later
    base = adapter / "base_model"
    assert json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"] == str(base.resolve())
    lambada = tmp_path / "lambada.jsonl"
    texts = [f"{r['instruction']} {r['output']}" for r in load_records(sample)[:8]]
    lambada.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    launch("lambada_eval.py", "--model_name_or_path", str(base), "--adapter_path", str(adapter),
           "--dataset_path", str(lambada), "--output_dir", str(tmp_path / "lambada"))  # fmt: skip
    assert json.loads((tmp_path / "lambada" / "metrics.json").read_text())["num_docs"] == 8


@pytest.mark.slow
@pytest.mark.timeout(1260)
def test_the_embedded_default_learns(tmp_path: Path) -> None:
    """The README's main job, unchanged: held-out exact match before and after (its committed result:
    recipes/results/main_job/result.json)."""
    launch("alpaca_finetune.py", "--output_dir", str(tmp_path), timeout=1200)
    metrics = json.loads((tmp_path / "metrics.json").read_text())
    assert metrics["exact_match_before"] < 0.05
    assert metrics["exact_match_after"] > 0.5
