"""The planner's cost model (hf_acco/tools/plan/) on numbers worked out by hand, its fit, its recommendation and its
command; the scaling benchmark's bookkeeping on synthetic runs (the runs themselves: the slow tier)."""

import json
import subprocess
import sys
from dataclasses import replace

import pytest
import torch

from hf_acco.tools import plan
from hf_acco.tools.memory import engine_memory

from .helpers import ROOT

C0 = plan.Constants(alpha_s={"round": 0.0, "all_reduce": 0.0}, efficiency={"round": 1.0, "all_reduce": 1.0})


def flat(p: int, gbit: float) -> plan.Cluster:
    """p ranks, each on its own link of ``gbit`` (the benchmark's bridge: one rank per port)."""
    return plan.Cluster(gpus=p, gpus_per_node=1, intra_gbit=1e9, inter_gbit=gbit)


def test_ring_and_two_level_collectives():
    # 4 ranks, 1 GB, 8 Gbit/s = 1 GB/s: (p - 1) / p of the bytes leave each rank: 0.75 s, plus 3 latencies
    assert plan.ring(1e9, 4, 8.0, 1.0, 0.0) == pytest.approx(0.75)
    assert plan.ring(1e9, 4, 8.0, 0.5, 0.01) == pytest.approx(3 * 0.01 + 1.5)
    assert plan.ring(1e9, 1, 8.0, 1.0, 0.01) == 0.0
    c = replace(C0, alpha_s={"round": 1e-3, "all_reduce": 0.0})
    # one rank per node, or one node: the plain ring, spelled either way
    node = plan.Cluster(gpus=8, gpus_per_node=8, intra_gbit=800.0, inter_gbit=1.0)
    for spelling in ("ring", "all_to_all"):
        assert plan.collective(1e9, flat(4, 8.0), c, spelling=spelling) == pytest.approx(
            plan.ring(1e9, 4, 8.0, 1.0, 1e-3)
        )
        assert plan.collective(1e9, node, c, spelling=spelling) == pytest.approx(7e-3 + 7 / 8 * 1e9 / 100e9)
    # 4 nodes of 8 (800 Gbit/s = 100 GB/s per GPU, 80 Gbit/s = 10 GB/s per node): a ring's 31/32 of the bytes
    # cross every GPU's link and every node's at once (the node's is slower); an all-to-all sends 8 x 24/32 of
    # them out of each node, 7/32 stay inside
    cluster = plan.Cluster(gpus=32, gpus_per_node=8, intra_gbit=800.0, inter_gbit=80.0)
    assert cluster.nodes == 4 and cluster.local == 8
    assert plan.collective(1e9, cluster, c) == pytest.approx(31e-3 + 31 / 32 * 0.1)
    assert plan.collective(1e9, cluster, c, spelling="all_to_all") == pytest.approx(31e-3 + 6 * 0.1)
    slow_inside = replace(cluster, intra_gbit=8.0)  # PCIe-like: now the GPU's own link sets the pace
    assert plan.collective(1e9, slow_inside, c) == pytest.approx(31e-3 + 31 / 32 * 1.0)
    # a round on gloo: all-to-all reduce-scatter + ring all-gather; on NCCL: two rings
    job = plan.Job(params=2.5e8, micro_batch_s=[0.1], micro_batches=4)
    assert plan.round_time(job, replace(cluster, backend="gloo"), c) == pytest.approx(62e-3 + 0.6 + 31 / 32 * 0.1)
    assert plan.round_time(job, cluster, c) == pytest.approx(2 * (31e-3 + 31 / 32 * 0.1))
    assert plan.all_reduce(1e9, cluster, c) == pytest.approx(2 * 31 / 32 * 0.1)  # the all-reduce's alpha: 0
    with pytest.raises(ValueError, match="spelling"):
        plan.collective(1e9, cluster, c, spelling="tree")


