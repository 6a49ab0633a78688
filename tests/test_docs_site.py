"""The documentation site (mkdocs.yml, docs/): it builds with warnings as errors, every page is in it and linked from
the README, and the getting-started launch command for 2 machines of 8 GPUs is one accelerate and the recipe
accept."""

from __future__ import annotations

import importlib.util
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _nav_pages(nav: list) -> set[str]:
    pages: set[str] = set()
    for entry in nav:
        for value in entry.values():
            pages.update(_nav_pages(value) if isinstance(value, list) else {value})
    return pages


def test_the_site_builds_with_warnings_as_errors(tmp_path: Path) -> None:
    if shutil.which("mkdocs") is None and importlib.util.find_spec("mkdocs") is None:
        pytest.skip("mkdocs is not installed (the [tests] extra installs it)")
    done = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    for name in (
        "integrations.trainer.ACCOTrainer",
        "integrations.config.ACCOConfig",
        "integrations.accelerate.prepare_acco",
        "integrations.accelerate.acco_dataloader",
        "engine.core.ACCOOptimizer",
        "integrations.trl.ACCOSFTTrainer",
    ):
        assert f"hf_acco.{name}" in api, name  # read from the code
    assert "Drop-in replacement for" in api and "gather_dtype" in api  # their docstrings, ACCOOptimizer's arguments
    options = (tmp_path / "site" / "options" / "index.html").read_text()
    assert "acco_comm_dtype" in options and "acco_schedule" in options


def test_every_page_is_in_the_site_and_linked_from_the_readme() -> None:
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    pages = {p.name for p in DOCS.glob("*.md")}
    assert _nav_pages(config["nav"]) == pages
    readme = (ROOT / "README.md").read_text()
    linked = set(re.findall(r"\]\(docs/([\w-]+\.md)\)", readme))
    assert pages - {"index.md"} <= linked, pages - linked


def _block_with(text: str, needle: str, language: str) -> str:
    blocks = re.findall(rf"```{language}\n(.*?)```", text, flags=re.S)
    (block,) = [b for b in blocks if needle in b]
    return block


def test_the_launch_command_for_2_machines_of_8_gpus_is_one_accelerate_and_the_recipe_accept(monkeypatch) -> None:
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import launch_command_parser

    page = (DOCS / "getting-started.md").read_text()
    command = shlex.split(_block_with(page, "multi_node.yaml", "bash").replace("\\\n", " "))
    assert command[:2] == ["accelerate", "launch"]
    launch = launch_command_parser().parse_args(command[2:])
    assert launch.training_script == "recipes/alpaca_finetune.py" and (ROOT / launch.training_script).is_file()
    assert launch.machine_rank == 0 and launch.main_process_ip == "10.0.0.1"
    config = ClusterConfig.from_yaml_file(str(ROOT / launch.config_file))
    assert config.distributed_type.value == "MULTI_GPU" and config.mixed_precision == "bf16"
    assert (config.num_machines, config.num_processes) == (2, 16)
    shown = yaml.safe_load(_block_with(page, "num_machines", "yaml"))  # the config as the page shows it
    for key, value in shown.items():
        assert getattr(config, key) == value, key
    # the recipe's own parser takes its arguments: a 7B model in bf16, bf16 autocast, 8 micro-batches per step
    spec = importlib.util.spec_from_file_location("alpaca_finetune", ROOT / launch.training_script)
    recipe = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, recipe)  # (its dataclasses look their module up)
    spec.loader.exec_module(recipe)
    script, training, trainer_cls = recipe.parse_arguments(launch.training_script_args)
    assert script.model_name_or_path == "meta-llama/Llama-2-7b-hf" and script.dtype == "bfloat16"
    assert training.bf16 and training.gradient_accumulation_steps == 8 and trainer_cls.__name__ == "ACCOTrainer"


def test_the_fsdp_launch_command_for_4_machines_of_8_gpus_is_one_accelerate_and_the_recipe_accept(
    monkeypatch,
) -> None:
    """getting-started's FSDP-inside-machines command: accelerate's parser takes it, the config file with its
    overrides describes 4 machines x 8 GPUs as FSDP2 with the machines as the replicate dimension, and the recipe
    takes its arguments (a bf16 model, ACCO's leanest settings)."""
    from accelerate.commands.config.config_args import ClusterConfig
    from accelerate.commands.launch import launch_command_parser

    page = (DOCS / "getting-started.md").read_text()
    command = shlex.split(_block_with(page, "hsdp_acco.yaml", "bash").replace("\\\n", " "))
    launch = launch_command_parser().parse_args(command[2:])
    config = ClusterConfig.from_yaml_file(str(ROOT / launch.config_file))
    assert config.distributed_type.value == "FSDP" and config.fsdp_config["fsdp_version"] == 2
    assert config.fsdp_config["fsdp_cpu_ram_efficient_loading"] is True
    replicate = launch.parallelism_config_dp_replicate_size
    shard = config.parallelism_config["parallelism_config_dp_shard_size"]
    assert (launch.num_machines, launch.num_processes, replicate, shard) == (4, 32, 4, 8)
    spec = importlib.util.spec_from_file_location("alpaca_finetune", ROOT / launch.training_script)
    recipe = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, recipe)
    spec.loader.exec_module(recipe)
    script, training, trainer_cls = recipe.parse_arguments(launch.training_script_args)
    assert script.dtype == "bfloat16" and training.bf16 and training.gradient_checkpointing
    assert (training.acco_grad_dtype, training.acco_comm_dtype, training.acco_gather_dtype) == ("bf16", "int8", "int8")


def test_the_troubleshooting_page_has_every_entry_of_the_readmes_table() -> None:
    readme = (ROOT / "README.md").read_text()
    table = readme[readme.index("## Troubleshooting") : readme.index("## Limitations")]
    rows = [line for line in table.splitlines() if line.startswith("| ") and not line.startswith("| what happens")]
    page = (DOCS / "troubleshooting.md").read_text()
    assert rows and all(row in page for row in rows)
