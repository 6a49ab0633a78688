"""LAMBADA (`lambada_openai`) with lm-evaluation-harness's exact definitions, for any causal LM.

* context = the text before its last space-separated chunk; target = " " + that chunk (``split_context_target``);
* pair tokenisation: trailing whitespace of the context moves to the continuation, then
  ``cont = tok(context + target)[len(tok(context)):]`` (``encode_pair``);
* the model sees ``(ctx + cont)[-(max_length + 1):][:-1]``; a passage scores the summed log-probability of ``cont``
  and whether every ``cont`` token is the greedy prediction (``score``);
* accuracy = mean(greedy), perplexity = exp(-mean(log-likelihood)): the ``evaluate`` module at ``METRIC_PATH``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch
import torch.nn.functional as F

METRIC_PATH = os.path.join(os.path.dirname(__file__), "metrics", "lambada_openai", "lambada_openai.py")


def split_context_target(text: str) -> tuple[str, str]:
    """lm-eval's doc_to_text / doc_to_target: split on the last " " (spaces only)."""
    words = text.split(" ")
    if len(words) < 2:
        raise ValueError(f"A LAMBADA passage needs at least two space-separated words, got {text[:80]!r}")
    return " ".join(words[:-1]), " " + words[-1]


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """lm-eval's ``_encode_pair``: token ids of the context and of the continuation, without special tokens."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        continuation = context[-spaces:] + continuation
        context = context[:-spaces]
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    ctx = tokenizer(context, add_special_tokens=False)["input_ids"]
    return ctx, whole[len(ctx) :]


@torch.no_grad()
def score(
    model: torch.nn.Module, pairs: Sequence[tuple[list[int], list[int]]], max_length: int, pad_id: int = 0
) -> list[tuple[float, bool]]:
    """(summed log-probability of the continuation, whether it is all greedy) for each (context, continuation).

    Rows are left-padded with explicit position ids, so every continuation ends at the last position and the
    model is asked only for the logits of the last positions (``logits_to_keep``): a 50k vocabulary costs no
    full-sequence logits.
    """
    for _, cont in pairs:
        if not 0 < len(cont) <= max_length:
            raise ValueError(f"A target of {len(cont)} tokens does not fit max_length={max_length}.")
    inputs = [(ctx + cont)[-(max_length + 1) :][:-1] for ctx, cont in pairs]
    width = max(len(x) for x in inputs)
    device = next(model.parameters()).device
    ids = torch.full((len(inputs), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(inputs), width), dtype=torch.long)
    for i, x in enumerate(inputs):
        ids[i, width - len(x) :] = torch.tensor(x)
        mask[i, width - len(x) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    keep = max(len(cont) for _, cont in pairs)
    kwargs = {"input_ids": ids.to(device), "attention_mask": mask.to(device), "position_ids": positions.to(device)}
    try:
        logits = model(**kwargs, logits_to_keep=keep).logits
    except TypeError:  # a model without logits_to_keep: all positions
        logits = model(**kwargs).logits
    logprobs = F.log_softmax(logits[:, -keep:].float(), dim=-1)
    out = []
    for i, (_, cont) in enumerate(pairs):
        rows = logprobs[i, keep - len(cont) :]  # the positions that predict the continuation's tokens
        target = torch.tensor(cont, device=rows.device)
        ll = rows.gather(1, target[:, None]).sum().item()
        out.append((ll, bool((rows.argmax(-1) == target).all())))
    return out


def load_jsonl_texts(path: str | os.PathLike) -> list[str]:
    """The ``text`` field of each line of a JSONL file (the format of OpenAI's lambada_test.jsonl)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"LAMBADA file {path} does not exist. Pass --dataset_path to a JSONL with a 'text' field."
        )
    texts = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if line.strip():
                record = json.loads(line)
                if "text" not in record:
                    raise ValueError(f"{path}:{n} has no 'text' field (keys: {sorted(record)}).")
                texts.append(record["text"])
    return texts


def batches(items: Sequence, size: int) -> Iterable[Sequence]:
    for i in range(0, len(items), size):
        yield items[i : i + size]
