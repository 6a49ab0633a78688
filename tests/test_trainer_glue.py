"""The Trainer glue's contract with the installed transformers: every private method it overrides or calls, and every
private attribute it reads, exists on Trainer (a release that renames one fails here, not in a user's run)."""

from __future__ import annotations

import inspect

from transformers import Trainer

from hf_acco.integrations.trainer import mixin


def test_the_private_trainer_methods_the_glue_relies_on_exist():
    missing = [name for name in mixin.TRAINER_PRIVATE_METHODS if not callable(getattr(Trainer, name, None))]
    assert missing == [], (
        f"transformers' Trainer no longer has {missing}: hf_acco/integrations/trainer/ needs updating"
    )
    # every private Trainer method the mixin overrides is in the list (the list is the contract, kept complete)
    overridden = {n for n, v in vars(mixin.ACCOTrainerMixin).items() if n.startswith("_") and not n.startswith("__")}
    own = {"_micro_batch", "_paced_step", "_paced"}  # the mixin's own helpers, not Trainer's
    assert overridden - own <= set(mixin.TRAINER_PRIVATE_METHODS)


def test_the_private_trainer_attributes_the_glue_reads_are_set_by_trainer():
    source = inspect.getsource(Trainer.__init__) + inspect.getsource(Trainer)
    for name in mixin.TRAINER_PRIVATE_ATTRIBUTES:
        assert f"self.{name}" in source, f"transformers' Trainer no longer sets {name}"


def test_accelerate_returns_a_prepared_model_as_it_is():
    """ACCOTrainer's _wrap_model prepares the model without DDP (``prepare_model(..., evaluation_mode=True)``); Trainer
    then passes it to ``accelerator.prepare``, which must return a prepared model as it is (accelerate >= 1.14): an
    older one wraps it in DDP, whose all-reduce then runs beside ACCO's rounds (tests/test_trainer_weights.py sees
    the DDP wrapper at run time)."""
    from accelerate import Accelerator

    assert "_is_accelerate_prepared" in inspect.getsource(Accelerator.prepare_model)


def test_every_acco_default_is_declared_once_on_its_field():
    """No reader of an ``acco_*`` setting repeats its default (``getattr(args, "acco_x", default)``): they all ask
    ``config.acco_setting``, which reads the field's declaration."""
    import dataclasses
    import re
    from pathlib import Path

    from hf_acco.integrations.config import ACCOConfigMixin, acco_setting

    package = Path(mixin.__file__).resolve().parents[1]
    fallback = re.compile(r"""["'](acco_\w+)["']\s*,\s*(?:["'][^"']*["']|-?[\d.]+|True|False|None)\s*\)""")
    fields = {f.name for f in dataclasses.fields(ACCOConfigMixin)}
    found = [
        (str(f.relative_to(package)), m.group(1))
        for f in package.rglob("*.py")
        for m in fallback.finditer(f.read_text())
        if m.group(1) in fields
    ]
    assert found == [], f"defaults repeated outside their field: {found}"
    from transformers import TrainingArguments

    plain = TrainingArguments(output_dir="unused", use_cpu=True)
    for f in dataclasses.fields(ACCOConfigMixin):
        assert acco_setting(plain, f.name) == f.default


def test_paced_is_the_accumulation_dynamic_its_old_name_with_a_warning(tmp_path):
    import warnings

    import pytest

    from hf_acco import ACCOConfig
    from hf_acco.integrations.config import engine_accumulation

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        args = ACCOConfig(output_dir=str(tmp_path), use_cpu=True, acco_accumulation="paced")
    assert not [w for w in seen if "old name" in str(w.message)]
    assert engine_accumulation(args) == "paced" and not args.average_tokens_across_devices
    with pytest.warns(FutureWarning, match="old name of acco_accumulation='paced'"):
        args = ACCOConfig(output_dir=str(tmp_path), use_cpu=True, acco_accumulation="dynamic")
    assert engine_accumulation(args) == "paced" and not args.average_tokens_across_devices
    assert engine_accumulation(ACCOConfig(output_dir=str(tmp_path), use_cpu=True)) == "fixed"
