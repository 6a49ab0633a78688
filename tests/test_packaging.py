"""The README's commands, .ci/run and the launch configs agree."""

from __future__ import annotations

import configparser
import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]


def test_ci_runs_the_readme_test_command() -> None:
    ci = (ROOT / ".ci/run").read_text().splitlines()
    line = next(line for line in ci if line.startswith("python3 -m pip install torch=="))
    command = line.removesuffix(" || exit")
    assert line.endswith(" || exit")  # a failed install stops CI (set -e does not, inside an && list)
    assert command in (ROOT / "README.md").read_text()
    assert command.startswith("python3 -m pip install torch==2.13.0 && ")  # torch first, pinned


@pytest.mark.parametrize("path", sorted((ROOT / "accelerate_configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_launch_config_parses_and_starts_several_processes(path: Path) -> None:
    from accelerate.commands.config.config_args import ClusterConfig

    config = ClusterConfig.from_yaml_file(str(path))
    assert config.num_processes >= 2
    # MULTI_CPU starts one process unless mpirun is configured; MULTI_GPU/torchrun starts them all
    assert config.distributed_type.value in ("MULTI_GPU", "FSDP"), "MULTI_CPU would silently start one process"
    assert config.num_processes % config.num_machines == 0
    if config.distributed_type.value == "FSDP":  # FSDP inside each machine, ACCO across (hf_acco.integrations.fsdp)
        shape = config.parallelism_config
        assert config.fsdp_config["fsdp_version"] == 2 and shape["parallelism_config_dp_replicate_size"] >= 2
        assert shape["parallelism_config_dp_shard_size"] * config.num_machines == config.num_processes
    assert len(list((ROOT / "accelerate_configs").glob("*.yaml"))) >= 3


def test_cpu_launch_config_starts_two_ranks() -> None:
    """MULTI_CPU silently starts one process without mpirun; MULTI_GPU + 2 processes takes the torchrun path."""
    config = yaml.safe_load((ROOT / "accelerate_configs/cpu_2proc.yaml").read_text())
    assert config["distributed_type"] == "MULTI_GPU"
    assert config["num_processes"] == 2


def test_the_engine_imports_without_the_hugging_face_stack() -> None:
    code = (
        "import importlib, importlib.util, pkgutil, sys, hf_acco, hf_acco.tools.multiprocess\n"
        "for layer in ('comm', 'engine', 'pacing'):\n"
        "    package = importlib.import_module('hf_acco.' + layer)\n"
        "    for info in pkgutil.iter_modules(package.__path__, package.__name__ + '.'):\n"
        "        if info.name.endswith('.triton_kernels') and not importlib.util.find_spec('triton'):\n"
        "            continue  # Triton is optional (the kernels extra; CUDA builds of torch bring it)\n"
        "        importlib.import_module(info.name)\n"
        "assert not {'transformers', 'accelerate', 'datasets', 'peft'} & set(sys.modules), sorted(sys.modules)\n"
        "from hf_acco import prepare_acco, acco_dataloader\n"
        "import hf_acco.integrations.baselines\n"
        "assert 'transformers' not in sys.modules, 'a hand-written Accelerate loop loads no transformers'\n"
        "from hf_acco import ACCOConfig, ACCOTrainer\n"
        "assert 'transformers' in sys.modules"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]


def _locked() -> dict[str, str]:
    lines = (ROOT / "constraints.txt").read_text().splitlines()
    pins = [line.split("==") for line in lines if line and not line.startswith("#")]
    return {name.lower().replace("_", "-"): version for name, version in pins}


def test_the_lock_pins_every_dependency_inside_the_tested_ranges() -> None:
    from packaging.requirements import Requirement
    from packaging.version import Version

    from hf_acco.integrations.versions import TESTED

    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    required = [Requirement(r) for r in config["options"]["install_requires"].split("\n") if r.strip()]
    extras = [
        Requirement(r) for extra in ("tests", "kernels") for r in config["options.extras_require"][extra].split("\n")
        if r.strip() and not r.strip().startswith("#")
    ]  # fmt: skip
    locked = _locked()
    for req in required + extras:
        assert req.name.lower() in locked, f"{req.name} is not pinned in constraints.txt"
        assert Version(locked[req.name.lower()]) in req.specifier, (req, locked[req.name.lower()])
    for package, (low, high) in TESTED.items():
        assert Version(low) <= Version(locked[package]) < Version(high), (package, locked[package])


def test_the_oldest_release_setup_cfg_allows_is_the_oldest_the_suite_ran_on() -> None:
    """setup.cfg's lower bounds for transformers and accelerate are TESTED's, and `make test-range` ran the suite on
    that pair and passed (benchmarks/results/test_range/oldest.json, the README's "Tested with" line)."""
    from packaging.requirements import Requirement
    from packaging.version import Version

    from hf_acco.integrations.versions import TESTED

    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    required = {(r := Requirement(line)).name: r for line in config["options"]["install_requires"].split("\n") if line}
    oldest = json.loads((ROOT / "benchmarks" / "results" / "test_range" / "oldest.json").read_text())
    for package, (low, _) in TESTED.items():
        floor = next(s.version for s in required[package].specifier if s.operator == ">=")
        assert floor == low, (package, floor, low)
        ran = Version(oldest["versions"][package])
        assert ran.release[:2] == Version(low).release[:2], (package, ran)  # a release of the lowest minor allowed
    assert oldest["failed"] == 0 and oldest["pytest_exit_status"] == 0 and oldest["passed"] > 400


def test_an_untested_transformers_gives_one_warning_naming_the_tested_range(monkeypatch) -> None:
    from hf_acco.integrations import versions

    monkeypatch.setattr(versions, "_warned", set())
    monkeypatch.setattr(versions, "version", lambda package: "5.99.0")
    with pytest.warns(versions.UntestedVersionWarning, match=r"tested with transformers>=5\.19,<5\.26; transformers"):
        versions.warn_if_untested("transformers")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        versions.warn_if_untested("transformers")  # once per process
    monkeypatch.setattr(versions, "_warned", set())
    monkeypatch.setattr(versions, "version", lambda package: "5.24.3")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        versions.warn_if_untested("transformers")  # a patch release of the tested minor: no warning


def test_the_demo_starts_its_own_ranks_and_learns(tmp_path: Path) -> None:
    """``python -m hf_acco.demo`` from outside the source tree, without a launcher: it starts 2 CPU ranks itself and
    prints the held-out loss before and after; 30 steps bring it down."""
    import re

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    done = subprocess.run([sys.executable, "-m", "hf_acco.demo", "--max_steps", "30"], capture_output=True, text=True,
                          timeout=240, cwd=tmp_path, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    (line,) = [line for line in done.stdout.splitlines() if "held-out loss" in line]
    before, after = map(float, re.findall(r"held-out loss ([\d.]+) -> ([\d.]+)", line)[0])
    assert "on 2 CPU ranks" in line and after < before - 0.3, line