def test_int8_rounds_by_hand_two_levels_between_nodes_and_the_kernels():
    from hf_acco.comm import quant

    assert plan.INT8_BYTES == quant.packed_numel(1 << 20) / (1 << 20)  # a long row's: its alignment padding is 0
    q = plan.INT8_BYTES
    c = replace(C0, quant_s_per_element=0.0)
    # 4 nodes of 8 (100 GB/s per GPU inside, 10 GB/s per node between), 1e9 bf16 parameters: inside a node a ring
    # reduce-scatter of the 2 GB (7/8 of it, 17.5 ms); between nodes 3/4 of the int8 bytes (76 ms): the slower
    # sets the pace; then the all-gather of int8 changes, a ring over all 32 ranks (31/32 of the int8 bytes)
    cluster = plan.Cluster(gpus=32, gpus_per_node=8, intra_gbit=800.0, inter_gbit=80.0)
    job = plan.Job(params=1e9, micro_batch_s=[0.1], micro_batches=4, grad_bytes=q, param_bytes=2, gather_bytes=q)
    assert plan.int8_reduce_scatter(job, cluster, c) == pytest.approx(3 / 4 * q * 0.1)
    assert plan.round_time(job, cluster, c) == pytest.approx(3 / 4 * q * 0.1 + 31 / 32 * q * 0.1)
    # a flat all-to-all would send 8 x 24/32 of the int8 bytes out of each node: 8x the two levels' 3/4
    assert plan.collective(1e9 * q, cluster, c, spelling="all_to_all") == pytest.approx(6 * q * 0.1)
    # one node, or one GPU per node: the all-to-all over all ranks; the (de)quantising: per element, each way
    assert plan.int8_reduce_scatter(job, flat(4, 8.0), c) == pytest.approx(3 / 4 * q)
    kernels = replace(c, quant_s_per_element=1e-11)
    assert plan.round_time(job, cluster, kernels) - plan.round_time(job, cluster, c) == pytest.approx(2 * 1e-2)
    only_grads = replace(job, gather_bytes=None)  # the parameters in the model's dtype: one kernel a round
    assert plan.round_time(only_grads, cluster, kernels) - plan.round_time(only_grads, cluster, c) == pytest.approx(
        1e-2
    )
    # int4 changes: two values a byte, the same scales; the all-gather moves INT4_BYTES an element, one kernel
    assert plan.INT4_BYTES == quant.packed_numel(1 << 20, bits=4) / (1 << 20)
    int4 = replace(job, gather_bytes=plan.INT4_BYTES)
    assert plan.round_time(int4, cluster, c) == pytest.approx(3 / 4 * q * 0.1 + 31 / 32 * plan.INT4_BYTES * 0.1)
    assert plan.round_time(int4, cluster, kernels) - plan.round_time(int4, cluster, c) == pytest.approx(2 * 1e-2)


def test_step_times_of_each_method_by_hand():
    # 2 ranks on 8 Gbit/s links, 1e8 fp32 parameters: a reduce-scatter or all-gather of 400 MB takes 0.2 s
    cluster, job = flat(2, 8.0), plan.Job(params=1e8, micro_batch_s=[0.1], micro_batches=4, micro_batch_tokens=10)
    round_s = 0.4
    sync = plan.predict("sync", "fixed", job, cluster, C0)
    assert sync["step_s"] == pytest.approx(4 * 0.1 + round_s) and sync["exposed_s"] == pytest.approx(round_s)
    assert sync["tokens_per_s"] == pytest.approx(2 * 4 * 10 / 0.8)
    acco = plan.predict("acco", "fixed", job, cluster, C0)  # each half: max(2 x 0.1, 0.4)
    assert acco["step_s"] == pytest.approx(0.8) and acco["exposed_s"] == pytest.approx(0.4)
    long = replace(job, micro_batch_s=[0.25])  # each half 0.5 s of compute hides its 0.4 s round
    assert plan.predict("acco", "fixed", long, cluster, C0)["step_s"] == pytest.approx(1.0)
    with_overhead = replace(C0, overhead_s={"acco": 0.02})
    overhead = plan.predict("acco", "fixed", long, cluster, with_overhead)
    assert overhead["step_s"] == pytest.approx(1.02) and overhead["overhead_s"] == 0.02
    assert overhead["exposed_s"] == 0.0  # the overhead is not communication
    with pytest.raises(ValueError, match="one per GPU"):
        plan.predict("acco", "fixed", replace(job, micro_batch_s=[0.1, 0.2, 0.3]), cluster, C0)
    # DDP: the 0.4 s all-reduce (a 1 MiB bucket, then 25 MiB ones) overlaps the last backward (2/3 of 0.25 s);
    # the first bucket is done before the second is ready (at 26 MiB of the backward); from then on the link is
    # slower than the backward makes buckets ready, so it is busy to the end
    ddp, backward = plan.predict("ddp", "fixed", long, cluster, C0), 0.25 * 2 / 3
    assert ddp["exposed_s"] == pytest.approx(backward * 26 * 2**20 / 4e8 + (4e8 - 2**20) / 1e9 - backward)
    assert ddp["step_s"] == pytest.approx(1.0 + ddp["exposed_s"]) and ddp["comm_s"] == pytest.approx(0.4)
    fast = replace(job, params=1e6)  # a small all-reduce: the first bucket is done in the backward, the rest not
    assert plan.predict("ddp", "fixed", fast, cluster, C0)["exposed_s"] == pytest.approx((4e6 - 2**20) / 1e9)
    # bf16 gradients halve the reduce-scatter, not the all-gather of fp32 weights
    bf16 = plan.predict("sync", "fixed", replace(job, grad_bytes=2), cluster, C0)
    assert bf16["comm_s"] == pytest.approx(0.3)
    # an odd number of micro-batches: 1 + 2; one micro-batch: split in two along the batch
    odd = plan.predict("acco", "fixed", replace(long, micro_batches=3), cluster, C0)
    assert odd["step_s"] == pytest.approx(max(0.25, 0.4) + max(0.5, 0.4))
    one = plan.predict("acco", "fixed", replace(long, micro_batches=1), cluster, C0)
    assert one["compute_s"] == pytest.approx(0.25) and one["step_s"] == pytest.approx(0.8)
    with pytest.raises(ValueError, match="method"):
        plan.predict("zero3", "fixed", job, cluster, C0)


