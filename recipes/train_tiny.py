"""Train a tiny causal LM with ACCO from a hand-written loop: the engine's own API, offline (launched by Accelerate).

    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml recipes/train_tiny.py
    accelerate launch --config_file accelerate_configs/cpu_2proc.yaml recipes/train_tiny.py --schedule sync

A small Llama built from a config learns byte-level text: ../shared/data/text/tinyshakespeare_input.txt when
present, else text the script generates. Reports held-out loss before and after training (on the committed
parameters), step time, and how long the main thread waited for communication. About a minute on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import torch
from accelerate import Accelerator
from transformers import LlamaConfig, LlamaForCausalLM

from hf_acco import ACCOOptimizer, check_world_size

DEFAULT_TEXT = Path(__file__).resolve().parents[1].parent / "shared/data/text/tinyshakespeare_input.txt"


def load_text(path: Path) -> str:
    if path.is_file():
        return path.read_text(encoding="utf-8")
    rng = random.Random(0)  # no data files: sentences with a learnable structure
    subjects, verbs, objects = (
        ["the cat", "a dog", "my friend", "the king"],
        ["sees", "likes", "finds"],
        ["a bird", "the sea", "bread"],
    )
    return " ".join(f"{rng.choice(subjects)} {rng.choice(verbs)} {rng.choice(objects)}." for _ in range(20000))


def batches(data: torch.Tensor, batch: int, seq: int, seed: int):
    g = torch.Generator().manual_seed(seed)
    while True:
        starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=g)
        yield torch.stack([data[s : s + seq] for s in starts])


@torch.no_grad()
def evaluate(model, data: torch.Tensor, seq: int, n: int = 16) -> float:
    model.eval()
    starts = torch.linspace(0, data.numel() - seq - 1, n).long()
    ids = torch.stack([data[s : s + seq] for s in starts]).to(next(model.parameters()).device)
    loss = model(input_ids=ids, labels=ids).loss.item()
    model.train()
    return loss


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--schedule", choices=["acco", "dpu", "sync"], default="acco")
    parser.add_argument("--accumulation", choices=["fixed", "dynamic"], default="fixed")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--micro_batches", type=int, default=4, help="per optimizer step per rank")
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--seq_len", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--text", type=Path, default=DEFAULT_TEXT)
    parser.add_argument("--output_dir", type=Path, default=Path("outputs/train_tiny"))
    return parser


def build(args: argparse.Namespace, device: torch.device) -> tuple[LlamaForCausalLM, ACCOOptimizer]:
    """A 2-layer byte-level Llama and its ACCO optimizer (weight decay on the matrices only)."""
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=args.seq_len,
    )
    model = LlamaForCausalLM(config).to(device)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = ACCOOptimizer(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr,
        schedule=args.schedule,
        accumulation=args.accumulation,
        micro_batches=args.micro_batches,
        max_grad_norm=1.0,
    )
    return model, optimizer


def main(argv: list[str] | None = None) -> dict:
    args = make_parser().parse_args(argv)
    accelerator = Accelerator(cpu=not torch.cuda.is_available() or os.environ.get("ACCELERATE_USE_CPU") == "1")
    check_world_size(accelerator.num_processes)  # fails loudly if the launch started a different number of ranks
    torch.manual_seed(0)
    data = torch.tensor(list(load_text(args.text).encode("utf-8")), dtype=torch.long)
    train, held_out = data[: int(0.95 * len(data))], data[int(0.95 * len(data)) :]
    model, optimizer = build(args, accelerator.device)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    loss_before = evaluate(model, held_out, args.seq_len)

    stream = batches(train, args.batch_size, args.seq_len, seed=accelerator.process_index)
    start, waited, micro = time.perf_counter(), 0.0, 0
    for step in range(args.steps):
        losses = []
        while True:  # fixed: micro_batches per step; dynamic: until the round in flight is done
            ids = next(stream).to(accelerator.device)
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            optimizer.after_backward()
            losses.append(loss.item())
            if optimizer.ready_to_step():
                break
        optimizer.step()  # the B->A boundary: the model now holds the next estimate
        scheduler.step()
        micro += len(losses)
        waited += optimizer.last_step_stats["wait_s"]
        if step % 20 == 0 and accelerator.is_main_process:
            print(f"step {step:4d}  train loss {sum(losses) / len(losses):.3f}  micro-batches {len(losses)}")
    elapsed = time.perf_counter() - start
    optimizer.finalize()  # the round in flight drained, the committed parameters left in the model
    loss_after = evaluate(model, held_out, args.seq_len)
    optimizer.close()
    metrics = {
        "schedule": args.schedule,
        "accumulation": args.accumulation,
        "world_size": accelerator.num_processes,
        "steps": args.steps,
        "micro_batches_this_rank": micro,
        "held_out_loss_before": loss_before,
        "held_out_loss_after": loss_after,
        "seconds": elapsed,
        "step_time_s": elapsed / args.steps,
        "exposed_comm_s_per_step": waited / args.steps,
    }
    if accelerator.is_main_process:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        (args.output_dir / "metrics.json").write_text(json.dumps(metrics, indent=2))
        print(json.dumps(metrics, indent=2))
    accelerator.end_training()
    return metrics


if __name__ == "__main__":
    main()
