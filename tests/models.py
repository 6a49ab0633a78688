"""Tiny models built from configs, deterministic micro-batches and loss functions for the tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 64
SEQ = 16


def tiny_llama(seed: int = 0, tie: bool = False) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
        tie_word_embeddings=tie,
    )
    return LlamaForCausalLM(config)


def decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices, none on biases and norm weights (what Trainer does)."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def batch(rank: int, index: int, masked: bool = False, size: int = 2) -> dict[str, torch.Tensor]:
    """Micro-batch ``index`` of rank ``rank``: the same tensors in every process that asks for it."""
    g = torch.Generator().manual_seed(1000 * rank + index)
    ids = torch.randint(0, VOCAB, (size, SEQ), generator=g)
    labels = ids.clone()
    if masked:  # a random-length prompt masked out: token counts differ between micro-batches
        for row in range(size):
            labels[row, : int(torch.randint(1, SEQ - 2, (1,), generator=g))] = -100
    return {"input_ids": ids, "labels": labels}


def mean_loss(model: torch.nn.Module, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float]:
    """Average by micro-batch count: loss is the micro-batch mean, weight 1."""
    return model(**b).loss, 1.0


def token_sum_loss(model: torch.nn.Module, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, float]:
    """Average by token count: loss is the sum over the micro-batch's label tokens, weight = their number."""
    logits = model(input_ids=b["input_ids"]).logits[:, :-1]
    labels = b["labels"][:, 1:]
    loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), labels.reshape(-1), reduction="sum")
    return loss, float((labels != -100).sum())