def test_dynamic_halves_are_the_claims_simulated():
    assert plan.claims_time([1.0, 1.0], 4) == pytest.approx(2.0)
    # rank 0 computes micro-batches 1 and 3 (ends at 2), rank 1 the second (ends at 2)
    assert plan.claims_time([1.0, 2.0], 3) == pytest.approx(2.0)
    assert plan.claims_time([1.0, 2.0], 6) == pytest.approx(4.0)  # rank 0: 4, rank 1: 2
    assert plan.claims_time([1.0], 0) == 0.0
    # a rank twice as slow: fixed waits for it, dynamic lets the fast rank compute more of the same global batch
    mixed = plan.Job(params=1e3, micro_batch_s=[0.1, 0.2], micro_batches=4)
    fixed = plan.predict("acco", "fixed", mixed, flat(2, 8.0), C0)
    dynamic = plan.predict("acco", "paced", mixed, flat(2, 8.0), C0)
    assert fixed["step_s"] == pytest.approx(0.8) and dynamic["step_s"] == pytest.approx(0.6)
    same = plan.Job(params=1e3, micro_batch_s=[0.1], micro_batches=4)
    assert plan.predict("acco", "paced", same, flat(4, 8.0), C0)["step_s"] == pytest.approx(
        plan.predict("acco", "fixed", same, flat(4, 8.0), C0)["step_s"]
    )


def test_fit_recovers_the_constants_that_made_the_measurements():
    truth = plan.Constants(alpha_s={"round": 2e-3, "all_reduce": 1e-3}, efficiency={"round": 0.8, "all_reduce": 0.6})
    points = []
    for p in (2, 4, 8):
        for nbytes, mbit in ((1.6e7, 200.0), (4e6, 100.0)):
            cluster = flat(p, mbit / 1000)
            for kind in ("round", "all_reduce"):
                seconds = 2 * plan.collective(nbytes, cluster, truth, kind)
                points.append({"kind": kind, "world_size": p, "bytes": nbytes, "link_mbit": mbit, "seconds": seconds})
    job, cluster = plan.Job(params=1e6, micro_batch_s=[0.25], micro_batches=4), flat(2, 0.2)
    model = {m: plan.predict(m, "fixed", job, cluster, truth)["step_s"] for m in ("acco", "sync")}
    # what each method's steps took beyond the model: 30 ms for acco (median of 3), less than nothing for sync
    observed = [("acco", "fixed", job, cluster, model["acco"] + extra) for extra in (0.01, 0.03, 0.2)]
    observed.append(("sync", "fixed", job, cluster, model["sync"] - 0.01))
    got = plan.fit(points, observed)
    assert got.alpha_s == pytest.approx({"round": 2e-3, "all_reduce": 1e-3})
    assert got.efficiency == pytest.approx({"round": 0.8, "all_reduce": 0.6})
    assert got.overhead_s == pytest.approx({"acco": 0.03, "sync": 0.0, "ddp": 0.0}) and got.source == "fitted"
    falling = [{"kind": "round", "world_size": 2, "bytes": b, "link_mbit": 100.0, "seconds": t}
               for b, t in ((1e6, 2.0), (2e6, 1.0), (3e6, 0.5))]  # fmt: skip
    with pytest.raises(ValueError, match="non-positive 1 / efficiency"):
        plan.fit(falling)
    with pytest.raises(ValueError, match="cannot separate"):
        plan.fit([{"kind": "round", "world_size": 2, "bytes": 0.0, "link_mbit": 1.0, "seconds": 1.0}])


def test_recommendation_follows_the_cost_model():
    cluster = flat(8, 1.0)
    # communication negligible: every method is as fast; the smallest batch, the simplest method (DDP)
    cheap = plan.Job(params=1e3, micro_batch_s=[0.1], micro_batches=8)
    choice = plan.recommend(cheap, cluster, C0)["choice"]
    assert (choice["method"], choice["micro_batches"]) == ("ddp", 1)
    # a round of 2 x 7/8 x 4e7 B at 125 MB/s = 0.56 s: ACCO hides it behind 4 micro-batches of 0.14 s per half
    heavy = plan.Job(params=1e7, micro_batch_s=[0.14], micro_batches=8)
    rec = plan.recommend(heavy, cluster, C0)
    assert (rec["choice"]["method"], rec["choice"]["accumulation"], rec["choice"]["micro_batches"]) == (
        "acco", "fixed", 8)  # fmt: skip
    assert rec["choice"]["tokens_per_s"] == rec["best_tokens_per_s"]
    assert {o["accumulation"] for o in rec["options"]} == {"fixed"}  # equal speeds: dynamic is left out
    assert [o["micro_batches"] for o in rec["options"] if o["method"] == "ddp"] == [1, 2, 4, 8]
    assert {o["grad_bytes"] for o in rec["options"] if o["method"] == "acco"} == {4, 2}  # fp32 and bf16 wires
    assert plan.candidates(6) == [1, 2, 4, 6] and plan.candidates(1) == [1]
    mixed = replace(heavy, micro_batch_s=[0.14] * 4 + [0.28] * 4)  # half the cluster twice as slow
    assert plan.recommend(mixed, cluster, C0)["choice"]["accumulation"] == "paced"


