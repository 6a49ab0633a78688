"""Instruction fine-tuning in the Alpaca format, with ACCO or a baseline: the method is the only line that differs.

    # the main job: no download, a generated instruction set with checkable answers, a small model built here
    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml recipes/alpaca_finetune.py
    # the Alpaca sample shipped in shared/data, LoRA, the DDP baseline
    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml recipes/alpaca_finetune.py \\
        --dataset_path ../shared/data/alpaca/alpaca_data_random5000.json --use_lora --method ddp
    # the same through TRL's SFTTrainer (prompt-completion data, loss on the completion only; on CPU, switch off
    # the bf16 and gradient checkpointing that TRL's SFTConfig turns on by default)
    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml recipes/alpaca_finetune.py --trl \\
        --bf16 false --gradient_checkpointing false
    # a real model (its weights in bf16) and the Hub dataset on 8 GPUs
    accelerate launch --config_file accelerate_configs/multi_gpu_bf16.yaml recipes/alpaca_finetune.py \\
        --model_name_or_path EleutherAI/pythia-410m --dtype bfloat16 --hub --bf16 --max_steps 1000

Steps: load the records; hold some out; build the model and tokenizer; format prompts (loss on the response only);
train with ACCOTrainer (acco, dpu, sync) or Trainer (ddp), or with ``--trl`` ACCOSFTTrainer or TRL's SFTTrainer (TRL's
defaults, its own tokenization and collator); measure held-out loss, and exact match of greedy answers when the data is
the generated set, before and after; save the model (or adapter, and with no --model_name_or_path the model it adapts
in base_model/), metrics.json and loss_curve.png. Any training argument of ACCOConfig can be given on the command line
(the schedule by --method); DEFAULT_TRAINING_ARGS are this recipe's defaults, before it (--help lists them).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from datasets import Dataset
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForSeq2Seq,
    HfArgumentParser,
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainingArguments,
    set_seed,
)

from hf_acco import ACCOConfig, ACCOTrainer, end_training
from hf_acco.integrations.baselines import baseline_arguments, check_ddp_wrapped
from hf_acco.tasks.alpaca import (
    build_word_tokenizer,
    check_records,
    format_prompt,
    generated_alpaca,
    load_records,
    normalise,
    tokenize_example,
)
from hf_acco.tasks.cli import defaults_help, refuse_schedule, resume_target

# Defaults for the offline main job; anything given on the command line comes after them and wins.
DEFAULT_TRAINING_ARGS = [
    "--output_dir", "outputs/alpaca_finetune", "--per_device_train_batch_size", "16",
    "--gradient_accumulation_steps", "2", "--learning_rate", "3e-3", "--weight_decay", "0.01",
    "--warmup_steps", "20", "--lr_scheduler_type", "cosine", "--max_grad_norm", "1.0", "--max_steps", "300",
    "--logging_steps", "10", "--save_strategy", "no", "--report_to", "none", "--seed", "0",
    "--per_device_eval_batch_size", "32", "--disable_tqdm", "true", "--max_length", "256",
] + (["--use_cpu", "true"] if not torch.cuda.is_available() else [])  # fmt: skip


@dataclass
class ScriptArguments:
    method: str = field(
        default="acco", metadata={"help": "acco, dpu, sync (ACCOTrainer) or ddp (transformers.Trainer).",
                                  "choices": ["acco", "dpu", "sync", "ddp"]}
    )  # fmt: skip
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "A causal LM (Hub name or directory). Default: a small Llama built here."}
    )
    hub: bool = field(default=False, metadata={"help": "Train on the Hub's Alpaca (--dataset_name, online)."})
    dataset_name: str = field(default="tatsu-lab/alpaca", metadata={"help": "The Hub dataset used with --hub."})
    dataset_path: str | None = field(default=None, metadata={"help": "A local Alpaca JSON list or JSONL file."})
    num_generated: int = field(default=4000, metadata={"help": "Size of the generated set (no dataset given)."})
    heldout: int = field(default=200, metadata={"help": "Examples held out for evaluation."})
    max_length: int = field(default=256, metadata={"help": "Tokens per example (the end-of-sequence is kept)."})
    use_lora: bool = field(default=False, metadata={"help": "Train a LoRA adapter (peft) instead of all weights."})
    lora_r: int = field(default=8, metadata={"help": "LoRA rank."})
    lora_target_modules: str = field(default="q_proj,v_proj", metadata={"help": "Comma-separated module names."})
    trl: bool = field(default=False, metadata={"help": "Train through TRL's SFTTrainer (hf_acco.trl for ACCO)."})
    dtype: str | None = field(
        default=None, metadata={"help": "The model's weights: bfloat16 or float32 (default: bfloat16 with --bf16, "
                                "else float32). ACCO keeps fp32 master weights of each rank's shard either way.",
                                "choices": ["bfloat16", "float32"]}
    )  # fmt: skip


def _without(cls: type, name: str) -> type:
    """The dataclass ``cls`` less one field (given to another dataclass of the same parser)."""
    kept = [(f.name, f.type, f) for f in dataclasses.fields(cls) if f.name != name]
    return dataclasses.make_dataclass(cls.__name__, kept)


def trainer_classes(method: str, trl: bool) -> tuple[type, type]:
    """(trainer, config) for a method: ACCO's for acco/dpu/sync, the baseline's for ddp; TRL's SFT ones with trl."""
    if trl:
        from trl import SFTConfig, SFTTrainer

        from hf_acco.trl import ACCOSFTConfig, ACCOSFTTrainer

        return (SFTTrainer, SFTConfig) if method == "ddp" else (ACCOSFTTrainer, ACCOSFTConfig)
    return (Trainer, TrainingArguments) if method == "ddp" else (ACCOTrainer, ACCOConfig)


