"""Token weights at zero and at 2x: scripts written for Trainer+DDP, with the classes swapped, train as they did.

Trainer+DDP (transformers 5.24), on a window with no label token: ``num_items_in_batch`` is 0, the loss 0/0 (NaN,
logged as 0 by the NaN filter), its gradient exactly 0 (cross-entropy writes no gradient for ignored targets), and
the step is taken: DDP averages over every rank, and AdamW's momentum and weight decay move the parameters.
``sync`` (ZeRO-1) must end where DDP ends; ``acco`` must train through (no error) and stay close.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from .helpers import HostReads, rel
from .scripts import trainer_script
from .test_trainer import flat, losses, train

# Sequential order, 2 ranks x 2 rows per micro-batch: micro-batch k of rank r holds examples 4k + 2r and 4k + 2r + 1.
SEQUENTIAL = {"train_sampling_strategy": "sequential", "gradient_accumulation_steps": 2}
CASES = {
    # step 2 (micro-batches 2 and 3): no label token on any rank
    "a step without labels": ({**SEQUENTIAL}, "8,9,10,11,12,13,14,15"),
    # step 2's first micro-batch (acco's half A) has none on any rank, its second has some
    "a half without labels": ({**SEQUENTIAL}, "8,9,10,11"),
    # tokens not averaged across devices: rank 1's whole window of step 2 has none, rank 0's has some
    "one rank's window without labels": ({**SEQUENTIAL, "average_tokens_across_devices": False}, "10,11,14,15"),
}


def grad_norms(result: dict) -> list[float]:
    return [h.get("grad_norm") for h in result["log_history"] if "loss" in h]


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory) -> tuple[str, dict, str, list[dict]]:
    extra, empty = CASES[request.param]
    ddp = train(tmp_path_factory.mktemp("ddp"), acco=False, max_steps=6, empty_examples=empty, extra=extra)
    return request.param, extra, empty, ddp


def test_sync_matches_trainer_ddp_without_label_tokens(tmp_path: Path, case) -> None:
    name, extra, empty, ddp = case
    ours = train(tmp_path, acco=True, max_steps=6, empty_examples=empty, extra={**extra, "acco_schedule": "sync"})
    assert losses(ours[0]) == pytest.approx(losses(ddp[0]), rel=1e-5)
    assert grad_norms(ours[0]) == pytest.approx(grad_norms(ddp[0]), rel=1e-4, abs=1e-7)
    assert rel(flat(ours[0]["params"]), flat(ddp[0]["params"])) < 1e-6
    assert all(torch.isfinite(p).all() for p in ours[0]["params"].values())
    if name == "a step without labels":  # DDP logs 0 there; the step still moved the parameters (weight decay)
        assert losses(ddp[0])[1] == 0.0 and grad_norms(ddp[0])[1] == 0.0


def test_acco_trains_through_without_label_tokens(tmp_path: Path, case) -> None:
    name, extra, empty, ddp = case
    ours = train(tmp_path, acco=True, max_steps=6, empty_examples=empty, extra=extra)
    assert all(torch.isfinite(p).all() for p in ours[0]["params"].values())
    assert torch.equal(flat(ours[0]["params"]), flat(ours[1]["params"]))
    first = [a for a, b in zip(losses(ours[0]), losses(ddp[0])) if b > 0]
    gaps = [abs(a - b) / b for a, b in zip(first, [b for b in losses(ddp[0]) if b > 0])]
    assert max(gaps) < 0.01, gaps
    assert rel(flat(ours[0]["params"]), flat(ddp[0]["params"])) < 1e-2


def test_a_split_micro_batch_of_a_mean_loss_model_counts_once(tmp_path: Path) -> None:
    """acco with gradient_accumulation_steps=1 splits each micro-batch into two halves. A model that takes Trainer's
    loss kwargs but returns a mean: the step's loss, gradient norm and update are Trainer+DDP's, not twice them.
    Step 1 of acco equals DDP's step 1 (both halves compute at θ_0); its norm is logged at step 2."""
    options = {"max_steps": 2, "mean_loss_model": True, "unmasked": True, "extra": {"gradient_accumulation_steps": 1}}
    ddp = train(tmp_path / "ddp", acco=False, **options)
    ours = train(tmp_path / "acco", acco=True, **{**options, "max_steps": 1})
    assert losses(ours[0])[0] == pytest.approx(losses(ddp[0])[0], rel=1e-5)
    two = train(tmp_path / "acco2", acco=True, **options)
    assert grad_norms(two[0])[1] == pytest.approx(grad_norms(ddp[0])[0], rel=1e-4)
    one_step = train(tmp_path / "ddp1", acco=False, **{**options, "max_steps": 1})
    assert rel(flat(ours[0]["params"]), flat(one_step[0]["params"])) < 1e-5


