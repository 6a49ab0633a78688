"""LAMBADA with lm-evaluation-harness's definitions: hand-computed values on a toy model, and the real test set."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import evaluate
import pytest
import torch

from hf_acco.tasks.lambada import METRIC_PATH, encode_pair, load_jsonl_texts, score, split_context_target

from .helpers import ROOT, accelerate_launch

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
CHARS = "abcd "


class CharTokenizer:
    """One token per character of 'abcd ' (ids 1..5; 0 is padding)."""

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [CHARS.index(c) + 1 for c in text]}


class Bigram(torch.nn.Module):
    """logits[t] = log P(next | token t) from a fixed table: log-probabilities are exact by construction."""

    def __init__(self, probs: torch.Tensor) -> None:
        super().__init__()
        self.table = torch.nn.Parameter(probs.log())

    def forward(self, input_ids, attention_mask=None, position_ids=None, logits_to_keep=0):
        logits = self.table[input_ids]
        return type("Out", (), {"logits": logits[:, -logits_to_keep:] if logits_to_keep else logits})


def _table() -> torch.Tensor:
    p = torch.full((6, 6), 0.1)  # rows: current token id 0..5; columns: next token id
    p[CHARS.index("b") + 1, CHARS.index(" ") + 1] = 0.5  # after 'b', ' ' is likely (greedy)
    p[CHARS.index(" ") + 1, CHARS.index("c") + 1] = 0.5  # after ' ', 'c' (greedy)
    p[CHARS.index("c") + 1, CHARS.index("a") + 1] = 0.5  # after 'c', 'a' is greedy, not 'd'
    return p / p.sum(-1, keepdim=True)


def test_context_and_target_follow_lm_eval() -> None:
    assert split_context_target('He said "Nadia') == ("He said", ' "Nadia')
    assert split_context_target("the end  word") == ("the end ", " word")  # split on single spaces only
    with pytest.raises(ValueError, match="at least two"):
        split_context_target("alone")


def test_trailing_context_whitespace_moves_to_the_continuation() -> None:
    assert encode_pair(CharTokenizer(), "ab ", "cd") == encode_pair(CharTokenizer(), "ab", " cd")
    ctx, cont = encode_pair(CharTokenizer(), "ab", " cd")
    assert ctx == [1, 2] and cont == [5, 3, 4]


def test_scores_equal_hand_computed_values() -> None:
    p = _table()
    ids = {c: CHARS.index(c) + 1 for c in CHARS}
    model, tok = Bigram(p), CharTokenizer()
    docs = ["ab cd", "ab ca", "aab cd"]  # different lengths: padding must not change anything
    pairs = [encode_pair(tok, *split_context_target(t)) for t in docs]
    got = score(model, pairs, max_length=16)
    # "ab cd": targets ' ', 'c', 'd' after 'b', ' ', 'c'
    ll_cd = math.log(p[ids["b"], ids[" "]]) + math.log(p[ids[" "], ids["c"]]) + math.log(p[ids["c"], ids["d"]])
    ll_ca = math.log(p[ids["b"], ids[" "]]) + math.log(p[ids[" "], ids["c"]]) + math.log(p[ids["c"], ids["a"]])
    assert got[0][0] == pytest.approx(ll_cd, rel=1e-6) and got[0][1] is False  # 'd' is not greedy after 'c'
    assert got[1][0] == pytest.approx(ll_ca, rel=1e-6) and got[1][1] is True
    assert got[2][0] == pytest.approx(ll_cd, rel=1e-6)
    metric = evaluate.load(METRIC_PATH).compute(log_likelihood=[g[0] for g in got], is_greedy=[g[1] for g in got])
    assert metric["lambada_acc"] == pytest.approx(1 / 3)
    assert metric["lambada_ppl"] == pytest.approx(math.exp(-(2 * ll_cd + ll_ca) / 3))
    assert metric["num_docs"] == 3


def test_left_truncation_to_max_length() -> None:
    p = _table()
    pairs = [encode_pair(CharTokenizer(), *split_context_target("aaaaab cd"))]
    short, full = score(Bigram(p), pairs, max_length=4), score(Bigram(p), pairs, max_length=64)
    assert [ll for ll, _ in short] == pytest.approx([ll for ll, _ in full])  # pytest 9: approx takes no tuples
    assert [greedy for _, greedy in short] == [greedy for _, greedy in full]
    with pytest.raises(ValueError, match="does not fit"):
        score(Bigram(p), pairs, max_length=2)


@pytest.mark.skipif(not (DATA / "lambada").is_dir(), reason="../shared/data/lambada is absent")
def test_real_lambada_all_passages_with_a_small_model() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel, GPT2Tokenizer

    texts = load_jsonl_texts(DATA / "lambada" / "lambada_openai_test.jsonl")
    assert len(texts) == 5153
    tokenizer = GPT2Tokenizer.from_pretrained(str(DATA / "tokenizers" / "gpt2"))
    pairs = [encode_pair(tokenizer, *split_context_target(t)) for t in texts]
    # the published facts about this file and tokenizer (shared/data/reference/lambada_openai_reference.md)
    assert round(sum(len(c) for _, c in pairs) / len(pairs), 4) == 1.2756
    assert sum(len(c) == 1 for _, c in pairs) == 4010
    assert max(len(a) + len(b) for a, b in pairs) == 224
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, n_positions=256)).eval()
    alone = [score(model, [pairs[i]], max_length=256)[0] for i in range(8)]  # no padding at all
    batched = score(model, pairs[:8], max_length=256)  # left-padded together
    assert [a[1] for a in alone] == [b[1] for b in batched]
    assert [a[0] for a in alone] == pytest.approx([b[0] for b in batched], rel=1e-5)
    order = sorted(range(len(pairs)), key=lambda i: len(pairs[i][0]) + len(pairs[i][1]))
    results = {}
    for start in range(0, len(order), 128):
        chunk = order[start : start + 128]
        for i, r in zip(chunk, score(model, [pairs[i] for i in chunk], max_length=256)):
            results[i] = r
    metric = evaluate.load(METRIC_PATH).compute(
        log_likelihood=[results[i][0] for i in range(len(pairs))], is_greedy=[results[i][1] for i in range(len(pairs))]
    )
    assert metric["num_docs"] == 5153
    # an untrained model: accuracy ~ 0 and a per-word perplexity near the uniform model's V^1.2756 ~ 1e6
    assert metric["lambada_acc"] < 0.01
    assert 1e5 < metric["lambada_ppl"] < 1e7, metric


def test_loader_errors_are_clear(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_jsonl_texts(tmp_path / "missing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"sentence": "x y"}\n')
    with pytest.raises(ValueError, match="has no 'text' field"):
        load_jsonl_texts(bad)
    assert os.path.isfile(METRIC_PATH)


def _tiny_model_dir(tmp_path: Path) -> tuple[Path, list[str]]:
    """A BPE tokenizer trained on generated text and a tiny GPT-2, saved like a Hub model: nothing downloaded."""
    import random

    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import GPT2Config, GPT2LMHeadModel, PreTrainedTokenizerFast

    rng = random.Random(0)
    words = ["the", "cat", "sat", "on", "a", "mat", "dog", "ran", "to", "house", "red", "blue", "big", "small"]
    texts = [" ".join(rng.choice(words) for _ in range(rng.randint(6, 14))) for _ in range(60)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=120, special_tokens=["<pad>", "<unk>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>")
    directory = tmp_path / "tiny"
    fast.save_pretrained(directory)
    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=len(fast), n_layer=1, n_head=2, n_embd=32, n_positions=64)).save_pretrained(
        directory
    )
    data = tmp_path / "lambada.jsonl"
    data.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
    return directory, texts


def _single_process(model_dir: Path, texts: list[str], adapter: Path | None = None) -> dict:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).eval()
    pairs = [encode_pair(tokenizer, *split_context_target(t)) for t in texts]
    got = score(model, pairs, max_length=64, pad_id=tokenizer.pad_token_id)
    return evaluate.load(METRIC_PATH).compute(log_likelihood=[g[0] for g in got], is_greedy=[g[1] for g in got])


def _launch(args: list[str], out: Path) -> dict:
    accelerate_launch(ROOT / "recipes/lambada_eval.py", "--output_dir", str(out), "--batch_size", "7", *args)
    return json.loads((out / "metrics.json").read_text())


def test_recipe_on_two_ranks_equals_one_process_also_with_an_adapter(tmp_path: Path) -> None:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model_dir, texts = _tiny_model_dir(tmp_path)
    got = _launch(
        ["--model_name_or_path", str(model_dir), "--dataset_path", str(tmp_path / "lambada.jsonl")], tmp_path / "base"
    )
    want = _single_process(model_dir, texts)
    assert got["world_size"] == 2 and got["num_docs"] == want["num_docs"] == 60
    assert got["lambada_acc"] == pytest.approx(want["lambada_acc"])
    assert got["lambada_ppl"] == pytest.approx(want["lambada_ppl"], rel=1e-5)
    # a LoRA adapter whose B matrices are not zero, so that it changes the scores
    lora = LoraConfig(r=2, target_modules=["c_attn"], fan_in_fan_out=True)  # GPT-2's Conv1D stores W transposed
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), lora)
    with torch.no_grad():
        for name, p in peft_model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.5)
    peft_model.save_pretrained(tmp_path / "adapter")
    adapted = _launch(["--model_name_or_path", str(model_dir), "--adapter_path", str(tmp_path / "adapter"),
                       "--dataset_path", str(tmp_path / "lambada.jsonl")], tmp_path / "lora")  # fmt: skip
    want_adapted = _single_process(model_dir, texts, adapter=tmp_path / "adapter")
    assert adapted["lambada_ppl"] == pytest.approx(want_adapted["lambada_ppl"], rel=1e-5)
    assert adapted["lambada_ppl"] != pytest.approx(got["lambada_ppl"], rel=1e-3)
