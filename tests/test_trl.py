"""TRL's SFT and DPO trainers with ACCO (hf_acco.trl), 2 forked ranks: sync equals TRL's trainer under DDP,
acco tracks it, TRL's defaults survive in the ACCO configs."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

trl = pytest.importorskip("trl", reason="TRL is not installed (pip install -e '.[trl]')")

from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast  # noqa: E402

from hf_acco.tools.multiprocess import run_ranks  # noqa: E402

from .helpers import rel  # noqa: E402

WORDS = [f"w{i}" for i in range(40)]


def tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(["<pad>", "<unk>", "<eos>", *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")


def model(vocab: int) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                         pad_token_id=0, eos_token_id=2, bos_token_id=2)  # fmt: skip
    return LlamaForCausalLM(config)


def sft_data(n: int = 64):
    from datasets import Dataset

    g = torch.Generator().manual_seed(1)
    rows = []
    for _ in range(n):
        words = [WORDS[int(i)] for i in torch.randint(0, len(WORDS), (int(torch.randint(2, 7, (1,), generator=g)),),
                                                      generator=g)]  # fmt: skip
        rows.append({"prompt": " ".join(words), "completion": " " + " ".join(reversed(words))})
    return Dataset.from_list(rows)


def dpo_data(n: int = 64):
    from datasets import Dataset

    rows = [{"prompt": r["prompt"], "chosen": r["completion"], "rejected": " " + r["prompt"]} for r in sft_data(n)]
    return Dataset.from_list(rows)


COMMON = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2, max_steps=6, logging_steps=1,
              learning_rate=3e-3, use_cpu=True, report_to=[], bf16=False, gradient_checkpointing=False,
              save_strategy="no", disable_tqdm=True, seed=0, max_length=48)  # fmt: skip


def _train(rank: int, world_size: int, kind: str, acco: str | None, out: str, **options) -> dict:
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    from hf_acco.trl import ACCODPOConfig, ACCODPOTrainer, ACCOSFTConfig, ACCOSFTTrainer

    tok = tokenizer()
    settings = {**COMMON, **options, "output_dir": out}
    if kind == "sft":
        cls, config = (ACCOSFTTrainer, ACCOSFTConfig) if acco else (SFTTrainer, SFTConfig)
        data = sft_data()
    else:
        cls, config = (ACCODPOTrainer, ACCODPOConfig) if acco else (DPOTrainer, DPOConfig)
        data = dpo_data()
        settings["beta"] = 0.1
    extra = {} if kind == "sft" else {"ref_model": model(len(tok))}  # the same initial weights, frozen
    if acco:
        settings["acco_schedule"] = acco
    trainer = cls(model=model(len(tok)), args=config(**settings), train_dataset=data, processing_class=tok, **extra)
    trainer.train()
    if not acco and world_size > 1:
        assert isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel)
    return {
        "losses": [h["loss"] for h in trainer.state.log_history if "loss" in h],
        "params": torch.cat([p.detach().flatten() for p in trainer.model.parameters() if p.requires_grad]),
    }


def run(tmp_path: Path, kind: str, acco: str | None, **options) -> list[dict]:
    out = str(tmp_path / f"{kind}-{acco}-{len(options)}")
    return run_ranks(_train, world_size=2, backend=None, kind=kind, acco=acco, out=out, timeout=240, **options)


@pytest.mark.parametrize("options", [{}, {"packing": True}], ids=["completion_only", "packing"])
def test_sft_sync_equals_sft_under_ddp_and_acco_tracks_it(tmp_path: Path, options: dict) -> None:
    ddp = run(tmp_path, "sft", None, **options)
    sync = run(tmp_path, "sft", "sync", **options)
    acco = run(tmp_path, "sft", "acco", **options)
    assert len(ddp[0]["losses"]) == 6
    assert sync[0]["losses"] == pytest.approx(ddp[0]["losses"], rel=1e-5)
    assert rel(sync[0]["params"], ddp[0]["params"]) < 1e-5
    assert torch.equal(sync[0]["params"], sync[1]["params"])
    assert acco[0]["losses"] == pytest.approx(ddp[0]["losses"], rel=0.02)
    assert ddp[0]["losses"][-1] < ddp[0]["losses"][0]  # it learned something


def test_sft_with_int8_on_the_wire_tracks_sft_under_ddp(tmp_path: Path) -> None:
    """ACCOSFTConfig takes the int8 settings as any acco_* field: gradients, parameter changes, error feedback."""
    wire = {"acco_comm_dtype": "int8", "acco_gather_dtype": "int8", "acco_error_feedback": True}
    ddp = run(tmp_path, "sft", None)
    int8 = run(tmp_path, "sft", "acco", **wire)
    assert torch.equal(int8[0]["params"], int8[1]["params"])
    assert int8[0]["losses"] == pytest.approx(ddp[0]["losses"], rel=0.03)


def test_dpo_sync_equals_dpo_under_ddp_and_acco_tracks_it(tmp_path: Path) -> None:
    ddp = run(tmp_path, "dpo", None)
    sync = run(tmp_path, "dpo", "sync")
    acco = run(tmp_path, "dpo", "acco")
    assert sync[0]["losses"] == pytest.approx(ddp[0]["losses"], rel=1e-5)
    assert rel(sync[0]["params"], ddp[0]["params"]) < 1e-5
    assert acco[0]["losses"] == pytest.approx(ddp[0]["losses"], rel=0.02)


def test_trl_defaults_are_unchanged_in_the_acco_configs(tmp_path: Path) -> None:
    from trl import DPOConfig, SFTConfig

    from hf_acco.trl import ACCODPOConfig, ACCOSFTConfig

    for ours, theirs in ((ACCOSFTConfig, SFTConfig), (ACCODPOConfig, DPOConfig)):
        a, b = ours(output_dir=str(tmp_path), use_cpu=True), theirs(output_dir=str(tmp_path), use_cpu=True)
        differ = [f.name for f in dataclasses.fields(theirs) if getattr(a, f.name) != getattr(b, f.name)]
        assert differ == [], differ
        assert a.acco_schedule == "acco" and isinstance(a, theirs)
    assert ACCODPOConfig(output_dir=str(tmp_path), use_cpu=True).learning_rate == 1e-6  # DPO's, not Trainer's


def test_dynamic_accumulation_is_refused_for_trainers_that_gather_per_micro_batch(tmp_path: Path) -> None:
    from hf_acco.trl import ACCOSFTConfig, ACCOSFTTrainer

    tok = tokenizer()
    args = ACCOSFTConfig(
        output_dir=str(tmp_path),
        use_cpu=True,
        report_to=[],
        acco_accumulation="dynamic",
        gradient_accumulation_steps=2,
    )
    with pytest.raises(ValueError, match="gathers metrics across ranks on every micro-batch"):
        ACCOSFTTrainer(model=model(len(tok)), args=args, train_dataset=sft_data(8), processing_class=tok)


def test_the_config_is_found_by_name_not_position(tmp_path: Path) -> None:
    """DPOTrainer's second positional argument is ref_model: ACCO reads the config by the signature's name."""
    from hf_acco.trl import ACCODPOConfig, ACCODPOTrainer

    tok = tokenizer()
    args = ACCODPOConfig(output_dir=str(tmp_path), use_cpu=True, report_to=[], beta=0.1, max_length=48)
    policy, ref = model(len(tok)), model(len(tok))
    trainer = ACCODPOTrainer(policy, ref, args, None, dpo_data(8), processing_class=tok)
    assert trainer.args is args and trainer.ref_model is not None