def test_the_planner_command_prints_its_table_and_refuses_what_it_cannot_plan(tmp_path):
    argv = ["--params", "1.3e9", "--gpus", "32", "--gpus_per_node", "8", "--inter_gbit", "50",
            "--micro_batch_s", "0.32", "--micro_batches", "8"]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "hf_acco.plan", *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for row in ("| DDP (Trainer) |", "| ZeRO-1 |", "| ACCO fixed |", "| ACCO paced |", "Recommended: ACCO fixed",
                "acco_comm_dtype=", "acco_bucket_numel=", "alpha 20 / 20 us", "fitted with gloo on CPU ranks",
                "The formulas: --explain."):  # fmt: skip
        assert row in done.stdout
    assert "ring(B, p, bw) =" not in done.stdout and len(done.stdout.splitlines()) < 25  # one screen
    explained = subprocess.run([sys.executable, "-m", "hf_acco.plan", *argv, "--explain"], capture_output=True,
                               text=True, timeout=60).stdout  # fmt: skip
    assert "ring(B, p, bw) =" in explained
    out = plan.main([*argv, "--json"])
    # the flags every CLI of the project shares, and the planner's own spellings of them
    spelled = ["--world_size" if a == "--gpus" else a for a in argv]
    assert plan.main([*spelled, "--param_dtype", "bf16", "--quiet"]) == plan.main(
        [*argv, "--model_dtype", "bf16", "--quiet"]
    )
    assert set(out["predictions"]) == {"ddp:fixed", "sync:fixed", "acco:fixed", "acco:paced"}
    constants = tmp_path / "constants.json"
    constants.write_text(json.dumps({"alpha_s": 1e-3, "efficiency": {"round": 0.5, "all_reduce": 0.5}}))
    slower = plan.main([*argv, "--json", "--backend", "gloo", "--constants", str(constants)])
    assert slower["predictions"]["sync:fixed"]["comm_s"] > out["predictions"]["sync:fixed"]["comm_s"]
    gloo = plan.main([*argv, "--json", "--backend", "gloo"])  # the fitted alpha: TCP's milliseconds
    assert gloo["constants"]["alpha_s"] == plan.FITTED.alpha_s
    # gloo's reduce-scatter is an all-to-all: between 4 nodes of 8 it moves 6x a ring's bytes out of each node
    nccl_like = plan.main([*argv, "--json", "--alpha_us", "0"])
    assert gloo["predictions"]["sync:fixed"]["comm_s"] > 3 * nccl_like["predictions"]["sync:fixed"]["comm_s"]
    assert out["constants"]["alpha_s"]["round"] == pytest.approx(20e-6)
    stated = plan.main([*argv, "--json", "--backend", "gloo", "--alpha_us", "1000", "--efficiency", "0.5"])
    assert stated["predictions"]["sync:fixed"]["comm_s"] == pytest.approx(
        slower["predictions"]["sync:fixed"]["comm_s"]
    )
    mixed = plan.main([*argv[:-4], "--micro_batch_s", "0.32", "0.64", "--group_gpus", "16", "16", "--json"])
    assert mixed["predictions"]["acco:paced"]["step_s"] < mixed["predictions"]["acco:fixed"]["step_s"]
    for bad, why in ((["--micro_batch_s", "0.1", "0.2"], "--group_gpus"), ([], "--micro_batch_s"),
                     (["--micro_batch_s", "0.1", "--group_gpus", "3"], "adding up")):  # fmt: skip
        done = subprocess.run([sys.executable, "-m", "hf_acco.plan", *argv[:6], *bad], capture_output=True,
                              text=True, timeout=60)  # fmt: skip
        assert done.returncode != 0 and why in done.stderr


def synthetic_run(world_size, method, step, k=4, acc="fixed", setting=None, tokens_per_s=None):
    return {"setting": setting or f"scaling_ws{world_size}", "world_size": world_size, "method": method,
            "accumulation": acc, "micro_batches": k, "link_mbit": 200.0, "params": 4e6,
            "t_micro_s": [0.3] * world_size,
            "round_alone_s": 0.64 * 2 * (world_size - 1) / world_size + 0.01 * (world_size - 1),
            "all_reduce_alone_s": 0.7 * 2 * (world_size - 1) / world_size + 0.01 * (world_size - 1),
            "step_time_s": step,
            "tokens_per_s": tokens_per_s or k / step}  # fmt: skip


