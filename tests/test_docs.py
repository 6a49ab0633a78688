"""The README's and docs' rendered tables are what their commands render now (`python -m hf_acco.tools.docs`), the
options table names every ACCO setting, and a removed setting is refused with what to do instead."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

import pytest

from hf_acco.tools import docs

ROOT = Path(__file__).resolve().parents[1]


def test_every_rendered_block_is_up_to_date():
    assert docs.stale() == [], "rerun `python -m hf_acco.tools.docs` and commit the result"


def test_the_options_table_names_every_acco_setting_with_its_default():
    from hf_acco.integrations.config import REMOVED_SETTINGS, ACCOConfigMixin

    readme = (docs.ROOT / "README.md").read_text()
    block = re.search(r"<!-- rendered: options -->\n(.*?)<!-- /rendered -->", readme, re.S).group(1)
    for f in dataclasses.fields(ACCOConfigMixin):
        assert f.name.startswith("acco_")
        if f.name in REMOVED_SETTINGS:
            assert f"`{f.name}`" in block.splitlines()[-1]  # listed as removed, not as an option
        else:
            assert f"| `{f.name}` |" in block and f.metadata["help"] in block


def test_a_removed_setting_is_refused_with_what_to_do(tmp_path):
    """From Python and from the command line (HfArgumentParser turns every field into a flag)."""
    from transformers import HfArgumentParser

    from hf_acco import ACCOConfig

    with pytest.raises(ValueError, match="acco_min_micro_batches: Removed.*gradient_accumulation_steps"):
        ACCOConfig(output_dir=str(tmp_path), use_cpu=True, acco_min_micro_batches=2)
    assert ACCOConfig(output_dir=str(tmp_path), use_cpu=True).acco_min_micro_batches is None
    parser = HfArgumentParser(ACCOConfig)
    with pytest.raises(ValueError, match="acco_min_micro_batches: Removed"):
        parser.parse_args_into_dataclasses(
            ["--output_dir", str(tmp_path), "--use_cpu", "--acco_min_micro_batches", "2"]
        )


def test_an_unknown_block_is_an_error():
    with pytest.raises(ValueError, match="unknown rendered block 'nope'"):
        docs.render("<!-- rendered: nope -->\nx\n<!-- /rendered -->\n", "x.md")


def test_every_result_file_records_the_command_that_wrote_it():
    """The figures of README.md and docs/ are rendered from these files (test_every_rendered_block_is_up_to_date:
    a missing file fails there); each says how it was made."""
    found = [p for base in ("recipes/results", "benchmarks/results") for p in (ROOT / base).rglob("*.json")]
    lacking = []
    for path in found:
        record = json.loads(path.read_text())
        if not (isinstance(record, dict) and (record.get("command") or record.get("commands"))):
            lacking.append(str(path.relative_to(ROOT)))
    assert len(found) > 20 and not lacking, lacking
