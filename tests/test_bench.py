"""The benchmark's statistics and report on synthetic timings (fast), and the whole command on loopback."""

import json
import math
import os
import statistics
import subprocess
import sys
import time

import pytest
import torch

from hf_acco.tools.bench import link, report
from hf_acco.tools.bench.headline import summarise_setting

from .helpers import load_script


def rank_log(method, *, step=0.5, steps=6, k=4, t_micro=0.1, wait=0.05, loss0=5.0, tx=None, mem=100, acc="fixed"):
    """A rank's log: steps every `step` s, k micro-batches per step spread over it, loss falling by 0.1 each."""
    ends = [step * (i + 1) for i in range(steps)]
    records = [(step * i + step * (j + 1) / k, loss0 - 0.1 * (i * k + j), 10) for i in range(steps) for j in range(k)]
    return {
        "method": method,
        "accumulation": acc,
        "step_ends": ends,
        "waits": [None if method == "ddp" else wait] * steps,
        "micro_batches": [k] * steps,
        "records": records,
        "tx_bytes": tx,
        "peak_mem_bytes": mem,
        "t_micro": t_micro,
    }


def test_basic_statistics():
    assert report.step_intervals([1.0, 2.0, 2.5, 3.5, 4.0], skip=2) == [1.0, 0.5]
    assert report.overlap_efficiency(t_compute=1.0, t_comm=0.5, t_step=1.0) == 1.0  # all hidden
    assert report.overlap_efficiency(t_compute=1.0, t_comm=0.5, t_step=1.5) == 0.0  # none hidden
    assert report.overlap_efficiency(t_compute=1.0, t_comm=0.5, t_step=1.25) == 0.5
    assert report.overlap_efficiency(1.0, 0.0, 1.0) is None
    assert report.overlap_efficiency(1.0, 0.04, 1.0) is None  # negligible: nothing to hide


def test_merged_loss_curve_and_time_to_target():
    rank0 = [(0.1, 4.0, 10), (0.3, 2.0, 10)]
    rank1 = [(0.2, 3.0, 20), (0.4, 1.0, 20)]
    curve = report.merged_loss_curve([rank0, rank1], window=2)
    assert curve == [(0.2, 30, 3.5), (0.3, 40, 2.5), (0.4, 60, 1.5)]
    assert report.time_to_target(curve, 2.5) == (0.3, 40)
    assert report.time_to_target(curve, 1.0) is None
    assert report.loss_at_fraction(curve, 0.75) == 1.5  # first point with >= 45 tokens
    assert report.loss_at_fraction(curve, 0.5) == 3.5
    with pytest.raises(ValueError, match="window"):
        report.merged_loss_curve([rank0], window=0)


def test_summarise_run_on_synthetic_timings():
    # two ranks, rank 1 slowed (t_micro 0.2): compute per step is the slow rank's 4 x 0.2 = 0.8 s
    ranks = [rank_log("acco", step=1.0, tx=6e6, t_micro=0.1), rank_log("acco", step=1.0, tx=6e6, t_micro=0.2)]
    s = report.summarise_run(ranks, t_comm=0.6, link_mbit=80.0, window=4)
    assert s["steps"] == 6
    assert s["step_time_s"] == pytest.approx(1.0)
    assert s["t_compute_s"] == pytest.approx(0.8)
    assert s["exposed_comm_s"] == pytest.approx(0.05)
    assert s["overlap_efficiency"] == pytest.approx((0.8 + 0.6 - 1.0) / 0.6)
    assert s["bytes_per_step"] == pytest.approx(1e6)
    assert s["t_wire_s"] == pytest.approx(1e6 * 8 / 80e6)
    assert s["limit_s"] == pytest.approx(0.8)  # max(compute, wire)
    # tokens after the end of the warm-up steps (t > 2.0 s) over the time from there to the last step (4 s)
    assert s["tokens_per_s"] == pytest.approx(2 * 4 * 4 * 10 / 4.0)
    assert s["tokens"] == 2 * 6 * 4 * 10
    assert s["peak_mem_bytes"] == 100
    assert s["loss_curve"][0] == (pytest.approx(0.5), 40, pytest.approx(4.95))  # both ranks' first 2 micro-batches
    assert s["compute_slowdown"] is None  # no in-run compute timings in these logs