def load_data(args: ScriptArguments) -> tuple[list[dict], bool]:
    """(records, whether their answers are checkable by exact match)."""
    if args.dataset_path is not None:
        return load_records(args.dataset_path), False
    if args.hub:
        from datasets import load_dataset

        return check_records(list(load_dataset(args.dataset_name, split="train")), args.dataset_name), False
    return generated_alpaca(args.num_generated), True


def build_model_and_tokenizer(args: ScriptArguments, records: list[dict]):
    """(model, tokenizer, base): ``base`` is a copy of a model built here before LoRA wraps it (saved beside the
    adapter, which is of no use without it), else None."""
    base = None
    if args.model_name_or_path is not None:
        tokenizer = AutoTokenizer.from_pretrained(args.model_name_or_path)
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=getattr(torch, args.dtype))
    else:  # offline: a word-level tokenizer over the data and a small Llama (about 1 M parameters)
        tokenizer = build_word_tokenizer([format_prompt(r) + " " + r["output"] for r in records])
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=384, num_hidden_layers=3,
                             num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=args.max_length,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                             bos_token_id=tokenizer.eos_token_id)  # fmt: skip
        model = LlamaForCausalLM(config).to(getattr(torch, args.dtype))
        base = copy.deepcopy(model) if args.use_lora else None  # LoRA leaves these weights as they are
    if args.use_lora:
        from peft import LoraConfig, get_peft_model

        targets = args.lora_target_modules.split(",")
        model = get_peft_model(model, LoraConfig(r=args.lora_r, lora_alpha=2 * args.lora_r, target_modules=targets))
    return model, tokenizer, base