def test_the_scaling_benchmark_fits_predicts_and_checks_the_recommendation():
    from hf_acco.tools.bench import scaling

    # rounds alone made with alpha 5 ms and efficiency 1 (16 MB at 25 MB/s: 0.64 s for 2 x (p-1)/p of it)
    runs = [synthetic_run(p, m, 1.34 if p == 2 else 1.3) for p in (2, 4, 8) for m in ("acco", "sync", "ddp")]
    c = scaling.fit_constants(runs)
    assert c.alpha_s == pytest.approx({"round": 0.005, "all_reduce": 0.005})
    assert c.efficiency["round"] == pytest.approx(1.0)
    assert c.efficiency["all_reduce"] == pytest.approx(0.64 / 0.7)
    # the step overheads from the 2-rank runs only: acco's halves max(2 x 0.3 s, round 0.65 s), 1.34 s measured;
    # sync's 4 x 0.3 + 0.65 s is above its 1.34 s: none
    assert c.overhead_s["acco"] == pytest.approx(1.34 - 2 * 0.65) and c.overhead_s["sync"] == 0.0
    assert "2 ranks" in c.source
    sync8 = next(r for r in runs if (r["world_size"], r["method"]) == (8, "sync"))
    assert scaling.predict_run(sync8, c) == pytest.approx(4 * 0.3 + sync8["round_alone_s"])
    # the check: the planner's choice against every candidate measured (tokens/s)
    check = [synthetic_run(4, m, 1.0, k=k, setting="check", tokens_per_s=t)
             for (m, k), t in {("ddp", 2): 1.0, ("sync", 2): 0.9, ("acco", 2): 1.2, ("ddp", 4): 1.5,
                               ("sync", 4): 1.3, ("acco", 4): 2.0}.items()]  # fmt: skip
    out = scaling.check_recommendation(check, c)
    assert out["recommended"] == ["acco", "fixed", 4] and out["best"] == ["acco", "fixed", 4]
    assert out["recommended_over_best"] == 1.0 and len(out["candidates_measured"]) == 6
    for r in runs + check:
        r["predicted_step_time_s"] = scaling.predict_run(r, c)
    table = scaling.table(runs + check, out)
    assert table.count("(emulated)") == 15 and "Recommendation check at check" in table


def test_the_multinode_benchmark_predicts_each_run_from_its_nodes(tmp_path):
    """The multi-node benchmark's bookkeeping: a run of 2 nodes x 2 ranks is predicted as gloo on that cluster
    (all-to-all reduce-scatter: the node's uplink carries 2 x 2/4 of the gradients, the ring all-gather 3/4 of
    the parameters), with the committed constants; the table has every run; ``--from_json`` predicts again."""
    from hf_acco.tools.bench import multinode

    runs = [
        {**synthetic_run(4, m, 3.0, acc=a, setting="nodes2x2"), "nodes": 2, "ranks_per_node": 2}
        for m, a in multinode.METHODS
    ]
    multinode.predict(runs, C0)
    wire = 4 * 4e6 / (200e6 / 8)  # seconds for the gradients (or fp32 parameters) once over a 200 Mbit/s uplink
    sync = next(r for r in runs if r["method"] == "sync")
    assert sync["predicted_step_time_s"] == pytest.approx(4 * 0.3 + wire * (1 + 3 / 4))
    one_per_node = plan.predict("sync", "fixed", plan.Job(4e6, [0.3], 4), flat(4, 0.2), C0)["step_s"]
    assert one_per_node == pytest.approx(4 * 0.3 + wire * 2 * 3 / 4)  # the scaling benchmark's bridge
    table = multinode.table(runs)
    assert table.count("| 2 x 2 (emulated) |") == 4 and "acco paced" in table
    (tmp_path / "in.json").write_text(json.dumps({"command": "x", "runs": runs}))
    again = multinode.main(["--from_json", str(tmp_path / "in.json"), "--out", str(tmp_path / "out")])
    assert all(r["predicted_step_time_s"] > 0 for r in again["runs"]) and (tmp_path / "out" / "table.md").exists()
    with pytest.raises(SystemExit):
        multinode.main(["--nodes", "1"])


