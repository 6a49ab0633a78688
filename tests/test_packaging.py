"""The README's commands, .ci/run and the launch configs agree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci/run").read_text().splitlines()
    command = ci[ci.index(next(line for line in ci if "README test command" in line)) + 1]
    assert command in (ROOT / "README.md").read_text()
    assert command.startswith("python3 -m pip install torch==2.13.0 && ")  # torch first, pinned


@pytest.mark.parametrize("path", sorted((ROOT / "accelerate_configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_launch_config_parses_and_starts_several_processes(path: Path) -> None:
    from accelerate.commands.config.config_args import ClusterConfig

    config = ClusterConfig.from_yaml_file(str(path))
    assert config.num_processes >= 2
    # MULTI_CPU starts one process unless mpirun is configured; MULTI_GPU/torchrun starts them all
    assert config.distributed_type.value == "MULTI_GPU", "MULTI_CPU would silently start one process"
    assert config.num_processes % config.num_machines == 0
    assert len(list((ROOT / "accelerate_configs").glob("*.yaml"))) >= 3


def test_cpu_launch_config_starts_two_ranks() -> None:
    """MULTI_CPU silently starts one process without mpirun; MULTI_GPU + 2 processes takes the torchrun path."""
    config = yaml.safe_load((ROOT / "accelerate_configs/cpu_2proc.yaml").read_text())
    assert config["distributed_type"] == "MULTI_GPU"
    assert config["num_processes"] == 2


def test_the_engine_imports_without_the_hugging_face_stack() -> None:
    code = (
        "import sys, hf_acco, hf_acco.core, hf_acco.checkpoint, hf_acco.multiprocess\n"
        "assert not {'transformers', 'accelerate', 'datasets', 'peft'} & set(sys.modules), sorted(sys.modules)\n"
        "from hf_acco import ACCOConfig, ACCOTrainer\n"
        "assert 'transformers' in sys.modules"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
