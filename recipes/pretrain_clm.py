"""Pre-train a small GPT-NeoX-style model on plain text with ACCO or a baseline (the method is the only difference).

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml recipes/pretrain_clm.py --method acco
    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml recipes/pretrain_clm.py --method ddp --seed 1
    accelerate launch --config_file accelerate_configs/multi_gpu_bf16.yaml recipes/pretrain_clm.py \\
        --text_path my_corpus.txt --hidden_size 768 --num_layers 12 --max_steps 20000 --bf16

Steps: read the text (TinyStories from ../shared/data/text by default), tokenize it with a real tokenizer (the
GPT-NeoX-20B tokenizer file in ../shared/data/tokenizers, or any --tokenizer_name_or_path), cut it into blocks, hold
the last 5 % out; build the model from a config; train with ACCOTrainer (acco, dpu, sync) or Trainer (ddp), evaluating
the held-out loss every --eval_steps (DEFAULT_TRAINING_ARGS are the recipe's defaults: --help lists them); at the end,
LAMBADA accuracy and perplexity (first --lambada_docs passages) on the committed parameters. Writes metrics.json
(val_losses per evaluation, tokens, final_val_loss, lambada_*) and the model. Every method sees the same data in the
same order for a given --seed.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import (
    AutoTokenizer,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    HfArgumentParser,
    PreTrainedTokenizerFast,
    Trainer,
    TrainerCallback,
    TrainingArguments,
    default_data_collator,
)

from hf_acco import ACCOConfig, ACCOTrainer, end_training
from hf_acco.integrations.baselines import baseline_arguments, bf16_wire_hook, check_ddp_wrapped
from hf_acco.tasks.cli import defaults_help, refuse_schedule, resume_target
from hf_acco.tasks.lambada import encode_pair, load_jsonl_texts, score, split_context_target

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"
DEFAULT_TRAINING_ARGS = [
    "--output_dir", "outputs/pretrain_clm", "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "8",
    "--gradient_accumulation_steps", "2", "--learning_rate", "2e-3", "--weight_decay", "0.1", "--warmup_steps", "20",
    "--lr_scheduler_type", "cosine", "--max_grad_norm", "1.0", "--max_steps", "300", "--logging_steps", "10",
    "--eval_strategy", "steps", "--eval_steps", "30", "--save_strategy", "no", "--report_to", "none",
    "--disable_tqdm", "true", "--dataloader_drop_last", "true", "--ddp_find_unused_parameters", "false",
] + (["--use_cpu", "true"] if not torch.cuda.is_available() else [])  # fmt: skip


@dataclass
class ScriptArguments:
    method: str = field(default="acco", metadata={"help": "acco, dpu, sync (ACCOTrainer) or ddp (Trainer).",
                                                  "choices": ["acco", "dpu", "sync", "ddp"]})  # fmt: skip
    text_path: str = field(default=str(SHARED / "text" / "tinystories_validation_head.txt"),
                           metadata={"help": "Plain-text training corpus."})  # fmt: skip
    tokenizer_name_or_path: str = field(
        default=str(SHARED / "tokenizers" / "gpt-neox-20b" / "tokenizer.json"),
        metadata={"help": "A tokenizer.json file, a directory or a Hub name."},
    )
    block_size: int = field(default=128, metadata={"help": "Tokens per training sequence."})
    hidden_size: int = field(default=128, metadata={"help": "Model width."})
    num_layers: int = field(default=4, metadata={"help": "Transformer layers."})
    num_heads: int = field(default=4, metadata={"help": "Attention heads."})
    lambada_path: str = field(default=str(SHARED / "lambada" / "lambada_openai_test.jsonl"),
                              metadata={"help": "LAMBADA JSONL for the final evaluation ('' to skip)."})  # fmt: skip
    lambada_docs: int = field(default=500, metadata={"help": "LAMBADA passages to score (0: all)."})
    ddp_bf16_hook: bool = field(
        default=False,
        metadata={"help": "ddp: average gradients in bf16 on the wire (the baseline for acco_comm_dtype=bf16)"},
    )
    slow_rank_delay: float = field(
        default=0.0,
        metadata={"help": "rank 1 sleeps this long before every training micro-batch: a slower GPU (seconds)"},
    )


def load_tokenizer(name: str):
    if name.endswith(".json"):
        if not os.path.isfile(name):
            raise FileNotFoundError(f"Tokenizer file {name} does not exist; pass --tokenizer_name_or_path.")
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=name, eos_token="<|endoftext|>")
    else:
        tokenizer = AutoTokenizer.from_pretrained(name)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def blocks(text_path: str, tokenizer, block_size: int) -> tuple[Dataset, Dataset, int]:
    """(train blocks, held-out blocks, tokens in the corpus): the token stream cut into equal blocks."""
    if not os.path.isfile(text_path):
        raise FileNotFoundError(f"Text corpus {text_path} does not exist; pass --text_path to a plain-text file.")
    text = Path(text_path).read_text(encoding="utf-8").replace("<|endoftext|>", tokenizer.eos_token)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    n = len(ids) // block_size
    if n < 20:
        raise ValueError(f"{text_path} gives only {n} blocks of {block_size} tokens; use a longer text.")
    rows = [ids[i * block_size : (i + 1) * block_size] for i in range(n)]
    split = n - max(1, n // 20)
    to_ds = lambda r: Dataset.from_dict({"input_ids": r, "labels": r})  # noqa: E731
    return to_ds(rows[:split]), to_ds(rows[split:]), len(ids)


@torch.no_grad()
def lambada(model, tokenizer, path: str, docs: int, trainer: Trainer) -> dict:
    """LAMBADA on this rank's share of the first ``docs`` passages, summed over ranks."""
    texts = load_jsonl_texts(path)[: docs or None]
    model = trainer.accelerator.unwrap_model(model).eval()
    pairs = [encode_pair(tokenizer, *split_context_target(t)) for t in texts]
    mine = pairs[trainer.args.process_index :: trainer.args.world_size]
    ll = greedy = 0.0
    for start in range(0, len(mine), 32):
        for value, hit in score(model, mine[start : start + 32], model.config.max_position_embeddings):
            ll, greedy = ll + value, greedy + hit
    totals = trainer.accelerator.reduce(torch.tensor([ll, greedy, len(mine)], device=trainer.args.device), "sum")
    return {"lambada_acc": float(totals[1] / totals[2]), "lambada_ppl": math.exp(-float(totals[0] / totals[2])),
            "lambada_docs": int(totals[2])}  # fmt: skip