def test_training_step_outside_train_is_trainers(tmp_path: Path) -> None:
    """A one-step check, as users and transformers' own tests write it: the loss and the gradients of Trainer's
    training_step (no ACCO engine before train())."""
    from transformers import LlamaConfig, Trainer, TrainingArguments

    from hf_acco import ACCOConfig, ACCOTrainer

    results = []
    for trainer_cls, args_cls in ((Trainer, TrainingArguments), (ACCOTrainer, ACCOConfig)):
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
        config.num_attention_heads = config.num_key_value_heads = 2
        config.max_position_embeddings = 16
        model = trainer_script.LlamaForCausalLM(config)
        args = args_cls(output_dir=str(tmp_path), use_cpu=True, report_to=[], per_device_train_batch_size=2)
        data = trainer_script.make_dataset(8, 1)
        trainer = trainer_cls(model=model, args=args, train_dataset=data)
        inputs = trainer.data_collator([data[i] for i in range(2)])
        tokens = (inputs["labels"][:, 1:] != -100).sum()  # as Trainer counts num_items_in_batch
        loss = trainer.training_step(trainer.model, inputs, tokens)
        results.append((loss, [p.grad.clone() for p in model.parameters()]))
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b) and all(torch.equal(a, b) for a, b in zip(grads_a, grads_b))


def _counting_evals(rank: int, world_size: int, argv: list[str]) -> dict:
    from hf_acco import ACCOOptimizer

    calls = []
    original = ACCOOptimizer.eval
    ACCOOptimizer.eval = lambda self: (calls.append(1), original(self))[1]
    try:
        result = trainer_script.main(argv)
    finally:
        ACCOOptimizer.eval = original
    return {"evals": len(calls), "params": result["params"]}


def test_save_model_loads_the_committed_parameters_on_the_writing_rank_only(tmp_path: Path) -> None:
    from hf_acco.tools.multiprocess import run_ranks

    argv = ["--output_dir", str(tmp_path), "--acco", "--max_steps", "8", "--save_steps", "4"]
    writer, other = run_ranks(_counting_evals, world_size=2, backend=None, argv=argv, timeout=180)
    assert writer["evals"] >= 3 and other["evals"] == 0  # two checkpoints and the final save_model
    assert torch.equal(flat(writer["params"]), flat(other["params"]))


def _custom_optimizer(rank: int, world_size: int, out: str) -> dict:
    """transformers' test_custom_optimizer, with the classes swapped: the user's SGD at lr 1.0 and a constant
    schedule, then ``trainer.optimizer.state_dict()["param_groups"][0]["lr"]``."""
    from transformers import LlamaConfig

    from hf_acco import ACCOConfig, ACCOTrainer

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2)
    config.num_attention_heads = config.num_key_value_heads = 2
    model = trainer_script.LlamaForCausalLM(config)
    args = ACCOConfig(output_dir=out, use_cpu=True, report_to=[], max_steps=2, gradient_accumulation_steps=2)
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)
    schedule = torch.optim.lr_scheduler.LambdaLR(sgd, lambda step: 1.0)
    data = trainer_script.make_dataset(16, 1)
    trainer = ACCOTrainer(model=model, args=args, train_dataset=data, optimizers=(sgd, schedule))
    trainer.train()
    state = trainer.optimizer.state_dict()
    return {"keys": sorted(state), "groups": state["param_groups"], "trainable": len(list(model.parameters()))}


def test_the_optimizer_state_dict_has_torchs_keys(tmp_path: Path) -> None:
    from hf_acco.tools.multiprocess import run_ranks

    (got,) = run_ranks(_custom_optimizer, world_size=1, backend=None, out=str(tmp_path), timeout=120)
    assert {"state", "param_groups", "master", "optim_state"} <= set(got["keys"])
    assert got["groups"][0]["lr"] == 1.0
    assert sorted(i for g in got["groups"] for i in g["params"]) == list(range(got["trainable"]))