def test_compute_slowdown_and_cpu_share():
    ranks = [rank_log("acco", t_micro=0.1), rank_log("acco", t_micro=0.1)]
    for r, in_run in zip(ranks, (0.11, 0.125)):
        # the start-up steps' micro-batches (first 2 steps x 4) are left out: their 9.0 s must not count
        r.update(t_base=0.1, micro_batch_compute_s=[9.0] * 8 + [in_run] * 16, cpu_s=3.0, wall_s=4.0)
    s = report.summarise_run(ranks, t_comm=0.2, link_mbit=None, window=4)
    assert s["compute_slowdown"] == pytest.approx(1.25)  # the larger of the ranks'
    assert s["cpu_per_wall"] == [0.75, 0.75]
    combined = report.combine_repeats([s, s], target=None)
    assert combined["compute_slowdown"] == pytest.approx(1.25) and combined["cpu_per_wall"] == [[0.75, 0.75]] * 2


def test_ddp_exposed_communication_is_what_compute_does_not_explain():
    ranks = [rank_log("ddp", step=0.7, t_micro=0.1)] * 2
    s = report.summarise_run(ranks, t_comm=0.5, link_mbit=None, window=4)
    assert s["exposed_comm_s"] == pytest.approx(0.3)
    assert s["t_wire_s"] is None and s["limit_s"] == pytest.approx(0.4) and s["bytes_per_step"] is None


def test_combine_repeats_medians_and_a_missed_target():
    fast = report.summarise_run([rank_log("sync", step=0.5)] * 2, t_comm=0.2, link_mbit=None, window=2)
    slow = report.summarise_run([rank_log("sync", step=1.5)] * 2, t_comm=0.2, link_mbit=None, window=2)
    never = report.summarise_run([rank_log("sync", step=1.0, loss0=50)] * 2, t_comm=0.2, link_mbit=None, window=2)
    target = 4.01
    out = report.combine_repeats([fast, slow, never], target)
    assert out["repeats"] == 3
    assert out["step_time_s"] == pytest.approx(1.0)  # median of 0.5, 1.5, 1.0
    assert out["step_time_s_all"] == pytest.approx([0.5, 1.5, 1.0])
    # both ranks' 11th micro-batch (loss 4.0) ends 2.75 steps in
    assert report.time_to_target(fast["loss_curve"], target)[0] == pytest.approx(0.5 * 2.75)
    assert out["time_to_target_s"] == pytest.approx(1.5 * 2.75)  # median of (fast, slow, never = inf)
    assert out["reached_target"] == "2/3"
    assert report.combine_repeats([never], target)["time_to_target_s"] is None


def test_default_target_is_ddp_after_three_quarters():
    ddp = report.summarise_run([rank_log("ddp")] * 2, t_comm=0.2, link_mbit=None, window=1)
    curve = ddp["loss_curve"]
    assert report.default_target([ddp]) == next(c[2] for c in curve if c[1] >= 0.75 * curve[-1][1])


