"""A training script written for transformers.Trainer. `--acco` changes the two class names, nothing else.

accelerate launch --config_file accelerate_configs/cpu_2proc.yaml tests/scripts/trainer_script.py --acco
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time

import torch
from datasets import Dataset
from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

from hf_acco import ACCOConfig, ACCOTrainer

VOCAB, SEQ = 64, 16


def make_dataset(n: int, seed: int, masked: bool = True, empty: tuple[int, ...] = ()) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (n, SEQ), generator=g)
    ids[:, 1::2] = (ids[:, 0::2] * 3 + 1) % VOCAB  # a learnable pattern
    labels = ids.clone()
    prompt = torch.randint(1, SEQ // 2, (n,), generator=g)
    for i in range(n):
        if masked:
            labels[i, : prompt[i]] = -100  # masked prompts: uneven token counts per micro-batch
        if i in empty:
            labels[i] = -100  # no label token at all (completion-only loss, truncated)
    return Dataset.from_dict({"input_ids": ids.tolist(), "labels": labels.tolist()})


class MeanLossLlama(LlamaForCausalLM):
    """Takes Trainer's loss kwargs (``**kwargs``) but returns the mean loss of its batch: it ignores
    ``num_items_in_batch``, as many custom models do."""

    def forward(self, input_ids=None, labels=None, **kwargs):
        kwargs.pop("num_items_in_batch", None)
        return super().forward(input_ids=input_ids, labels=labels, **kwargs)


class LogKeys(TrainerCallback):
    """Every key that reached the loggers (on_log), as report_to's integrations see them."""

    def __init__(self) -> None:
        self.keys: set[str] = set()

    def on_log(self, args, state, control, logs=None, **kwargs):
        self.keys.update(logs or {})


class StopAt(TrainerCallback):
    """Stops training after a given micro-batch, in the middle of an optimizer step."""

    def __init__(self, micro_batch: int) -> None:
        self.micro_batch, self.seen = micro_batch, 0

    def on_substep_end(self, args, state, control, **kwargs):
        self.seen += 1
        if self.seen == self.micro_batch:
            control.should_training_stop = True