@pytest.mark.parametrize(
    ("tool", "argv", "said"),
    [
        ("plan", ["--params=-1e9", "--world_size", "8", "--micro_batch_s", "0.3"], "argument --params: must be > 0"),
        ("plan", ["--params", "1e9", "--world_size", "0", "--micro_batch_s", "0.3"], "--gpus: must be >= 1"),
        ("plan", ["--params", "1e9", "--world_size", "8", "--micro_batch_s", "-0.3"], "--micro_batch_s: must be > 0"),
        ("plan", ["--params", "1e9", "--world_size", "8", "--micro_batch_s", "0.3", "--micro_batches", "0"],
         "--micro_batches: must be >= 1"),
        ("plan", ["--params", "1e9", "--world_size", "12", "--micro_batch_s", "0.3"],
         "--world_size (12) is whole nodes of --gpus_per_node (8)"),
        ("plan", ["--params", "1e9", "--world_size", "8", "--micro_batch_s", "0.3", "--efficiency", "2"],
         "--efficiency: is a share of the link rate, in (0, 1]"),
        ("plan", ["--params", "many", "--world_size", "8", "--micro_batch_s", "0.3"], "expected a number, got 'many'"),
        ("memory", ["--params=-7e9"], "argument --params: must be > 0"),
        ("memory", ["--params", "7e9", "--world_size", "0"], "argument --world_size: must be >= 1"),
        ("memory", ["--params", "7e9", "--gpus_per_node", "0"], "argument --gpus_per_node: must be >= 1"),
        ("memory", ["--params", "7e9", "--world_size", "8", "--fsdp_shard", "3"], "3 does not divide 8"),
        ("memory", ["--params", "7e9", "--world_size", "12"], "--world_size (12) is whole machines of"),
        ("plan", ["--params", "1e9", "--world_size", "8", "--gpu", "h200", "--mfu", "0"], "--mfu: must be > 0"),
        ("plan", ["--config", "/nonexistent", "--world_size", "8", "--micro_batch_s", "0.3"], "no config.json at"),
        ("plan", ["--params", "1e9", "--world_size", "8", "--micro_batch_s", "0.3", "--seq_len", "0"],
         "--seq_len: must be >= 1"),
        ("memory", ["--params", "7e9", "--micro_batch_size", "2"], "--micro_batch_size (activations) needs --config"),
        ("memory", ["--config", "/nonexistent"], "no config.json at"),
        ("memory", ["--params", "7e9", "--gpu_gib", "0"], "--gpu_gib: must be > 0"),
    ],
)  # fmt: skip
def test_bad_input_is_one_line_naming_the_flag_and_exit_code_2(tool: str, argv: list[str], said: str, capsys) -> None:
    from hf_acco.tools import memory
    from hf_acco.tools.plan import cli

    with pytest.raises(SystemExit) as exited:
        (cli.main if tool == "plan" else memory.main)(argv)
    err = capsys.readouterr().err
    assert exited.value.code == 2 and said in err and "Traceback" not in err, err
    assert err.strip().splitlines()[-1].startswith(f"python -m hf_acco.{tool}: error: ")


def test_the_planner_keeps_the_global_batch_and_recommends_only_what_fits() -> None:
    """7B bf16 on one machine of 8 x 80 GB: DDP needs 126 GB per GPU (and the allowance for the CUDA context and one
    NCCL communicator); the recommendation is a setting that fits, at the user's 8 micro-batches per step (every
    row); 70B on the same machine fits nothing, and the planner says what would (FSDP inside machines)."""
    argv = ["--params", "7e9", "--world_size", "8", "--micro_batch_s", "0.8", "--micro_batches", "8",
            "--gpu_gib", "80"]  # fmt: skip
    out = plan.main([*argv, "--quiet"])
    gpu = 80 * 2**30
    assert out["predictions"]["ddp:fixed"]["memory_bytes"] == 126e9 + 1.5 * 2**30 > gpu
    choice = out["recommendation"]
    assert choice["method"] != "ddp" and choice["memory_bytes"] < gpu and choice["micro_batches"] == 8
    job = plan.job_from_args(plan.make_parser().parse_args(argv), plan.make_parser())
    cluster = plan.Cluster(8, 8, 3600.0, 100.0)
    options = plan.recommend(job, cluster, plan.FITTED, ks=[8])["options"]
    assert {o["micro_batches"] for o in options} == {8}
    text = plan.report(job, cluster, plan.FITTED)
    assert "127.6 (does not fit)" in text and "DDP (Trainer) needs 127.6 GB" in text
    assert "a global batch of 1,048,576 tokens, the same in every row" in text
    big = plan.main(["--params", "70e9", "--world_size", "8", "--micro_batch_s", "8", "--quiet"])
    assert big["recommendation"] is None
    assert any(f.startswith("8 machines of 8 GPUs with FSDP inside each") for f in big["what_would_fit"]), big


def test_the_planner_reads_the_parameter_count_from_a_config(tmp_path) -> None:
    from transformers import LlamaConfig

    from hf_acco.tools.model_shape import activation_bytes, shape_from_config

    LlamaConfig(vocab_size=1000, hidden_size=64, intermediate_size=172, num_hidden_layers=2,
                num_attention_heads=4).save_pretrained(tmp_path)  # fmt: skip
    argv = ["--world_size", "8", "--micro_batch_size", "4", "--seq_len", "512", "--quiet"]
    shape = shape_from_config(tmp_path)
    by_config = plan.main([*argv, "--micro_batch_s", "0.1", "--config", str(tmp_path)])
    by_count = plan.main([*argv, "--micro_batch_s", "0.1", "--params", str(shape.params)])
    activations = activation_bytes(shape, 4 * 512, checkpointing=False)  # counted once the shape is known
    for key, predicted in by_count["predictions"].items():
        assert by_config["predictions"][key]["step_s"] == predicted["step_s"]
        assert by_config["predictions"][key]["memory_bytes"] == predicted["memory_bytes"] + activations
    # --gpu: the micro-batch's time from the GPU's bf16 peak and the MFU, its memory for --gpu_gib
    h100 = plan.main([*argv, "--params", "1e9", "--gpu", "h100-80gb", "--mfu", "0.5", "--json"])
    assert h100["gpu_gib"] == 80.0
    assert h100["predictions"]["ddp:fixed"]["compute_s"] == pytest.approx(8 * 6 * 1e9 * 2048 / (989e12 * 0.5))