def test_summarise_setting_and_table():
    def logs(step_of):
        return [
            {
                "comm": {"all_to_all_s": 0.3, "all_reduce_s": 0.25, "all_to_all_bytes": 1.0},
                "runs": [
                    {**rank_log(m, step=step_of[m], acc=a, t_micro=0.25), "repeat": 0, "k": 4}
                    for m, a in (("acco", "fixed"), ("sync", "fixed"), ("ddp", "fixed"))
                ],
            }
        ] * 2

    setting = {"setting": "ratio0.5", "link_mbit": 100.0, "comm_over_compute": 0.5, "slow_factor": 1.0}
    runs = summarise_setting(logs({"acco": 1.05, "sync": 1.5, "ddp": 1.4}), setting, None)
    by = {r["method"]: r for r in runs}
    assert by["acco"]["t_comm_s"] == pytest.approx(0.6)  # two rounds per step
    assert by["sync"]["t_comm_s"] == pytest.approx(0.3) and by["ddp"]["t_comm_s"] == pytest.approx(0.25)
    assert by["acco"]["overlap_efficiency"] == pytest.approx((1.0 + 0.6 - 1.05) / 0.6)
    assert by["acco"]["target_loss"] == report.default_target([report.summarise_run(
        [rank_log("ddp", step=1.4, t_micro=0.25)] * 2, t_comm=0.25, link_mbit=100.0, window=16)])  # fmt: skip
    assert by["acco"]["comm_over_compute_measured"] == pytest.approx(0.3 / 1.0)
    table = report.markdown_table(runs)
    acco_row = next(line for line in table.splitlines() if "| acco |" in line)
    cells = [c.strip() for c in acco_row.strip("|").split("|")]
    assert cells[4:7] == ["1.050", "0.70", "0.75"]  # step, / sync, / DDP
    assert cells[0] == "100" and cells[3] == "acco"


def test_tbf_arguments_and_missing_privileges(monkeypatch):
    args = link.tbf_args(100.0)
    assert args[:3] == ["tbf", "rate", "100.000mbit"]
    assert int(args[4]) == 64 * 1024  # 4 ms at 100 Mbit/s is 50 kB: the 64 KiB floor
    assert int(link.tbf_args(1000.0)[4]) == 500_000
    monkeypatch.setattr(link.os, "geteuid", lambda: 1000)
    assert "root" in link.unavailable()
    with pytest.raises(RuntimeError, match="root"):
        link.Link().__enter__()


def test_the_benchmark_command_on_host_loopback(tmp_path):
    """The whole command, small: 2 real ranks, every method, on unshaped host loopback (no namespaces)."""
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "hf_acco.bench", "--no_netns", "--repeats", "1", "--steps", "4", "--hidden", "32",
           "--layers", "1", "--heads", "1", "--seq", "32", "--batch", "2", "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "no shaped link (--no_netns given)" in done.stdout
    payload = json.loads((out / "benchmark.json").read_text())
    assert {(r["method"], r["accumulation"]) for r in payload["runs"]} == {
        ("acco", "fixed"), ("acco", "paced"), ("dpu", "fixed"), ("sync", "fixed"), ("ddp", "fixed")}  # fmt: skip
    required = ("method", "accumulation", "link_mbit", "slow_factor", "step_time_s", "t_compute_s", "t_comm_s",
                "exposed_comm_s", "overlap_efficiency", "tokens_per_s", "time_to_target_s",
                "peak_mem_bytes")  # fmt: skip
    for r in payload["runs"]:
        assert all(k in r for k in required)
        assert r["link_mbit"] is None and r["steps"] == 4 and r["step_time_s"] > 0 and math.isfinite(r["t_comm_s"])
    assert (out / "table.md").read_text().count("| loopback |") == 5
    assert (out / "loss_vs_time.png").stat().st_size > 0 and (out / "step_time_vs_link.png").stat().st_size > 0


def test_the_benchmarks_int8_rows_send_int8_gradients_and_parameter_changes(tmp_path):
    """``acco-int8`` / ``sync-int8`` run (gradients and parameter changes quantised on the wire), and their wire
    time is counted for 2 (1 + 4/256) / (4 + 4) of an fp32 round's bytes."""
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "hf_acco.bench", "--no_netns", "--repeats", "1", "--steps", "4", "--hidden", "32",
           "--layers", "1", "--heads", "1", "--seq", "32", "--batch", "2", "--out", str(out),
           "--methods", "sync:fixed", "sync-int8:fixed", "acco-int8:fixed", "acco-int8-int4:fixed"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    runs = {r["method"]: r for r in json.loads((out / "benchmark.json").read_text())["runs"]}
    assert all(r["step_time_s"] > 0 and math.isfinite(r["final_loss"]) for r in runs.values())
    # the wire time of a round, scaled from the fp32 round measured alone by the bytes each element takes
    assert runs["sync-int8"]["t_comm_s"] / runs["sync"]["t_comm_s"] == pytest.approx(2 * (1 + 4 / 256) / 8)
    assert runs["acco-int8"]["t_comm_s"] == pytest.approx(2 * runs["sync-int8"]["t_comm_s"])
    int4 = 2 * ((1 + 4 / 256) + (0.5 + 4 / 256)) / 8  # int8 gradients, int4 changes; two rounds a step
    assert runs["acco-int8-int4"]["t_comm_s"] / runs["sync"]["t_comm_s"] == pytest.approx(int4)