class SlowRank:
    """Unequal GPUs: before every training forward pass this rank sleeps ``delay`` seconds and multiplies ``matmuls``
    256 x 256 matrices (real compute). Records the rows of input_ids every training forward saw."""

    def __init__(self, model: torch.nn.Module, delay: float, matmuls: int) -> None:
        self.delay, self.matmuls, self.rows, self.calls = delay, matmuls, [], 0
        self.work = torch.randn(256, 256, generator=torch.Generator().manual_seed(0))
        model.register_forward_pre_hook(self, with_kwargs=True)

    def __call__(self, module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if not module.training or not torch.is_grad_enabled():
            return
        self.calls += 1
        ids = kwargs.get("input_ids", args[0] if args else None)
        if ids is not None:
            self.rows.extend(ids.tolist())
        time.sleep(self.delay)
        x = self.work
        for _ in range(self.matmuls):
            x = torch.tanh(x @ self.work)


class Faults(TrainerCallback):
    """Injected failures: SIGKILL of rank 1, SIGTERM of every rank, slow steps."""

    def __init__(self, kill_at: int, stop_at: int, sigterm_at: int, step_sleep: float) -> None:
        self.kill_at, self.stop_at, self.term_at, self.sleep = kill_at, stop_at, sigterm_at, step_sleep

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.kill_at and args.process_index == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if state.global_step == self.stop_at and args.process_index == 1:
            os.kill(os.getpid(), signal.SIGSTOP)  # alive but silent: only a timeout can tell
        if state.global_step == self.term_at:
            os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(self.sleep)


def full(p: torch.Tensor) -> torch.Tensor:
    """A parameter's full value (FSDP's sharded ones gathered: every rank calls this, in the same order)."""
    from torch.distributed.tensor import DTensor

    return (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().clone()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--acco", action="store_true", help="ACCOTrainer + ACCOConfig instead of Trainer")
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--max_steps", type=int, default=12)
    parser.add_argument("--eval_steps", type=int, default=0)
    parser.add_argument("--save_steps", type=int, default=0)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--extra", default="{}", help="more training arguments, as JSON")
    parser.add_argument("--lora", action="store_true", help="train a LoRA adapter (peft) instead of the model")
    parser.add_argument("--stop_at_micro_batch", type=int, default=0, help="a callback stops training there")
    parser.add_argument("--kill_rank1_at_step", type=int, default=0, help="fault: SIGKILL rank 1 after this step")
    parser.add_argument("--stop_rank1_at_step", type=int, default=0, help="fault: SIGSTOP rank 1 (hangs)")
    parser.add_argument("--kill_rank1_in_checkpoint", type=int, default=0, help="fault: SIGKILL rank 1 mid-save")
    parser.add_argument("--sigterm_at_step", type=int, default=0, help="fault: SIGTERM every rank after this step")
    parser.add_argument("--step_sleep", type=float, default=0.0, help="sleep after every step (seconds)")
    parser.add_argument("--train_size", type=int, default=256, help="training examples")
    parser.add_argument("--slow_rank_delay", type=float, default=0.0, help="rank 1 sleeps this long per micro-batch")
    parser.add_argument("--rank_delays", type=float, nargs="*", default=[], help="per rank: sleep per micro-batch")
    parser.add_argument(
        "--rank_matmuls", type=int, nargs="*", default=[], help="per rank: more compute per micro-batch"
    )
    parser.add_argument("--user_optimizer", action="store_true", help="pass an AdamW instance and a LambdaLR")
    parser.add_argument("--iterable", action="store_true", help="the training data as a streamed IterableDataset")
    parser.add_argument("--unmasked", action="store_true", help="every token is a label (no masked prompts)")
    parser.add_argument("--empty_examples", default="", help="comma-separated training examples with no label token")
    parser.add_argument("--mean_loss_model", action="store_true", help="a model that ignores num_items_in_batch")
    parser.add_argument(
        "--machine_per_rank", action="store_true", help="each rank its own machine: a private output_dir/node{rank}"
    )
    parser.add_argument(
        "--hsdp", action="store_true", help="FSDP2 inside --machines machines (as for Accelerate's HSDP)"
    )
    parser.add_argument("--machines", type=int, default=2, help="with --hsdp: dp_replicate_size")
    parser.add_argument(
        "--weights_on_rank0_only", action="store_true",
        help="no weights (the meta device) on every rank but 0, as from_pretrained leaves them under FSDP's "
        "low-memory loading",
    )  # fmt: skip
    parser.add_argument("--model_dtype", default="float32", help="the dtype the model is built in (bfloat16)")
    parser.add_argument(
        "--fsdp_reduce_fp32", action="store_true", help="with --hsdp and bf16: FSDP reduces gradients in fp32"
    )
    parser.add_argument(
        "--fsdp_on_cpu", action="store_true", help="test only: let Accelerate run an FSDP launch config on CPU ranks"
    )
    cli = parser.parse_args(argv)
    # The only difference between the two runs: the two class names.
    trainer_cls, args_cls = (ACCOTrainer, ACCOConfig) if cli.acco else (Trainer, TrainingArguments)

    torch.manual_seed(0)
    model = (MeanLossLlama if cli.mean_loss_model else LlamaForCausalLM)(
        LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                    num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=SEQ)
    )  # fmt: skip
    model = model.to(getattr(torch, cli.model_dtype))
    if cli.weights_on_rank0_only and int(os.environ.get("RANK", "0")) != 0:
        for module in model.modules():  # parameters on the meta device, as from_pretrained leaves them there
            for name, p in list(module._parameters.items()):
                if p is not None:
                    module._parameters[name] = torch.nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)
    if cli.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))
    settings = dict(
        output_dir=cli.output_dir,
        per_device_train_batch_size=2,
        per_device_eval_batch_size=4,
        gradient_accumulation_steps=4,
        learning_rate=3e-3,
        weight_decay=0.1,
        warmup_steps=3,
        lr_scheduler_type="cosine",
        max_grad_norm=0.5,
        max_steps=cli.max_steps,
        logging_steps=1,
        eval_strategy="steps" if cli.eval_steps else "no",
        eval_steps=cli.eval_steps or None,
        save_strategy="steps" if cli.save_steps else "no",
        save_steps=cli.save_steps or 500,
        report_to=[],
        use_cpu=True,
        seed=0,
        disable_tqdm=True,
    )
    if cli.machine_per_rank:  # no shared file system: each "machine" writes its own directory, as its first process
        os.environ.update(LOCAL_RANK="0", LOCAL_WORLD_SIZE="1")
        settings["output_dir"] = os.path.join(cli.output_dir, f"node{os.environ.get('RANK', '0')}")
    if cli.hsdp or cli.fsdp_on_cpu:
        from tests.fsdp_cpu import allow_fsdp_on_cpu

        allow_fsdp_on_cpu()  # (test only: Accelerate enables FSDP on GPUs by itself)
    if cli.hsdp:  # as a user configures Trainer's HSDP: the same settings go to ACCOTrainer
        from accelerate.parallelism_config import ParallelismConfig

        world = int(os.environ.get("WORLD_SIZE", "1"))
        settings.update(
            fsdp=True,
            fsdp_config={"version": 2, "reshard_after_forward": True},
            parallelism_config=ParallelismConfig(dp_replicate_size=cli.machines, dp_shard_size=world // cli.machines),
        )
    args = args_cls(**{**settings, **json.loads(cli.extra)})
    if cli.fsdp_reduce_fp32:  # as a user sets FSDP2's mixed precision policy (Accelerate's plugin argument)
        policy = {"param_dtype": torch.bfloat16, "reduce_dtype": torch.float32, "output_dtype": torch.bfloat16}
        args.fsdp_plugin_args["mixed_precision_policy"] = policy
    log_keys = LogKeys()
    callbacks = [log_keys] + ([StopAt(cli.stop_at_micro_batch)] if cli.stop_at_micro_batch else [])
    rank = int(os.environ.get("RANK", "0"))
    delays = cli.rank_delays or [0.0, cli.slow_rank_delay]
    slow = SlowRank(model, delays[rank] if rank < len(delays) else 0.0,
                    cli.rank_matmuls[rank] if rank < len(cli.rank_matmuls) else 0)  # fmt: skip
    if cli.kill_rank1_at_step or cli.stop_rank1_at_step or cli.sigterm_at_step or cli.step_sleep:
        callbacks.append(Faults(cli.kill_rank1_at_step, cli.stop_rank1_at_step, cli.sigterm_at_step, cli.step_sleep))
    if cli.kill_rank1_in_checkpoint:
        save_rng_state = trainer_cls._save_rng_state

        def dying_save(self, output_dir):  # rank 1 dies after writing its shard, before the ranks meet
            if self.args.process_index == 1 and self.state.global_step == cli.kill_rank1_in_checkpoint:
                os.kill(os.getpid(), signal.SIGKILL)
            save_rng_state(self, output_dir)

        trainer_cls._save_rng_state = dying_save
    optimizers = (None, None)
    if cli.user_optimizer:  # the user's own optimizer and schedule (one group, their settings)
        opt = torch.optim.AdamW(model.parameters(), lr=2e-3, betas=(0.9, 0.95), weight_decay=0.05)
        optimizers = (opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1.0 + 0.5 * step)))
    empty = tuple(int(i) for i in cli.empty_examples.split(",") if i)
    train_data = make_dataset(cli.train_size, 1, masked=not cli.unmasked, empty=empty)
    trainer = trainer_cls(
        model=model,
        args=args,
        train_dataset=train_data.to_iterable_dataset() if cli.iterable else train_data,
        eval_dataset=make_dataset(32, 2),
        callbacks=callbacks,
        optimizers=optimizers,
    )
    trainer.train(resume_from_checkpoint=True if cli.resume == "last" else cli.resume)
    trainer.save_model(os.path.join(args.output_dir, "final"))
    result = {
        "log_history": trainer.state.log_history,
        "params": {n: full(p) for n, p in trainer.model.named_parameters()},
        "world_size": trainer.accelerator.num_processes,
        "logged_keys": sorted(log_keys.keys),
        "acco_totals": dict(trainer.acco.totals) if getattr(trainer, "acco", None) else None,
        "engine_ranks": trainer.acco.comm.world_size if getattr(trainer, "acco", None) else None,
        "fsdp_sharded": type(trainer.model).__name__.startswith("FSDP"),
        "fsdp_policy": str(
            getattr(getattr(trainer.accelerator.state, "fsdp_plugin", None), "mixed_precision_policy", None)
        ),
        "rows": slow.rows,  # input_ids of every training micro-batch this rank computed
    }
    if trainer.is_world_process_zero():
        with open(os.path.join(args.output_dir, "log_history.json"), "w") as f:
            json.dump(trainer.state.log_history, f)
    with open(os.path.join(cli.output_dir, f"rank{rank}_micro_batches.json"), "w") as f:
        json.dump({"micro_batches": slow.calls, "rows": len(slow.rows), "engine_ranks": result["engine_ranks"],
                   "fsdp_sharded": result["fsdp_sharded"]}, f)  # fmt: skip
    return result


if __name__ == "__main__":
    main()
    # A launched script's last distributed act, as the recipes end (hf_acco.end_training): every rank here, then the
    # process groups destroyed from Python. Left to the interpreter's exit, a rank that exits while a peer still
    # works in the default gloo group can abort ("terminate called without an active exception"), and the
    # launcher of the other machine then waits for it at its exit barrier.
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