def _host_reads(rank: int, world_size: int, argv: list[str]) -> dict:
    """Every tensor read on the host (``.item()``, ``float()``: aten._local_scalar_dense, a device sync on a GPU)
    by the main thread inside ACCOTrainer's training_step, outside the model's forward (the model's own:
    transformers' mask code reads one), per micro-batch; and inside the engine's ``step()`` (the step's end)."""
    from hf_acco import ACCOOptimizer, ACCOTrainer

    reads: list[int] = []
    step_reads: list[int] = []
    in_model = [False]
    wrapped: list[bool] = []  # the model training_step gets: never DDP (ACCO's rounds average the gradients)

    original, original_step = ACCOTrainer.training_step, ACCOOptimizer.step

    def counted_step(self, *args, **kwargs):  # noqa: ANN001, ANN202
        step_reads.append(0)
        with HostReads(step_reads, ignore=lambda: in_model[0]):
            return original_step(self, *args, **kwargs)

    def counted(self, model, *args, **kwargs):  # noqa: ANN001, ANN202
        if not reads:
            model.register_forward_pre_hook(lambda *a: in_model.__setitem__(0, True))
            model.register_forward_hook(lambda *a: in_model.__setitem__(0, False))
        reads.append(0)
        wrapped.append(isinstance(model, torch.nn.parallel.DistributedDataParallel))
        with HostReads(reads, ignore=lambda: in_model[0]):
            return original(self, model, *args, **kwargs)

    ACCOTrainer.training_step, ACCOOptimizer.step = counted, counted_step
    try:
        trainer_script.main(argv)
    finally:
        ACCOTrainer.training_step, ACCOOptimizer.step = original, original_step
    return {"reads": reads, "step_reads": step_reads, "ddp": any(wrapped)}


@pytest.mark.parametrize("schedule", ["acco", "sync"])
def test_the_main_thread_never_reads_the_device_in_a_step(tmp_path: Path, schedule: str) -> None:
    """Trainer's token counts (num_items_in_batch, the labels) stay where the batch is, and the engine's main
    thread never reads them (nor anything else on the device): not per micro-batch, not at acco's A->B boundary
    (the 2nd micro-batch of 4), not at the step's end (Trainer's optimizer.step()). The round reads a half's
    weight on its own thread and stream; a read here would make the host wait for the queued compute."""
    from hf_acco.tools.multiprocess import run_ranks

    extra = json.dumps({"acco_schedule": schedule, "gradient_accumulation_steps": 4})
    argv = ["--output_dir", str(tmp_path), "--acco", "--max_steps", "3", "--extra", extra]
    got = run_ranks(_host_reads, world_size=2, backend=None, argv=argv, timeout=180)[0]
    assert not got["ddp"]  # (a DDP wrapper would also read the device in the last backward)
    assert got["reads"] == [0] * 12, got["reads"]
    assert got["step_reads"] == [0] * 3, got["step_reads"]


@pytest.mark.parametrize("processes", [1, 2, 3, 6])
def test_a_weight_kept_on_the_device_is_the_host_weight_bit_for_bit(processes: int) -> None:
    """The device path of micro_batch_weight (a float64 tensor) against the host path (Python floats), for every
    token count of a window up to 300, this micro-batch's labels from 0 to all, and the empty window."""
    from types import SimpleNamespace

    from hf_acco.integrations.trainer import weights

    trainer = SimpleNamespace(
        loss_is_scaled_for_ga=True, model_accepts_loss_kwargs=True, compute_loss_func=None,
        current_gradient_accumulation_steps=4, args=SimpleNamespace(average_tokens_across_devices=True),
        accelerator=SimpleNamespace(num_processes=processes), get_tp_size=lambda: 1,
    )  # fmt: skip
    for window in range(0, 300, 7):
        for mine in sorted({0, 1, window // 3, window}):
            trainer.count_label_tokens = lambda inputs, n=mine: torch.tensor(n)
            on_device, share = weights.micro_batch_weight(trainer, {}, torch.tensor(window), 0.5, paced=False)
            on_host, host_share = weights.micro_batch_weight(trainer, {}, window, 0.5, paced=False)
            assert float(on_device) == on_host and share == host_share, (window, mine)
