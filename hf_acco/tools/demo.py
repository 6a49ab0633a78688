"""``python -m hf_acco.demo`` (or ``hf-acco-demo``): ACCOTrainer on 2 CPU ranks in under a minute, from the installed
package alone and nothing downloaded: a generated Alpaca-format instruction set whose answers a program checks
(hf_acco.tasks.alpaca), a word-level tokenizer and a small Llama built here. It prints the held-out loss on the
response tokens before and after training.

    python -m hf_acco.demo                       # 2 ranks, 120 steps (about 20 s)
    python -m hf_acco.demo --nproc 3 --max_steps 100 --schedule sync

Run without a launcher it starts its ranks itself with torchrun (``--standalone``: a free port on this machine);
under ``accelerate launch`` or ``torchrun`` it is one of the ranks. The full instruction-tuning recipe, with exact
match, LoRA, TRL and real data, is ``recipes/alpaca_finetune.py`` in the repository.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

from hf_acco.tools.cli_types import POSITIVE_INT


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m hf_acco.demo", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--nproc", type=POSITIVE_INT, default=2, help="CPU ranks to start (default 2)")
    parser.add_argument("--max_steps", type=POSITIVE_INT, default=120, help="optimizer steps (default 120)")
    parser.add_argument("--schedule", choices=("acco", "dpu", "sync"), default="acco", help="ACCO's schedule")
    parser.add_argument("--output_dir", default=None, help="where Trainer writes (default: a temporary folder)")
    return parser


def main(argv: list[str] | None = None) -> float | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = make_parser().parse_args(argv)
    if "RANK" not in os.environ:  # no launcher: start the ranks, as `accelerate launch` / torchrun would
        from torch.distributed.run import main as torchrun

        torchrun(["--standalone", "--nproc_per_node", str(args.nproc), "-m", "hf_acco.demo", *argv])
        return None
    with tempfile.TemporaryDirectory() as scratch:
        return train(args, args.output_dir or scratch)


def train(args: argparse.Namespace, output_dir: str) -> float:
    """One rank's part: train, and return (rank 0: print) the held-out loss after training."""
    import torch
    from datasets import Dataset
    from transformers import DataCollatorForSeq2Seq, LlamaConfig, LlamaForCausalLM

    from hf_acco.integrations.config import ACCOConfig
    from hf_acco.integrations.teardown import end_training
    from hf_acco.integrations.trainer import ACCOTrainer
    from hf_acco.tasks.alpaca import build_word_tokenizer, format_prompt, generated_alpaca, tokenize_example

    records = generated_alpaca(1200)
    tokenizer = build_word_tokenizer([format_prompt(r) + " " + r["output"] for r in records])
    torch.manual_seed(0)
    model = LlamaForCausalLM(
        LlamaConfig(vocab_size=len(tokenizer), hidden_size=96, intermediate_size=256, num_hidden_layers=2,
                    num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                    pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id,
                    bos_token_id=tokenizer.eos_token_id)
    )  # fmt: skip
    tokenized = [tokenize_example(r, tokenizer, 128) for r in records]
    config = ACCOConfig(
        output_dir=output_dir, use_cpu=True, per_device_train_batch_size=16, gradient_accumulation_steps=2,
        per_device_eval_batch_size=50, learning_rate=3e-3, weight_decay=0.01, warmup_steps=6,
        lr_scheduler_type="cosine", max_grad_norm=1.0, max_steps=args.max_steps, logging_steps=10,
        save_strategy="no", report_to=[], disable_tqdm=True, seed=0, acco_schedule=args.schedule,
    )  # fmt: skip
    trainer = ACCOTrainer(
        model=model,
        args=config,
        train_dataset=Dataset.from_list(tokenized[100:]),
        eval_dataset=Dataset.from_list(tokenized[:100]),
        data_collator=DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100),
    )
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    if trainer.is_world_process_zero():
        print(
            f"hf_acco demo: ACCOTrainer ({args.schedule}) on {trainer.args.world_size} CPU ranks, {args.max_steps} "
            f"steps: held-out loss {before:.3f} -> {after:.3f}"
        )
    end_training(trainer.accelerator, trainer)
    return after