def _wire(script_args: ScriptArguments, training_args: TrainingArguments) -> str:
    """The gradients' dtype on the wire."""
    bf16 = script_args.ddp_bf16_hook or getattr(training_args, "acco_comm_dtype", "fp32") == "bf16"
    return "bf16" if bf16 else "fp32"


class TrainingClock(TrainerCallback):
    """Seconds of training (evaluations left out) at every evaluation: for loss against wall-clock time."""

    def __init__(self) -> None:
        self.start, self.evaluating, self.at_eval = 0.0, 0.0, []

    def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201 - TrainerCallback's signature
        self.start = time.perf_counter()

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):  # noqa: ANN001, ANN201
        self.evaluating += (metrics or {}).get("eval_runtime", 0.0)
        self.at_eval.append(time.perf_counter() - self.start - self.evaluating)


def slow_down_rank_1(model: torch.nn.Module, delay: float) -> None:
    """A slower GPU on rank 1: a sleep before every training forward pass (its peers keep their speed)."""

    def hook(module: torch.nn.Module, args: tuple) -> None:
        if module.training and torch.is_grad_enabled():
            time.sleep(delay)

    if delay > 0 and int(os.environ.get("RANK", "0")) == 1:
        model.register_forward_pre_hook(hook)


class BF16WireHook(TrainerCallback):
    """Registers the bf16 compression hook on the DDP-wrapped model once Trainer has wrapped it (before the first
    backward): Trainer has no setting for DDP communication hooks, and torch's own hook refuses gloo by name."""

    def __init__(self, trainer: Trainer) -> None:
        self.trainer, self.registered = trainer, False

    def on_train_begin(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201 - TrainerCallback's signature
        wrapped = self.trainer.model_wrapped
        if isinstance(wrapped, torch.nn.parallel.DistributedDataParallel) and not self.registered:
            wrapped.register_comm_hook(None, bf16_wire_hook)
            self.registered = True


def build_model(script_args: ScriptArguments, tokenizer: Any, seed: int) -> GPTNeoXForCausalLM:
    """A GPT-NeoX of the script's size, initialised from ``seed`` (rank 1 slowed down if asked)."""
    torch.manual_seed(seed)
    config = GPTNeoXConfig(
        vocab_size=len(tokenizer), hidden_size=script_args.hidden_size, num_hidden_layers=script_args.num_layers,
        num_attention_heads=script_args.num_heads, intermediate_size=4 * script_args.hidden_size,
        max_position_embeddings=script_args.block_size, tie_word_embeddings=True,
        bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id,
    )  # fmt: skip
    model = GPTNeoXForCausalLM(config)
    slow_down_rank_1(model, script_args.slow_rank_delay)
    return model


def main(argv: list[str] | None = None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = HfArgumentParser((ScriptArguments, ACCOConfig), epilog=defaults_help(DEFAULT_TRAINING_ARGS))
    refuse_schedule(parser, argv)
    script_args, training_args = parser.parse_args_into_dataclasses(DEFAULT_TRAINING_ARGS + argv)
    if script_args.method == "ddp":
        training_args, trainer_cls = baseline_arguments(training_args, TrainingArguments), Trainer
    else:
        training_args.acco_schedule, trainer_cls = script_args.method, ACCOTrainer

    # 1. data: the corpus as blocks of tokens, the last 5 % held out
    tokenizer = load_tokenizer(script_args.tokenizer_name_or_path)
    train_ds, val_ds, corpus_tokens = blocks(script_args.text_path, tokenizer, script_args.block_size)
    # 2. the model, from a config and the run's seed
    model = build_model(script_args, tokenizer, training_args.seed)
    # 3. train, evaluating the held-out loss every eval_steps
    trainer = trainer_cls(model=model, args=training_args, train_dataset=train_ds, eval_dataset=val_ds,
                          data_collator=default_data_collator, callbacks=[clock := TrainingClock()])  # fmt: skip
    if script_args.ddp_bf16_hook:
        if script_args.method != "ddp":
            raise ValueError("--ddp_bf16_hook is for --method ddp; ACCO's own choice is --acco_comm_dtype bf16")
        trainer.add_callback(hook := BF16WireHook(trainer))
    trainer.train(resume_from_checkpoint=resume_target(training_args.resume_from_checkpoint))
    if script_args.ddp_bf16_hook and training_args.world_size > 1 and not hook.registered:
        raise RuntimeError("--ddp_bf16_hook: Trainer did not wrap the model in DDP, so no hook was registered")
    if script_args.method == "ddp" and training_args.world_size > 1:
        check_ddp_wrapped(trainer)
    final = trainer.evaluate()
    # 4. metrics: validation curve, tokens seen, LAMBADA
    evals = [h for h in trainer.state.log_history if "eval_loss" in h]
    tokens_per_step = (training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps
                       * training_args.world_size * script_args.block_size)  # fmt: skip
    metrics = {
        "method": script_args.method,
        "seed": training_args.seed,
        "steps": trainer.state.global_step,
        "tokens": trainer.state.global_step * tokens_per_step,
        "corpus_tokens": corpus_tokens,
        "eval_steps": [h["step"] for h in evals],
        "val_losses": [h["eval_loss"] for h in evals],
        "train_seconds": clock.at_eval[: len(evals)],  # training time at each evaluation (evaluations left out)
        "slow_rank_delay": script_args.slow_rank_delay,
        "final_val_loss": final["eval_loss"],
        "final_val_ppl": math.exp(final["eval_loss"]),
        "train_losses": [[h["step"], h["loss"]] for h in trainer.state.log_history if "loss" in h],
        "warmup_steps": getattr(training_args, "acco_warmup_steps", 0),
        "wire": _wire(script_args, training_args),
        "command": " ".join(["recipes/pretrain_clm.py", *sys.argv[1:]]),  # (under accelerate launch or torchrun)
    }
    if script_args.lambada_path and os.path.isfile(script_args.lambada_path):
        metrics.update(lambada(trainer.model, tokenizer, script_args.lambada_path, script_args.lambada_docs, trainer))
    output_dir = Path(training_args.output_dir)
    trainer.save_model(str(output_dir))
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(output_dir)
        (output_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
        print(json.dumps({k: v for k, v in metrics.items() if k != "train_losses"}, indent=2))
    end_training(trainer.accelerator, trainer)  # ranks leave together; DDP's wrapper goes before the process groups
    return metrics


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
