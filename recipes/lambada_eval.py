"""LAMBADA (lambada_openai) last-word accuracy and perplexity of a causal LM, with lm-evaluation-harness's definitions.

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml recipes/lambada_eval.py \\
        --model_name_or_path outputs/alpaca_finetune --dataset_path ../shared/data/lambada/lambada_openai_test.jsonl
    accelerate launch --num_processes 8 recipes/lambada_eval.py --model_name_or_path EleutherAI/pythia-160m
    python recipes/lambada_eval.py --model_name_or_path base --adapter_path outputs/lora   # a PEFT adapter
    # an adapter alpaca_finetune.py trained on the model it built (saved beside it in base_model/)
    python recipes/lambada_eval.py --model_name_or_path outputs/lora/base_model --adapter_path outputs/lora

Data: a local JSONL with a `text` field (--dataset_path), else the Hub's EleutherAI/lambada_openai test split.
Each rank scores its share of the passages in batches (sorted by length); rank 0 gathers them, computes the
metric with the `evaluate` module shipped in hf_acco (loaded offline from its path) and writes metrics.json:
lambada_acc, lambada_ppl, num_docs.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

import evaluate
import torch
from accelerate import Accelerator
from accelerate.utils import gather_object
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser

from hf_acco.tasks.lambada import METRIC_PATH, batches, encode_pair, load_jsonl_texts, score, split_context_target


@dataclass
class LambadaArguments:
    model_name_or_path: str = field(metadata={"help": "Causal LM to evaluate: a Hub name or a local directory."})
    adapter_path: str | None = field(default=None, metadata={"help": "A PEFT adapter to apply on top of the model."})
    tokenizer_name_or_path: str | None = field(default=None, metadata={"help": "Defaults to the model's."})
    dataset_path: str | None = field(
        default=None, metadata={"help": "Local JSONL with a 'text' field; default: the Hub's lambada_openai test set."}
    )
    batch_size: int = field(default=32, metadata={"help": "Passages per forward pass per rank."})
    max_length: int | None = field(default=None, metadata={"help": "Context window; default: the model's."})
    limit: int | None = field(default=None, metadata={"help": "Score only the first N passages."})
    bf16: bool = field(default=False, metadata={"help": "Run the model in bfloat16."})
    output_dir: str = field(default="outputs/lambada_eval", metadata={"help": "Where metrics.json is written."})


def load_texts(args: LambadaArguments) -> list[str]:
    if args.dataset_path is not None:
        texts = load_jsonl_texts(args.dataset_path)
    else:
        from datasets import load_dataset

        texts = load_dataset("EleutherAI/lambada_openai", "default", split="test")["text"]
    texts = texts[: args.limit] if args.limit else texts
    if not texts:
        raise ValueError("The LAMBADA data has no passage to score.")
    return texts


def load_model(args: LambadaArguments, device: torch.device) -> torch.nn.Module:
    dtype = torch.bfloat16 if args.bf16 else torch.float32
    model = AutoModelForCausalLM.from_pretrained(args.model_name_or_path, dtype=dtype)
    if args.adapter_path is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, args.adapter_path)
    return model.to(device).eval()


def main(argv: list[str] | None = None) -> dict:
    (args,) = HfArgumentParser(LambadaArguments).parse_args_into_dataclasses(args=argv)
    accelerator = Accelerator(cpu=not torch.cuda.is_available())
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name_or_path or args.model_name_or_path)
    model = load_model(args, accelerator.device)
    max_length = args.max_length or getattr(model.config, "max_position_embeddings", None) or 2048

    # 1. lm-eval's context/target split and pair tokenisation, for every passage
    texts = load_texts(args)
    pairs = [encode_pair(tokenizer, *split_context_target(t)) for t in texts]
    # 2. this rank's share, longest first (less padding), in batches
    mine = sorted(range(accelerator.process_index, len(pairs), accelerator.num_processes),
                  key=lambda i: -len(pairs[i][0]) - len(pairs[i][1]))  # fmt: skip
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    scored = []
    for chunk in batches(mine, args.batch_size):
        scored += zip(chunk, score(model, [pairs[i] for i in chunk], max_length, pad_id))
    # 3. every rank's results on rank 0, in passage order, and the metric
    results = dict(gather_object(scored))
    metrics: dict = {}
    if accelerator.is_main_process:
        ordered = [results[i] for i in range(len(pairs))]
        metric = evaluate.load(METRIC_PATH)
        metrics = metric.compute(log_likelihood=[r[0] for r in ordered], is_greedy=[r[1] for r in ordered])
        metrics.update(model=args.model_name_or_path, adapter=args.adapter_path, world_size=accelerator.num_processes)
        Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        (Path(args.output_dir) / "metrics.json").write_text(json.dumps(metrics, indent=2))
        print(json.dumps(metrics, indent=2))
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return metrics


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