def _calibrate(rank: int, world_size: int, out: str) -> dict:
    from hf_acco.tools.plan import calibrate

    return calibrate.main(["--link_gbit", "10", "--sizes", "1e6", "4e6", "8e6", "--repeats", "3", "--out", out])


def test_calibration_on_the_users_ranks_writes_constants_the_planner_reads(tmp_path) -> None:
    """hf_acco.tools.plan.calibrate on 2 gloo ranks: its fit explains its own measurements, and the planner with
    --constants uses it and says so."""
    from hf_acco.tools.multiprocess import run_ranks

    out = tmp_path / "constants.json"
    result = run_ranks(_calibrate, world_size=2, backend=None, out=str(out))[0]
    saved = json.loads(out.read_text())
    assert saved["source"].startswith("calibrated on this cluster (2 ranks, gloo")
    c = plan.load_constants(out)
    for pt in result["points"]:  # the fitted model reproduces its measurements
        bw = pt["link_mbit"] * 1e6 / 8
        model = 2 * (pt["world_size"] - 1) * (c.alpha_s[pt["kind"]] + pt["bytes"] / pt["world_size"] /
                                              (c.efficiency[pt["kind"]] * bw))  # fmt: skip
        if pt["bytes"] == 4 * 8e6:  # the largest: the rate, not the latency or the noise of a shared machine
            assert 1 / 3 < model / pt["seconds"] < 3.0, (pt, model)
    text = subprocess.run([sys.executable, "-m", "hf_acco.plan", "--params", "1e9", "--world_size", "8",
                           "--micro_batch_s", "0.5", "--constants", str(out)], capture_output=True, text=True,
                          check=True).stdout  # fmt: skip
    assert "calibrated on this cluster" in text


def test_with_the_activations_counted_gradient_checkpointing_is_named_when_it_alone_would_fit(tmp_path) -> None:
    """A 7B Llama config (built on the meta device), micro-batches of 8 x 2048 tokens on 2 x 8 A100 80 GB: the
    activations alone overflow the GPU; checkpointing is the first thing that would fit."""
    from transformers import LlamaConfig

    LlamaConfig(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
                num_attention_heads=32).save_pretrained(tmp_path)  # fmt: skip
    argv = ["--config", str(tmp_path), "--world_size", "16", "--gpu", "a100-80gb", "--micro_batch_size", "8"]
    out = plan.main([*argv, "--quiet"])
    assert out["recommendation"] is None and out["what_would_fit"][0].startswith("gradient_checkpointing=True")
    fits = plan.main([*argv, "--gradient_checkpointing", "--quiet"])["recommendation"]
    assert fits is not None and fits["micro_batches"] == 8


def test_fsdp_mode_is_the_step_across_nodes_of_one_shard_per_node_by_hand() -> None:
    """--fsdp: each GPU's FSDP shard (P / g) crosses between the n nodes over its share of the node's network
    (inter / g), all g shards at once: HSDP is DDP's all-reduce of the shard, HSDP-ACCO fixed hides a round of it
    behind each half; tokens/s count every GPU; a node's micro-batch is its slowest GPU's."""
    from hf_acco.tools.plan import fsdp

    c = replace(plan.FITTED, alpha_s={"round": 0.0, "all_reduce": 0.0})
    job = plan.Job(params=32e9, micro_batch_s=[2.0], micro_batches=8, micro_batch_tokens=4096, grad_bytes=2,
                   param_bytes=2)  # fmt: skip
    cluster = plan.Cluster(gpus=32, gpus_per_node=8, intra_gbit=3600, inter_gbit=80)
    shard, across = fsdp.view(job, cluster)
    bw = lambda kind: c.efficiency[kind] * 10e9 / 8  # noqa: E731 - 80 / 8 Gbit/s per shard's group
    round_s = 2 * 3 / 4 * 4e9 * 2 / bw("round")  # reduce-scatter + all-gather of 4e9 bf16 elements over 4 nodes
    acco = plan.predict("acco", "fixed", shard, across, c)
    assert acco["comm_s"] == pytest.approx(2 * round_s)
    assert acco["step_s"] == pytest.approx(2 * max(4 * 2.0, round_s))
    assert acco["tokens_per_s"] == pytest.approx(32 * 8 * 4096 / acco["step_s"])
    hsdp = plan.predict("ddp", "fixed", shard, across, c)
    assert hsdp["comm_s"] == pytest.approx(2 * 3 / 4 * 4e9 * 2 / bw("all_reduce"))
    slow = fsdp.view(replace(job, micro_batch_s=[1.0] * 31 + [3.0]), cluster)[0]
    assert slow.micro_batch_s == [1.0, 1.0, 1.0, 3.0]  # the node holding the slow GPU waits for it
    assert fsdp.check(plan.Cluster(8, 8, 3600, 80)) and fsdp.check(plan.Cluster(4, 1, 3600, 80))