@torch.no_grad()
def exact_match(trainer: Trainer, tokenizer, records: list[dict], max_new_tokens: int = 16) -> float:
    """Share of held-out records whose greedy answer equals the reference (each rank its share, then summed). Under
    FSDP every forward is a collective: the ranks generate in step (``synced_gpus``), as many times each (a rank
    with a record fewer repeats one, uncounted)."""
    model = trainer.accelerator.unwrap_model(trainer.model).eval()
    rank, world = trainer.args.process_index, trainer.args.world_size
    mine, fsdp = records[rank::world], trainer.is_fsdp_enabled
    hits = total = 0
    for i in range(-(-len(records) // world) if fsdp else len(mine)):
        record = mine[i] if i < len(mine) else records[0]
        prompt = tokenizer(format_prompt(record), add_special_tokens=False, return_tensors="pt")
        out = model.generate(**prompt.to(trainer.args.device), max_new_tokens=max_new_tokens, do_sample=False,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                             synced_gpus=fsdp)  # fmt: skip
        answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
        if i < len(mine):
            hits += normalise(answer) == normalise(record["output"])
            total += 1
    counts = trainer.accelerator.reduce(torch.tensor([hits, total], device=trainer.args.device), reduction="sum")
    return float(counts[0] / counts[1])


def save_loss_curve(log_history: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [h["step"] for h in log_history if "loss" in h]
    plt.figure(figsize=(6, 4))
    plt.plot(steps, [h["loss"] for h in log_history if "loss" in h], label="train")
    evals = [h for h in log_history if "eval_loss" in h]
    plt.plot([h["step"] for h in evals], [h["eval_loss"] for h in evals], "o-", label="held-out")
    plt.xlabel("optimizer step")
    plt.ylabel("loss (response tokens)")
    plt.legend()
    plt.tight_layout()
    plt.savefig(path)
    plt.close()


def parse_arguments(argv: list[str]) -> tuple[ScriptArguments, Any, type]:
    """(script arguments, the method's training arguments, its trainer class) from the command line after the
    defaults. With --trl, TRL's config (and its defaults); its own max_length is the one --max_length sets."""
    trl = HfArgumentParser(ScriptArguments, add_help=False).parse_known_args(argv)[0].trl  # --trl, --trl=false, ...
    script_cls = _without(ScriptArguments, "max_length") if trl else ScriptArguments
    config_cls = trainer_classes("acco", trl)[1]
    parser = HfArgumentParser((script_cls, config_cls), epilog=defaults_help(DEFAULT_TRAINING_ARGS))
    refuse_schedule(parser, argv)
    argv = DEFAULT_TRAINING_ARGS + argv
    script_args, training_args = parser.parse_args_into_dataclasses(argv)
    if trl:
        script_args.max_length = training_args.max_length
    script_args.dtype = script_args.dtype or ("bfloat16" if training_args.bf16 else "float32")
    trainer_cls, config_cls = trainer_classes(script_args.method, script_args.trl)
    if script_args.method == "ddp":  # the baseline: the same arguments without the acco_ ones
        training_args = baseline_arguments(training_args, config_cls)
    else:
        training_args.acco_schedule = script_args.method
    return script_args, training_args, trainer_cls


def main(argv: list[str] | None = None) -> dict:
    script_args, training_args, trainer_cls = parse_arguments(list(sys.argv[1:] if argv is None else argv))

    # 1. data: records, a held-out split
    records, checkable = load_data(script_args)
    rng = random.Random(0)
    rng.shuffle(records)
    if len(records) <= script_args.heldout:
        raise ValueError(f"{len(records)} examples cannot spare {script_args.heldout} for --heldout; lower it.")
    heldout, train = records[: script_args.heldout], records[script_args.heldout :]
    # 2. model and tokenizer; 3. prompts, response-only labels
    set_seed(training_args.seed)  # LoRA's random initialisation: the same in every run with this seed, every method
    model, tokenizer, base = build_model_and_tokenizer(script_args, records)
    if script_args.trl:  # prompt-completion records: TRL tokenizes them and learns the completion only
        tokenize = lambda r: {"prompt": format_prompt(r), "completion": " " + r["output"]}  # noqa: E731
        collator = {}  # TRL's own
    else:
        tokenize = lambda r: tokenize_example(r, tokenizer, script_args.max_length)  # noqa: E731
        collator = {"data_collator": DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100)}
    train_ds = Dataset.from_list([tokenize(r) for r in train])
    heldout_ds = Dataset.from_list([tokenize(r) for r in heldout])
    # The held-out loss before training is taken by Trainer itself at the start of train() (eval_on_start), after
    # it has wrapped the model for DDP. trainer.evaluate() before train() would leave the DDP baseline unwrapped
    # (transformers 5.24 with accelerate 1.15: evaluate() marks the bare model as prepared, so train() skips DDP
    # and every rank trains on its own gradients). ACCOTrainer does its own communication and is not affected.
    fresh_start = resume_target(training_args.resume_from_checkpoint) is None
    training_args.eval_on_start = fresh_start
    trainer = trainer_cls(
        model=model,
        args=training_args,
        train_dataset=train_ds,
        eval_dataset=heldout_ds,
        processing_class=tokenizer,
        **collator,
    )
    # 4. before, train, after
    metrics: dict = {"method": script_args.method, "world_size": training_args.world_size, "trl": script_args.trl}
    if checkable and fresh_start and not trainer.is_fsdp_enabled:  # (FSDP: the model is sharded when training starts,
        metrics["exact_match_before"] = exact_match(trainer, tokenizer, heldout)  # some ranks hold no weights before)
    start = time.perf_counter()
    trainer.train(resume_from_checkpoint=resume_target(training_args.resume_from_checkpoint))
    metrics["train_seconds"] = time.perf_counter() - start
    if script_args.method == "ddp" and training_args.world_size > 1:
        check_ddp_wrapped(trainer)
    if fresh_start:
        metrics["heldout_loss_before"] = next(h["eval_loss"] for h in trainer.state.log_history if "eval_loss" in h)
    metrics["heldout_loss"] = trainer.evaluate()["eval_loss"]
    if checkable:
        metrics["exact_match_after"] = exact_match(trainer, tokenizer, heldout)
    metrics["steps"] = trainer.state.global_step
    # 5. save: model or adapter (committed parameters), tokenizer, metrics, loss curve; an adapter on a model built
    # here names the copy of that model saved beside it (base_model/), as an adapter names its Hub model
    output_dir = Path(training_args.output_dir)
    if base is not None:
        if training_args.should_save:  # first: peft reads the base's config.json as it saves the adapter
            base.save_pretrained(output_dir / "base_model")
            tokenizer.save_pretrained(output_dir / "base_model")
        trainer.accelerator.unwrap_model(trainer.model).peft_config["default"].base_model_name_or_path = str(
            (output_dir / "base_model").resolve()
        )
    trainer.save_model(str(output_dir))
    if trainer.is_world_process_zero():
        tokenizer.save_pretrained(output_dir)
        (output_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
        save_loss_curve(trainer.state.log_history, output_dir / "loss_curve.png")
        print(json.dumps(metrics, indent=2))
    end_training(trainer.accelerator, trainer)  # ranks leave together; DDP's wrapper goes before the process groups
    return metrics


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