@pytest.mark.slow  # (the default suite's 10-minute budget; `make test-slow`)
def test_the_benchmark_command_with_3_ranks_and_emulated_compute(tmp_path):
    """3 ranks (odd: the shards pad), GPU-like compute: every micro-batch takes at least the stated 40 ms and the
    ballast's 30,000 elements are communicated; the rows say emulated; acco:dynamic is taken as paced's old name."""
    out = tmp_path / "bench"
    cmd = [sys.executable, "-m", "hf_acco.bench", "--no_netns", "--world_size", "3", "--repeats", "1", "--steps",
           "4", "--hidden", "32", "--layers", "2", "--heads", "1", "--seq", "16", "--batch", "2",
           "--emulate_micro_batch_s", "0.04", "--emulate_params", "30000", "--methods", "acco:fixed", "acco:dynamic",
           "ddp:fixed", "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    payload = json.loads((out / "benchmark.json").read_text())
    assert {(r["method"], r["accumulation"]) for r in payload["runs"]} == {
        ("acco", "fixed"), ("acco", "paced"), ("ddp", "fixed")}  # fmt: skip
    for r in payload["runs"]:
        assert r["emulated"] is True and r["world_size"] == 3
        assert r["t_compute_s"] >= 4 * 0.04  # 4 micro-batches per step, each at least the stated time
        assert r["comm_alone"]["numel"] > 30000
    paced = next(r for r in payload["runs"] if r["accumulation"] == "paced")
    assert sum(paced["micro_batches_per_step"][0]) == pytest.approx(3 * 4)  # the global batch, shared by 3
    assert (out / "table.md").read_text().count("loopback, 3 ranks (emulated)") == 3


@pytest.mark.slow
@pytest.mark.skipif(link.unavailable() is not None, reason=f"shaped link unavailable: {link.unavailable()}")
@pytest.mark.parametrize("world_size", [2, 3])
def test_shaped_link_limits_the_rate_and_is_removed(world_size):
    """Shaped at 40 Mbit/s, a veth pair (2 ranks) or a bridge's port (3: rank 1 -> rank 2; each port is shaped,
    not the bridge) carries about 40 Mbit/s; the namespaces are gone afterwards."""
    sender, receiver = world_size - 2, world_size - 1
    with link.Link(prefix="hfaccotest", world_size=world_size) as ln:
        ln.shape(40)
        server = subprocess.Popen(ln.wrap(receiver, [sys.executable, "-c", _SINK]), stdout=subprocess.PIPE, text=True)
        try:
            code = _SOURCE.format(addr=f"10.213.7.{receiver + 1}")
            sent = subprocess.run(ln.wrap(sender, [sys.executable, "-c", code]), capture_output=True, text=True,
                                  timeout=60)  # fmt: skip
            assert sent.returncode == 0, sent.stderr
            mbit = float(sent.stdout)
        finally:
            server.kill()
    assert 30 < mbit < 44
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "hfaccotest" not in names


_SINK = """
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind(("0.0.0.0", 29700)); s.listen()
c, _ = s.accept()
while c.recv(1 << 20):
    pass
"""
_SOURCE = """
import socket, time
for _ in range(50):
    try:
        s = socket.create_connection(("{addr}", 29700)); break
    except OSError:
        time.sleep(0.1)
data = b"x" * (1 << 20)
t0 = time.perf_counter()
for _ in range(10):
    s.sendall(data)
s.shutdown(socket.SHUT_WR); s.recv(1)
print(10 * 8 * (1 << 20) / (time.perf_counter() - t0) / 1e6)
"""


def _ddp_with_the_bf16_wire_hook(rank: int, world_size: int) -> torch.Tensor:
    from hf_acco.integrations.baselines import bf16_wire_hook

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    ddp.register_comm_hook(None, bf16_wire_hook)
    ddp(torch.full((3, 4), 0.1 + rank / 3)).sum().backward()
    return model.weight.grad.clone()


def test_the_benchmarks_ddp_bf16_hook_averages_in_bf16() -> None:
    """What the benchmark's ``ddp-bf16`` runs: each rank's gradient rounded to bf16, averaged (as torch's
    bf16_compress_hook, which DDP refuses off NCCL)."""
    from hf_acco.tools.bench.report import gather_of, method_parts
    from hf_acco.tools.multiprocess import run_ranks

    grads = run_ranks(_ddp_with_the_bf16_wire_hook)
    local = [3 * torch.full((2, 4), 0.1 + r / 3) for r in range(2)]
    expected = sum((g / 2).to(torch.bfloat16) for g in local).float()  # divided, rounded, summed in bf16
    assert torch.equal(grads[0], grads[1]) and torch.equal(grads[0], expected)
    assert not torch.equal(expected, sum(local) / 2)  # the rounding is there
    assert method_parts("acco-bf16") == ("acco", "bf16") and method_parts("ddp") == ("ddp", "fp32")
    assert method_parts("acco-int8-int4") == ("acco", "int8")
    assert [gather_of(m) for m in ("acco", "acco-bf16", "sync-int8", "acco-int8-int4")] == [
        "auto",
        "auto",
        "int8",
        "int4",
    ]


@pytest.mark.skipif(link.unavailable() is not None, reason=f"shaped link unavailable: {link.unavailable()}")
def test_a_bridge_joins_n_ranks_each_shaped_both_ways_and_is_removed():
    """4 ranks: a namespace each and one for the bridge; tbf on each rank's end and on its bridge port."""

    def listed() -> str:
        return subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout

    with link.Link(prefix="hfaccotestbr", world_size=4) as ln:
        assert ln.bridge and len(ln.namespaces) == 4 and ln.master_addr() == "10.213.7.1"
        ln.shape(50)
        qdiscs = subprocess.run(["tc", "-n", ln.bridge_namespace, "qdisc", "show"], capture_output=True, text=True)
        assert qdiscs.stdout.count("tbf") == 4 and "rate 50Mbit" in qdiscs.stdout
        for r in range(4):
            shown = subprocess.run(["tc", "-n", ln.namespace(r), "qdisc", "show", "dev", ln.device(r)],
                                   capture_output=True, text=True).stdout  # fmt: skip
            assert "tbf" in shown and "rate 50Mbit" in shown
            address = subprocess.run(["ip", "-n", ln.namespace(r), "-4", "addr", "show", ln.device(r)],
                                     capture_output=True, text=True).stdout  # fmt: skip
            assert f"10.213.7.{r + 1}/24" in address and "mtu 9000" in address
        ports = subprocess.run(["ip", "-n", ln.bridge_namespace, "link", "show", "master", "br0"],
                               capture_output=True, text=True).stdout  # fmt: skip
        assert all(p in ports for p in ln.ports)
        assert listed().count("hfaccotestbr") == 5
    assert "hfaccotestbr" not in listed()
    with pytest.raises(ValueError, match="bridge=True"):
        link.Link(world_size=3, bridge=False)
    with pytest.raises(ValueError, match="at least 2"):
        link.Link(world_size=1)


def test_emulated_compute_takes_the_stated_time_and_carries_the_ballast():
    """A micro-batch's real gradients, then waits: forward to 1/3 of the stated time, each layer's backward to
    its share (last layer first), the end at the stated time; the ballast adds its elements, with gradients."""
    from hf_acco.tools.bench.worker import Emulation, batches, build_model, compute_alone, load_tokens

    spec = {"seed": 0, "hidden": 16, "layers": 3, "heads": 1, "seq": 16, "batch": 2}
    plain = sum(p.numel() for p in build_model(spec).parameters())
    emu = Emulation(micro_batch_s=0.15, params=1000)
    reached = []
    original = emu.backward_reached
    emu.backward_reached = lambda layer: (original(layer), reached.append((layer, time.perf_counter() - emu.t0)))
    model = build_model(spec, emu)
    assert sum(p.numel() for p in model.parameters()) == plain + 1000
    assert [b.bench_ballast.numel() for b in model.model.layers] == [334, 333, 333]
    seconds = compute_alone(model, batches(load_tokens(None), spec, 0), repeats=2, warmup=0, emu=emu)
    assert all(0.15 <= s < 0.15 + 0.5 for s in seconds)
    assert [layer for layer, _ in reached[:3]] == [2, 1, 0]  # the backward meets the last layer first
    for layer, at in reached[:3]:  # each layer's gradients come after its share of the backward
        assert at >= 0.05 + 0.1 * (3 - layer) / 3 - 1e-3
    model(input_ids=torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 4, dtype=torch.long)).loss.backward()
    assert all(b.bench_ballast.grad is not None for b in model.model.layers)