def test_the_planner_plans_fsdp_inside_nodes_and_predicts_the_hsdp_benchmark() -> None:
    """The command with --fsdp: HSDP and HSDP-ACCO rows, each one's memory per GPU (hf_acco.memory --fsdp_shard),
    the setting as training arguments; one node is refused. The committed HSDP benchmark's runs, predicted again
    from their measured settings: within 5 % of each measured step (1 % when they were measured)."""
    from hf_acco.tools.bench import hsdp

    argv = ["--params", "34e9", "--gpus", "32", "--gpus_per_node", "8", "--inter_gbit", "25", "--micro_batch_s",
            "2.0", "--micro_batches", "16", "--fsdp", "--comm_dtype", "int8", "--gather_dtype", "int8"]  # fmt: skip
    done = subprocess.run([sys.executable, "-m", "hf_acco.plan", *argv], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    for text in ("| HSDP (Trainer) |", "| HSDP-ACCO sync |", "| HSDP-ACCO fixed |", "Recommended: HSDP-ACCO fixed",
                 "ParallelismConfig(dp_replicate_size=4, dp_shard_size=8)", "acco_comm_dtype='int8'"):  # fmt: skip
        assert text in done.stdout
    out = plan.main([*argv, "--quiet"])
    assert set(out["predictions"]) == {"ddp:fixed", "sync:fixed", "acco:fixed"}
    gib = out["predictions"]["acco:fixed"]["memory_bytes"]
    assert gib == engine_memory(int(34e9), 32, param_dtype=torch.bfloat16, comm_dtype="int8",
                                gather_dtype="int8", fsdp_shard=8).device_bytes  # fmt: skip
    one_node = subprocess.run([sys.executable, "-m", "hf_acco.plan", *argv[:2], "--gpus", "8", *argv[4:]],
                              capture_output=True, text=True, timeout=60)  # fmt: skip
    assert one_node.returncode == 2 and "--fsdp needs 2 nodes or more" in one_node.stderr
    runs = json.loads((ROOT / "recipes/results/hsdp/benchmark.json").read_text())["runs"]
    again = [dict(r) for r in runs]
    hsdp.predict(again)
    for r in again:
        assert r["predicted_step_time_s"] == pytest.approx(r["step_time_s"], rel=0.05), r["method"]


@pytest.mark.parametrize("fsdp", [False, True], ids=["acco", "fsdp-inside"])
def test_the_planner_never_recommends_a_setting_that_leaves_less_than_the_margin(fsdp: bool) -> None:
    """7B-70B on the README's clusters and on 2-16 machines of 8, each wire: a recommended setting's memory per GPU
    (the engine's peak, FSDP's working set, the CUDA context's and NCCL's allowance) leaves at least the margin,
    10 % of the GPU, for the activations; what would fit instead leaves it too."""
    from hf_acco.tools.device_memory import GIB, margin_bytes
    from hf_acco.tools.plan.cli import EXAMPLES

    clusters = [(argv[argv.index("--world_size") + 1], argv[argv.index("--inter_gbit") + 1] if "--inter_gbit" in argv
                 else "100") for _, argv in EXAMPLES]  # fmt: skip
    clusters += [(str(8 * n), "100") for n in (2, 4, 8, 16)]
    floor, checked = margin_bytes(80), 0
    for params in ("7e9", "13e9", "34e9", "70e9"):
        for world, inter in clusters:
            if fsdp and int(world) < 16:
                continue  # (FSDP inside machines needs 2 of them)
            for wire in ("auto", "int8"):
                argv = ["--params", params, "--world_size", world, "--gpus_per_node", "8", "--inter_gbit", inter,
                        "--micro_batch_s", "8", "--comm_dtype", wire, "--quiet"]  # fmt: skip
                out = plan.main(argv + (["--fsdp"] if fsdp else []))
                choice = out["recommendation"]
                if choice is not None:
                    checked += 1
                    assert 80 * GIB - choice["memory_bytes"] >= floor, (argv, choice["memory_bytes"])
                for fix in out["what_would_fit"]:
                    need = float(fix.split(" GB per GPU")[0].rsplit(" ", 1)[1]) * 1e9
                    assert 80 * GIB - need >= floor - 0.05e9, (argv, fix)  # (printed to 0.1 GB)
    assert checked >= 10  # (not a test that recommends nothing)
