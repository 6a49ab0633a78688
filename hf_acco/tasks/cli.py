"""The recipes' command lines (``alpaca_finetune.py``, ``pretrain_clm.py``): each puts its own training defaults
before what the user gives, and chooses the schedule from ``--method``. Their ``--help`` lists those defaults, and a
``--acco_schedule`` that ``--method`` would silently override is refused."""

from __future__ import annotations

import argparse


def defaults_help(defaults: list[str]) -> str:
    """The ``--help`` epilog: the recipe's own defaults, which the dataclasses' defaults above do not show."""
    return "This recipe's defaults, before the command line (which overrides them): " + " ".join(defaults)


def refuse_schedule(parser: argparse.ArgumentParser, argv: list[str]) -> None:
    """Exits with the usage when the user's arguments set ``--acco_schedule``: the recipe sets it from ``--method``.
    argparse itself reads ``argv`` (every spelling it takes: ``--acco-schedule``, ``=``, an abbreviation)."""
    default = parser.get_default("acco_schedule")
    parser.set_defaults(acco_schedule=None)
    try:
        given = parser.parse_known_args(argv)[0].acco_schedule
    finally:
        parser.set_defaults(acco_schedule=default)
    if given is not None:
        parser.error("--acco_schedule: this recipe sets the schedule with --method (acco, dpu or sync).")


def resume_target(value: str | None) -> str | bool | None:
    """``--resume_from_checkpoint`` as ``train()`` takes it: ``true`` (or ``last``, ``latest``) is True, the latest
    complete checkpoint in ``--output_dir`` (what the docs' "restart with resume_from_checkpoint=True" means on a
    command line, where TrainingArguments keeps the text); ``false`` or empty is None; anything else is a path."""
    if value is None or value.strip().lower() in ("", "false", "no", "none"):
        return None
    return True if value.strip().lower() in ("true", "yes", "last", "latest") else value