@pytest.mark.slow
@pytest.mark.skipif(link.unavailable() is not None, reason=f"shaped link unavailable: {link.unavailable()}")
def test_the_scaling_benchmark_at_2_and_3_ranks(tmp_path):
    """The whole scaling command, small: 2 and 3 ranks on a bridge, emulated compute, a slow rank at 3, the
    planner's fit and its recommendation check (about 3 minutes)."""
    out = tmp_path / "scaling"
    cmd = [sys.executable, "-m", "hf_acco.tools.bench.scaling", "--world_sizes", "2", "3", "--steps", "5",
           "--repeats", "1",
           "--params", "1e6", "--check", "3:1.0", "--check_micro_batches", "2", "4", "--slow", "3:2",
           "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    payload = json.loads((out / "benchmark.json").read_text())
    assert payload["emulated"] is True
    runs = payload["runs"]
    assert {(r["world_size"], r["method"], r["accumulation"]) for r in runs if r["setting"].startswith("scaling")} == {
        (p, m, a) for p in (2, 3) for m, a in (("acco", "fixed"), ("acco", "paced"), ("sync", "fixed"),
                                               ("ddp", "fixed"))}  # fmt: skip
    for r in runs:
        assert r["emulated"] is True and r["step_time_s"] > 0 and r["predicted_step_time_s"] > 0
        # the emulated micro-batch: a round alone over (ratio x micro-batches), the check's at its own ratio
        assert statistics.median(r["t_micro_s"]) >= 0.9 * r["round_alone_s"] / (r["comm_over_compute"] * 4)
    slow = {r["accumulation"]: r for r in runs if r["setting"] == "slow_ws3_x2" and r["method"] == "acco"}
    assert slow["fixed"]["slow_factor"] == 2.0
    times = slow["fixed"]["t_micro_s"]  # rank 1 emulates a device 2x slower
    assert times[1] >= 1.8 * times[0] and times[1] >= 1.8 * times[2]
    check = payload["recommendation_check"]
    assert len(check["candidates_measured"]) == 6 and 0 < check["recommended_over_best"] <= 1.0
    assert json.loads((out / "constants.json").read_text())["source"].startswith("fitted")
    assert (out / "step_time_vs_world_size.png").stat().st_size > 0 and "(emulated)" in (out / "table.md").read_text()
    assert "hfacco" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout


def _qdiscs(namespace: str, device: str | None = None) -> str:
    argv = ["tc", "-n", namespace, "qdisc", "show", *(["dev", device] if device else [])]
    return subprocess.run(argv, capture_output=True, text=True).stdout


@pytest.mark.skipif(link.unavailable() is not None, reason=f"shaped link unavailable: {link.unavailable()}")
def test_nodes_have_a_bridge_each_and_only_their_uplinks_are_shaped():
    """2 nodes of 2 ranks: a bridge per node holding its ranks' ports and its uplink, the core bridge holding the
    uplinks' other ends; tbf on both ends of each uplink, nothing on the ranks' own links; all of it removed."""
    with link.Link(prefix="hfaccotestnd", world_size=4, nodes=2) as ln:
        assert [ln.node(r) for r in range(4)] == [0, 0, 1, 1] and len(ln.node_namespaces) == 2
        ln.shape(50)
        for i, (ns, (up, core_end)) in enumerate(zip(ln.node_namespaces, ln.uplinks)):
            ports = subprocess.run(
                ["ip", "-n", ns, "link", "show", "master", "br0"], capture_output=True, text=True
            ).stdout
            assert all(ln.ports[r] in ports for r in range(4) if ln.node(r) == i) and up in ports
            assert "rate 50Mbit" in _qdiscs(ns, up) and "rate 50Mbit" in _qdiscs(ln.bridge_namespace, core_end)
            assert _qdiscs(ns).count("tbf") == 1  # the rank's ports are not shaped
        assert all("tbf" not in _qdiscs(ln.namespace(r), ln.device(r)) for r in range(4))
        ln.shape(None)
        assert "tbf" not in _qdiscs(ln.bridge_namespace)
    assert "hfaccotestnd" not in subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    with pytest.raises(ValueError, match="nodes must divide"):
        link.Link(world_size=4, nodes=3)


@pytest.mark.slow
@pytest.mark.skipif(link.unavailable() is not None, reason=f"shaped link unavailable: {link.unavailable()}")
def test_a_nodes_ranks_share_its_uplink_and_talk_fast_inside_it():
    """Uplinks at 40 Mbit/s: one rank alone to the other node gets about 40; two ranks of a node sending to the
    other node at once share it (neither above it, and the one that finishes last about half of it: their 20 MiB
    all go through one uplink; how TCP splits it while both run is its own affair); two ranks of one node talk far
    above the uplink's rate."""

    def send(ln, pairs: list[tuple[int, int]]) -> list[float]:
        sinks = [subprocess.Popen(ln.wrap(b, [sys.executable, "-c", _SINK])) for _, b in pairs]
        try:
            sources = [
                subprocess.Popen(
                    ln.wrap(a, [sys.executable, "-c", _SOURCE.format(addr=f"10.213.7.{b + 1}")]),
                    stdout=subprocess.PIPE,
                    text=True,
                )
                for a, b in pairs
            ]
            return [float(s.communicate(timeout=60)[0]) for s in sources]
        finally:
            for s in sinks:
                s.kill()
                s.wait()

    with link.Link(prefix="hfaccotestup", world_size=4, nodes=2) as ln:
        ln.shape(40)
        assert 30 < send(ln, [(0, 2)])[0] < 44
        both = send(ln, [(0, 2), (1, 3)])
        assert max(both) < 44 and min(both) < 26, both
        assert send(ln, [(0, 1)])[0] > 200


def test_bench_ab_summarises_the_runs_it_finds_side_by_side(tmp_path):
    """benchmarks/bench_ab.py --summarize: every base-N / head-N run's headline figures, and their medians."""
    from pathlib import Path

    bench_ab = load_script(Path(__file__).resolve().parent.parent / "benchmarks" / "bench_ab.py")

    def run(acco_step, sync_step=0.5, ddp_step=0.4):
        methods = {"acco": acco_step, "sync": sync_step, "ddp": ddp_step}
        runs = [{"method": m, "setting": s, "slow_factor": 1, "step_time_s": t, "overlap_efficiency": 0.8,
                 "compute_slowdown": 1.1} for m, t in methods.items() for s in ("loopback", "ratio0.5")]  # fmt: skip
        runs[0]["step_time_s"] = 9.0  # the loopback setting's acco: not a headline figure
        return {"runs": runs}

    for name, steps in (("base", (0.30, 0.40, 0.35)), ("head", (0.20, 0.25))):
        for i, step in enumerate(steps):
            (tmp_path / f"{name}-{i + 1}").mkdir()
            (tmp_path / f"{name}-{i + 1}" / "benchmark.json").write_text(json.dumps(run(step)))
    bench_ab.main(["--base", "abc1234", "--summarize", "--head", "def5678", "--out", str(tmp_path)])
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["base"], summary["head"]) == ("abc1234", "def5678")
    assert [r["acco step (s)"] for r in summary["rounds"]["base"]] == [0.30, 0.40, 0.35]
    assert summary["medians"]["base"]["acco / sync"] == pytest.approx(0.35 / 0.5)
    assert summary["medians"]["head"]["acco / DDP"] == pytest.approx(0.225 / 0.4)
    assert "**0.700**" in (tmp_path / "table.md").read_text()  # the base's median acco / sync
    with pytest.raises(SystemExit, match="no base-N/ and head-N/ runs"):
        bench_ab.main(["--base", "abc1234", "--summarize", "--out", str(tmp_path / "empty")])


