"""Two "machines" of 2 ranks each on this host, launched as a user launches a multi-node job (one `accelerate launch`
per machine: ``--num_machines 2 --machine_rank R --num_processes 4 --main_process_ip``): train, a rank killed
(pre-emption), resume from the last checkpoint, compare with the uninterrupted run. With a private output
directory per machine (a mount namespace each: no shared file system) and ``save_on_each_node=True``, as on nodes
with local disks."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from hf_acco.tools.multiprocess import free_port

SCRIPT = Path(__file__).parent / "scripts" / "trainer_script.py"
CAN_MOUNT = sys.platform == "linux" and os.geteuid() == 0 and shutil.which("unshare") is not None


def launch(out: Path, args: list[str], private: list[Path] | None = None, timeout: float = 300) -> list[int]:
    """Both machines' `accelerate launch`, side by side; their exit codes. ``private``: each machine sees its own
    directory at ``out`` (bind-mounted in a mount namespace of its own)."""
    port, procs = free_port(), []
    out.mkdir(parents=True, exist_ok=True)
    for machine in range(2):
        machines = ["--multi_gpu", "--num_machines", "2", "--machine_rank", str(machine), "--num_processes", "4"]
        rendezvous = ["--main_process_ip", "127.0.0.1", "--main_process_port", str(port), "--rdzv_backend", "static"]
        script = [str(SCRIPT), "--acco", "--output_dir", str(out), *args]
        cmd = [sys.executable, "-m", "accelerate.commands.launch", *machines, *rendezvous, *script]
        if private is not None:
            private[machine].mkdir(parents=True, exist_ok=True)
            mount = 'mount --bind "$1" "$2" && shift 2 && exec "$@"'
            cmd = ["unshare", "-m", "sh", "-c", mount, "sh", str(private[machine]), str(out), *cmd]
        log = open(out.parent / f"{out.name}_machine{machine}.log", "ab")  # noqa: SIM115 - closed below
        env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT), log))
    codes = []
    for proc, log in procs:
        try:
            codes.append(proc.wait(timeout=timeout))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes.append(proc.wait())
        log.close()
    return codes


def final_params(directory: Path) -> torch.Tensor:
    state = load_file(directory / "final" / "model.safetensors")
    return torch.cat([state[k].flatten() for k in sorted(state)])


STEPS = ["--max_steps", "8", "--save_steps", "4"]


@pytest.fixture(scope="module")
def expected(tmp_path_factory) -> torch.Tensor:
    """The uninterrupted run's final parameters (one shared directory)."""
    out = tmp_path_factory.mktemp("straight") / "out"
    assert launch(out, STEPS) == [0, 0]
    return final_params(out)


def _close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    return float((got - expected).norm() / expected.norm()) < 1e-6


def test_two_machines_with_a_shared_directory_resume_after_a_preemption(tmp_path: Path, expected) -> None:
    out = tmp_path / "out"
    codes = launch(out, [*STEPS, "--kill_rank1_at_step", "6"])  # rank 1 (machine 0) dies after step 6
    assert codes[0] != 0 and codes[1] != 0, codes
    assert launch(out, [*STEPS, "--resume", "last"]) == [0, 0]
    assert _close(final_params(out), expected)


@pytest.mark.skipif(not CAN_MOUNT, reason="private directories per machine need root and unshare (mount namespaces)")
def test_two_machines_with_private_directories_resume_after_a_preemption(tmp_path: Path, expected) -> None:
    steps = [*STEPS, "--extra", '{"save_on_each_node": true}']
    out, private = tmp_path / "out", [tmp_path / "machine0", tmp_path / "machine1"]
    codes = launch(out, [*steps, "--kill_rank1_at_step", "6"], private)  # rank 1 (machine 0) dies after step 6
    assert codes[0] != 0 and codes[1] != 0, codes
    for machine in range(2):  # each machine's own disk: its checkpoint-4, with its own ranks' shards only
        files = {p.name for p in (private[machine] / "checkpoint-4").iterdir()}
        ranks = (2 * machine, 2 * machine + 1)
        assert {f"acco_optimizer_rank{r}_of_4.pt" for r in ranks} | {"model.safetensors"} <= files, files
        assert not (private[machine] / "checkpoint-8").exists()
        assert not any(f"rank{r}_of_4" in name for r in range(4) if r not in ranks for name in files)
    assert launch(out, [*steps, "--resume", "last"], private) == [0, 0]
    for machine in range(2):
        assert _close(final_params(private[machine]), expected)


@pytest.mark.slow
def test_two_nodes_launched_with_torchrun_train_as_one_job(tmp_path: Path, expected) -> None:
    """torchrun's own multi-node launch (--nnodes 2 --node_rank R, its static rendezvous at the master address)."""
    port, procs, out = free_port(), [], tmp_path / "out"
    for node in range(2):
        nodes = ["--nnodes", "2", "--node_rank", str(node), "--nproc_per_node", "2"]
        rendezvous = ["--master_addr", "127.0.0.1", "--master_port", str(port)]
        cmd = [sys.executable, "-m", "torch.distributed.run", *nodes, *rendezvous, str(SCRIPT), "--acco"]
        env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
        procs.append(subprocess.Popen([*cmd, "--output_dir", str(out), *STEPS], env=env))
    assert [p.wait(timeout=300) for p in procs] == [0, 0]
    assert _close(final_params(out), expected)


@pytest.mark.slow
@pytest.mark.skipif(not CAN_MOUNT, reason="private directories per machine need root and unshare (mount namespaces)")
def test_sync_on_two_machines_with_private_directories_resumes_after_a_preemption(tmp_path: Path) -> None:
    sync = [*STEPS, "--extra", '{"acco_schedule": "sync"}']
    assert launch(tmp_path / "straight", sync) == [0, 0]
    expected = final_params(tmp_path / "straight")
    steps = [*STEPS, "--extra", '{"acco_schedule": "sync", "save_on_each_node": true}']
    out, private = tmp_path / "out", [tmp_path / "machine0", tmp_path / "machine1"]
    assert launch(out, [*steps, "--kill_rank1_at_step", "6"], private) != [0, 0]
    assert launch(out, [*steps, "--resume", "last"], private) == [0, 0]
    for machine in range(2):
        assert _close(final_params(private[machine]), expected)


@pytest.mark.slow
def test_int8_on_two_machines_resumes_after_a_preemption(tmp_path: Path) -> None:
    """int8 gradients (in two levels: the launcher's LOCAL_WORLD_SIZE=2 on each machine), int8 parameter changes and
    error feedback, through a real two-machine launch, a pre-emption and a resume."""
    wire = '{"acco_comm_dtype": "int8", "acco_gather_dtype": "int8", "acco_error_feedback": true}'
    steps = [*STEPS, "--extra", wire]
    assert launch(tmp_path / "straight", steps) == [0, 0]
    expected = final_params(tmp_path / "straight")
    out = tmp_path / "out"
    assert launch(out, [*steps, "--kill_rank1_at_step", "6"]) != [0, 0]
    assert launch(out, [*steps, "--resume", "last"]) == [0, 0]
    assert _close(final_params(out), expected)
