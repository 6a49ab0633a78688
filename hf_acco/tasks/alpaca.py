"""Alpaca-format instruction data: the standard prompt template, response-only labels, a checkable generated set,
and a word-level tokenizer built locally (so the recipes run with nothing downloaded)."""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from pathlib import Path

PROMPT_WITH_INPUT = (
    "Below is an instruction that describes a task, paired with an input that provides further context. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n"
)
PROMPT_NO_INPUT = (
    "Below is an instruction that describes a task. "
    "Write a response that appropriately completes the request.\n\n"
    "### Instruction:\n{instruction}\n\n### Response:\n"
)
FIELDS = ("instruction", "input", "output")


def format_prompt(record: dict) -> str:
    """The Stanford Alpaca prompt, with or without the input section."""
    if record.get("input", "").strip():
        return PROMPT_WITH_INPUT.format(instruction=record["instruction"], input=record["input"])
    return PROMPT_NO_INPUT.format(instruction=record["instruction"])


def tokenize_example(record: dict, tokenizer, max_length: int) -> dict:
    """input_ids and labels: the prompt is masked (-100), the response and its end-of-sequence token are learned.

    Longer examples are cut at ``max_length`` but keep the end-of-sequence token as their last token, so the
    model still learns where a response ends.
    """
    if tokenizer.eos_token_id is None:
        raise ValueError("The tokenizer has no end-of-sequence token; set tokenizer.eos_token.")
    prompt = tokenizer(format_prompt(record), add_special_tokens=False)["input_ids"]
    response = tokenizer(record["output"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = (prompt + response)[:max_length]
    labels = ([-100] * len(prompt) + response)[:max_length]
    if ids[-1] != tokenizer.eos_token_id:
        ids[-1], labels[-1] = tokenizer.eos_token_id, tokenizer.eos_token_id
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}


def load_records(path: str | Path) -> list[dict]:
    """Alpaca records from a JSON list or a JSONL file, checked for the three fields."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(
            f"Dataset file {path} does not exist. Pass --dataset_path to an Alpaca JSON/JSONL file."
        )
    text = path.read_text(encoding="utf-8")
    records = (
        json.loads(text) if text.lstrip().startswith("[") else [json.loads(x) for x in text.splitlines() if x.strip()]
    )
    return check_records(records, str(path))


def check_records(records: Sequence[dict], where: str) -> list[dict]:
    if not records:
        raise ValueError(f"{where} holds no example.")
    for i, r in enumerate(records):
        missing = [f for f in ("instruction", "output") if f not in r]
        if missing:
            raise ValueError(
                f"{where}: example {i} lacks {missing} (has {sorted(r)}). Alpaca data needs 'instruction', 'output' "
                "and optionally 'input'."
            )
    return [
        {"instruction": r["instruction"], "input": r.get("input", "") or "", "output": r["output"]} for r in records
    ]


# ---- the embedded default: instructions whose answers a program can check ------------------------------------

WORDS = ["apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "candle", "garden", "rocket",
         "window", "forest", "silver", "button", "pepper", "island"]  # fmt: skip
NUMBERS = [str(n) for n in range(10)]


def _task(rng: random.Random) -> dict:
    kind = rng.randrange(5)
    if kind == 0:
        words = rng.sample(WORDS, rng.randint(2, 4))
        return {"instruction": "Reverse the order of these words.", "input": " ".join(words),
                "output": " ".join(reversed(words))}  # fmt: skip
    if kind == 1:
        nums = [rng.choice(NUMBERS) for _ in range(rng.randint(2, 4))]
        return {"instruction": "Sort these numbers from smallest to largest.", "input": " ".join(nums),
                "output": " ".join(sorted(nums, key=int))}  # fmt: skip
    if kind == 2:
        word = rng.choice(WORDS)
        return {"instruction": "Repeat the word three times.", "input": word, "output": " ".join([word] * 3)}
    if kind == 3:
        a, b = rng.randrange(10), rng.randrange(10)
        return {"instruction": "What is the sum of the two numbers?", "input": f"{a} {b}", "output": str(a + b)}
    pair = rng.sample(WORDS, 2)
    return {
        "instruction": "Which word comes first in alphabetical order?",
        "input": " ".join(pair),
        "output": min(pair),
    }


def generated_alpaca(n: int, seed: int = 0) -> list[dict]:
    """``n`` Alpaca-format records with answers a program can check (reverse, sort, repeat, add, alphabetical)."""
    rng = random.Random(seed)
    return [_task(rng) for _ in range(n)]


def build_word_tokenizer(texts: Sequence[str]):
    """A word-level tokenizer over ``texts`` (words and punctuation), with <pad>, <unk> and </s>."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    pre = pre_tokenizers.Whitespace()
    vocab = {"<pad>": 0, "<unk>": 1, "</s>": 2}
    for text in texts:
        for word, _ in pre.pre_tokenize_str(text):
            vocab.setdefault(word, len(vocab))
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="</s>")


def normalise(text: str) -> str:
    return " ".join(text.split())