@pytest.mark.skipif(link.unavailable() is not None, reason=f"shaped link unavailable: {link.unavailable()}")
def test_beside_times_micro_batches_alone_and_beside_real_rounds(tmp_path):
    """benchmarks/beside.py: both ranks time micro-batches in both kinds of phase and real rounds beside them."""
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "beside.py"
    out = tmp_path / "beside.json"
    cmd = [sys.executable, str(script), "--mbit", "400", "--phases", "1", "--rounds", "4", "--out", str(out)]
    subprocess.run(cmd, check=True, timeout=300)
    result = json.loads(out.read_text())
    assert result["mbit"] == 400 and len(result["ranks"]) == 2
    for rank in result["ranks"]:
        assert rank["micro_batches"][0] == 11 and rank["micro_batches"][1] >= 1
        assert rank["micro_batch_alone_ms"] > 0 and rank["round_beside_ms"] > 0
        assert rank["beside_over_alone"] == pytest.approx(rank["micro_batch_beside_ms"] / rank["micro_batch_alone_ms"])


@pytest.mark.skipif(link.unavailable() is not None, reason=f"shaped link unavailable: {link.unavailable()}")
@pytest.mark.slow  # (the default suite's 10-minute budget; `make test-slow`)
def test_the_hsdp_benchmark_at_2_nodes_of_2(tmp_path):
    """FSDP2 inside 2 nodes of 2 ranks, HSDP's all-reduce or ACCO's rounds across (about a minute). What crosses
    the uplinks per step is the design's: HSDP all-reduces each rank's FSDP shard once (two nodes: its shard's bytes
    out of each node, per rank), ACCO's schedule runs two rounds (the estimate's and the commit's), sync one."""
    out = tmp_path / "hsdp"
    cmd = [sys.executable, "-m", "hf_acco.tools.bench.hsdp", "--steps", "5", "--repeats", "1", "--params", "1e6",
           "--out", str(out)]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    payload = json.loads((out / "benchmark.json").read_text())
    runs = {r["method"]: r for r in payload["runs"]}
    assert set(runs) == {"hsdp", "hsdp_acco", "hsdp_sync"} and payload["emulated"] is True
    shard_bytes = 4 * runs["hsdp"]["params"] / 2  # fp32, one FSDP shard of 2
    across = {m: r["across_bytes_per_step"] for m, r in runs.items()}
    assert 0.95 * shard_bytes < across["hsdp"] < 1.15 * shard_bytes, across  # (+ headers, the norm, the counts)
    assert across["hsdp_sync"] == pytest.approx(across["hsdp"], rel=0.1)
    assert across["hsdp_acco"] == pytest.approx(2 * across["hsdp_sync"], rel=0.1)
    assert all(r["step_time_s"] > 0 and r["bytes_per_step"] > r["across_bytes_per_step"] for r in runs.values())
    assert all(r["predicted_step_time_s"] > 0 for r in runs.values())  # the planner's --fsdp beside each
    assert "(emulated)" in (out / "table.md").read_text()
