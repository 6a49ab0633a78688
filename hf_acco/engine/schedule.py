"""The step machine: schedules, phases and what each optimizer-step boundary does (pure Python).

One optimizer step of ``acco`` has two halves (``docs/algorithm.md``)::

    phase       computes at          ends with (boundary)                                      round it launches
    ESTIMATE    the estimate θ̃_t     A→B: wait for the commit round of t-1, load θ_t            ESTIMATE (G_A)
    CORRECTION  the committed θ_t    B→A (step()): wait for the estimate round, load θ̃_{t+1}   COMMIT (G_A + G_B)

``dpu`` and ``sync`` have one phase, CORRECTION, and one boundary per step: ``dpu`` loads the output of the previous
step's commit round and launches this step's (one-step delay); ``sync`` launches the commit round and waits for it
at once (ZeRO-1). During ``warmup_steps`` every schedule runs as ``sync``.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any


class Schedule(str, Enum):
    ACCO = "acco"  # estimate + correction halves, two rounds per step
    DPU = "dpu"  # one-step delayed update, one round per step
    SYNC = "sync"  # ZeRO-1, round waited for at once


SCHEDULES = tuple(s.value for s in Schedule)


class Accumulation(str, Enum):
    FIXED = "fixed"  # a set number of micro-batches per half per rank
    DYNAMIC = "dynamic"  # each rank computes until the round in flight has finished
    PACED = "paced"  # the caller ends halves and steps (claimed micro-batches, see pacing.py)


class Phase(Enum):
    ESTIMATE = "estimate"  # half A: gradients at the estimate θ̃_t (ACCO only)
    CORRECTION = "correction"  # half B: gradients at the committed θ_t; the only phase of dpu and sync


class RoundKind(Enum):
    ESTIMATE = "estimate"  # look-ahead update, state not kept
    COMMIT = "commit"  # optimizer step, kept


@dataclass(frozen=True)
class StepEnd:
    """What the B→A boundary (the end of an optimizer step) does under one schedule."""

    load_first: bool  # wait for the round in flight and load its output into the model before launching
    wait_at_once: bool  # wait for this step's commit round before returning (no overlap)


STEP_END = {
    Schedule.ACCO: StepEnd(load_first=True, wait_at_once=False),  # load θ̃_{t+1}; commit round of t in flight
    Schedule.DPU: StepEnd(load_first=True, wait_at_once=False),  # load θ_t; commit round of t in flight
    Schedule.SYNC: StepEnd(load_first=False, wait_at_once=True),  # commit round of t, then load θ_{t+1}
}


def schedule_at(schedule: Schedule, step_count: int, warmup_steps: int) -> Schedule:
    """The schedule in force at optimizer step ``step_count``: synchronous during the warm-up."""
    return Schedule.SYNC if step_count < warmup_steps else schedule


def first_phase(schedule: Schedule) -> Phase:
    """The phase an optimizer step starts in: half A for acco, the only phase otherwise."""
    return Phase.ESTIMATE if schedule is Schedule.ACCO else Phase.CORRECTION


def parse_enum(cls: type[Enum], value: Any, what: str) -> Any:
    try:
        return cls(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in cls)  # type: ignore[attr-defined]
        raise ValueError(f"{what} must be one of {allowed}, got {value!r}") from None


def parse_settings(
    schedule: str, accumulation: str, micro_batches: int, min_mb: int = 1, max_mb: int | None = None
) -> tuple[Schedule, Accumulation]:
    """The schedule and accumulation named, once checked to work together with these micro-batch counts."""
    parsed = parse_enum(Schedule, schedule, "schedule"), parse_enum(Accumulation, accumulation, "accumulation")
    check_counts(*parsed, micro_batches, min_mb, max_mb)
    return parsed


def validate_settings(
    schedule: str,
    accumulation: str,
    micro_batches: int,
    min_micro_batches: int = 1,
    max_micro_batches: int | None = None,
) -> None:
    """Raise a ValueError that says what to change if these ACCO settings cannot work together."""
    parse_settings(schedule, accumulation, micro_batches, min_micro_batches, max_micro_batches)


def check_counts(
    schedule: Schedule, accumulation: Accumulation, micro_batches: int, min_mb: int, max_mb: int | None
) -> None:
    if accumulation is Accumulation.PACED:
        return  # the caller's data says where halves and steps end (pacing.py checks its own counts)
    if accumulation is Accumulation.FIXED:
        if schedule is Schedule.ACCO and micro_batches < 2:
            raise ValueError(
                f"ACCO with fixed accumulation splits each optimizer step into two halves of at least one "
                f"micro-batch each, so micro_batches must be >= 2; got {micro_batches}. Use 2 (ACCOTrainer splits "
                "a window of one micro-batch along the batch dimension itself), or accumulation='dynamic'."
            )
        if micro_batches < 1:
            raise ValueError(f"micro_batches must be >= 1, got {micro_batches}")
        return
    if schedule is Schedule.SYNC:
        raise ValueError(
            "Dynamic accumulation keeps computing while a round is in flight; the 'sync' schedule has no round in "
            "flight. Use accumulation='fixed' with 'sync', or schedule 'acco' or 'dpu' with 'dynamic'."
        )
    if min_mb < 1 or (max_mb is not None and max_mb < min_mb):
        raise ValueError(f"need 1 <= min_micro_batches <= max_micro_batches, got {min_mb} and {max_mb}")
