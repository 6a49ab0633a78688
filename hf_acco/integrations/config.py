"""ACCOConfig: TrainingArguments plus the ACCO settings (every field specific to ACCO starts with ``acco_``).

``ACCOConfigMixin`` holds those settings alone, so that they join any TrainingArguments subclass (TRL's configs)
without resetting its defaults; ``ACCOConfig`` is the mixin plus TrainingArguments."""

from __future__ import annotations

import os
import warnings
from dataclasses import dataclass, field
from datetime import timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Any

from accelerate.utils import str_to_bool
from transformers import TrainingArguments

from accelerate import PartialState
from hf_acco.comm.communicator import REDUCE_SCATTER_SPELLINGS
from hf_acco.comm.deltas import GATHER_DTYPES
from hf_acco.engine.buffers import GRAD_DTYPES, WIRE_DTYPES
from hf_acco.engine.rounds import NONFINITE_POLICIES
from hf_acco.engine.schedule import SCHEDULES, Accumulation, validate_settings
from hf_acco.integrations.versions import warn_if_untested

warn_if_untested("transformers")
warn_if_untested("accelerate")


def acco_setting(args: TrainingArguments, name: str) -> Any:
    """An ``acco_*`` setting of ``args``, or its default (declared once, on ``ACCOConfigMixin``'s field) for a plain
    TrainingArguments."""
    return getattr(args, name, ACCOConfigMixin.__dataclass_fields__[name].default)


def check_choices(args: TrainingArguments) -> None:
    """Every ``acco_*`` setting that declares its choices (the engine's own lists) holds one of them."""
    for name, f in ACCOConfigMixin.__dataclass_fields__.items():
        choices, value = f.metadata.get("choices"), getattr(args, name)
        if choices is not None and value not in choices:
            raise ValueError(f"{name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def splits_batches(args: TrainingArguments) -> bool:
    """Whether each micro-batch is split in two along the batch dimension to make an acco step's two halves (fixed
    accumulation with one micro-batch per step)."""
    fixed_acco = acco_setting(args, "acco_schedule") == "acco" and acco_setting(args, "acco_accumulation") == "fixed"
    return fixed_acco and args.gradient_accumulation_steps == 1


# Trainer's accumulation settings: the engine's fixed and paced, and "dynamic", paced's alias under Trainer (the
# engine's own dynamic mode, round-timed halves, is for hand-written loops)
TRAINER_ACCUMULATIONS = (Accumulation.FIXED.value, Accumulation.PACED.value, "dynamic")


def engine_accumulation(args: TrainingArguments) -> str:
    """The engine's accumulation mode: ``acco_accumulation="dynamic"`` under Trainer is paced (pacing.py): each
    step is one global batch of ``world_size x gradient_accumulation_steps`` micro-batches claimed by the ranks at
    their own pace."""
    return "paced" if acco_setting(args, "acco_accumulation") in TRAINER_ACCUMULATIONS[1:] else "fixed"


def engine_micro_batches(args: TrainingArguments) -> int:
    """Micro-batches per optimizer step as the engine counts them (two half-batches for a split window)."""
    return 2 if splits_batches(args) else args.gradient_accumulation_steps


def check_halves(args: TrainingArguments) -> None:
    """A window of one sample cannot make two halves: say what to change."""
    if splits_batches(args) and args.per_device_train_batch_size < 2:
        raise ValueError(
            "With acco_schedule='acco' and fixed accumulation each optimizer step has two halves; one micro-batch "
            "of one sample (per_device_train_batch_size=1, gradient_accumulation_steps=1) cannot be split. Use "
            "gradient_accumulation_steps >= 2 or per_device_train_batch_size >= 2, or acco_schedule='sync' / "
            "'dpu' (one half per step), or acco_accumulation='paced'."
        )


# settings that did nothing under ACCOTrainer: still parsed (so that passing one says what to do), then refused
REMOVED_SETTINGS = ("acco_min_micro_batches",)


if TYPE_CHECKING:  # the type checker reads the mixin as the TrainingArguments it is always mixed into
    _ArgsBase = TrainingArguments
else:
    _ArgsBase = object


@dataclass
class ACCOConfigMixin(_ArgsBase):
    """Only the ``acco_*`` settings and their checks, for any TrainingArguments subclass:
    ``@dataclass class MyConfig(ACCOConfigMixin, SFTConfig)`` keeps every default of ``SFTConfig``.

    Every field's meaning, default and when to change it are its ``help`` (shown by ``--help`` under
    ``HfArgumentParser``; the README's options table is rendered from them by ``python -m hf_acco.tools.docs``).
    """

    acco_schedule: str = field(
        default="acco",
        metadata={
            "help": (
                "acco: two rounds per step hidden behind compute, each half's gradients at an estimate of the "
                "next parameters (the point of ACCO). sync: ZeRO-1 without overlap, equal to DDP (a baseline, or "
                "where communication is cheap). dpu: a one-step delayed update (hides communication, converges "
                "worse)."
            ),
            "choices": list(SCHEDULES),
        },
    )
    acco_accumulation: str = field(
        default="fixed",
        metadata={
            "help": (
                "fixed: gradient_accumulation_steps micro-batches per step on every rank (reproducible). paced: "
                "for GPUs of unequal speed: a global batch of world_size x gradient_accumulation_steps micro-batches "
                "per step, each rank computing as many of them as its speed allows (every sample once per epoch); "
                "'dynamic', its old name, is taken with a warning."
            ),
            "choices": [*TRAINER_ACCUMULATIONS],
        },
    )
    acco_min_micro_batches: int | None = field(
        default=None,
        metadata={
            "help": "Removed: it had no effect under ACCOTrainer (a half is half of the global batch, whoever "
            "computes it). Set gradient_accumulation_steps instead; a hand-written loop with the engine's own "
            "dynamic mode passes min_micro_batches to prepare_acco or ACCOOptimizer."
        },
    )
    acco_warmup_steps: int = field(
        default=0,
        metadata={
            "help": (
                "Synchronous optimizer steps before the schedule starts. acco needs none; dpu converges better "
                "with some."
            )
        },
    )
    acco_reduce_scatter: str = field(
        default="auto",
        metadata={
            "help": (
                "How the gradients' reduce-scatter is spelled: auto (all-to-all on gloo, native on NCCL), native "
                "or all_to_all. Leave it on auto."
            ),
            "choices": list(REDUCE_SCATTER_SPELLINGS),
        },
    )
    acco_bucket_numel: int | None = field(
        default=None,
        metadata={
            "help": (
                "Elements per communication bucket. Default: automatic (about 16 buckets of 256 KiB-16 MiB on "
                "gloo, 16 MiB-1 GiB on NCCL); python -m hf_acco.plan suggests one for slow links."
            )
        },
    )
    acco_nonfinite: str = field(
        default="skip",
        metadata={
            "help": (
                "An inf/NaN in the averaged gradient (every rank sees the same norm): skip the step on every rank "
                "(counted as acco_skipped_steps), or error: stop."
            ),
            "choices": list(NONFINITE_POLICIES),
        },
    )
    acco_comm_timeout_s: float = field(
        default=1800.0,
        metadata={
            "help": (
                "Seconds a round's collectives wait for a peer before the job stops with an error naming it. "
                "Raise it only if a healthy round can take longer."
            )
        },
    )
    acco_comm_dtype: str = field(
        default="auto",
        metadata={
            "help": (
                "Gradients on the wire: auto (the model's dtype, as DDP does: bf16 for a bf16 model), fp32 "
                "(exact; more bytes and a larger round buffer), bf16, or int8 for slow links (a quarter of fp32's "
                "bytes: blockwise, a scale per 256 elements, summed in fp32 by the owner; compare its loss with "
                "bf16's on a short run first). Parameters: acco_gather_dtype."
            ),
            "choices": list(WIRE_DTYPES),
        },
    )
    acco_gather_dtype: str = field(
        default="auto",
        metadata={
            "help": (
                "Parameters in the all-gather: auto (the model's dtype, exact), or int8 / int4 for slow links: each "
                "owner sends the change since what every rank holds, blockwise (about a half / a quarter of bf16's "
                "bytes); every rank applies the same bytes and the next change carries the rounding, so nothing "
                "drifts from the fp32 master."
            ),
            "choices": list(GATHER_DTYPES),
        },
    )
    acco_error_feedback: bool = field(
        default=False,
        metadata={
            "help": (
                "With acco_comm_dtype=int8: carry each optimizer step's rounding of this rank's gradients into the "
                "next step's, so that it does not add up over steps (a float32 residual of the gradient buffer's "
                "size per rank, or of its share per machine on several machines; saved in the checkpoint)."
            )
        },
    )
    acco_allow_custom_optimizer: bool = field(
        default=False,
        metadata={
            "help": (
                "Accept an optimizer class given as optimizer_cls_and_kwargs that ACCO does not know to be "
                "element-wise (you vouch that each element's update depends only on that element)."
            )
        },
    )
    acco_grad_dtype: str = field(
        default="fp32",
        metadata={
            "help": (
                "Gradient accumulation: fp32, or bf16 to halve the accumulation buffer of the largest bf16 models "
                "(needs bf16 on the wire; each micro-batch's gradient rounded as it is added)."
            ),
            "choices": list(GRAD_DTYPES),
        },
    )

    def __post_init__(self) -> None:
        check_supported(self)  # before Trainer's own set-up, which would try to import DeepSpeed, FSDP, ...
        super().__post_init__()
        check_halves(self)
        check_choices(self)
        validate_settings(self.acco_schedule, engine_accumulation(self), engine_micro_batches(self))
        for name in REMOVED_SETTINGS:
            if getattr(self, name) is not None:
                raise ValueError(f"{name}: {self.__dataclass_fields__[name].metadata['help']}")
        if self.acco_accumulation == "dynamic":
            warnings.warn(
                "acco_accumulation='dynamic' is the old name of acco_accumulation='paced', the same mode: use 'paced' "
                "('dynamic' will be refused in a later release; the engine's own dynamic mode, accumulation='dynamic' "
                "in prepare_acco or ACCOOptimizer, is another one).",
                FutureWarning,
                stacklevel=3,
            )
        if engine_accumulation(self) == "paced" and self.average_tokens_across_devices:
            # Trainer would all-gather token counts every step, holding fast ranks back to the slowest; ACCOTrainer
            # undoes the per-rank normalisation exactly instead (see ACCOTrainer._micro_batch_weight).
            self.average_tokens_across_devices = False
        if self.acco_bucket_numel is not None and self.acco_bucket_numel < 1:
            raise ValueError(f"acco_bucket_numel must be >= 1, got {self.acco_bucket_numel}")
        if self.acco_warmup_steps < 0:
            raise ValueError(f"acco_warmup_steps must be >= 0, got {self.acco_warmup_steps}")
        if self.acco_comm_timeout_s <= 0:
            raise ValueError(f"acco_comm_timeout_s must be > 0, got {self.acco_comm_timeout_s}")
        if self.acco_error_feedback and self.acco_comm_dtype != "int8":
            raise ValueError("acco_error_feedback carries int8 gradients' rounding: set acco_comm_dtype='int8' too.")
        if self.acco_grad_dtype == "bf16" and self.acco_comm_dtype == "fp32":
            raise ValueError(
                "acco_grad_dtype='bf16' needs bf16 on the wire (acco_comm_dtype='bf16', or 'auto' with a bf16 model): "
                "the sums go on the wire as they are."
            )

    @cached_property
    def _setup_devices(self):  # noqa: ANN202 - TrainingArguments' own property
        # On CPU, TrainingArguments (transformers 5.24) starts the process group without `ddp_timeout`, so a hung
        # peer would block Trainer's collectives for torch's default 30 minutes. Start it with the timeout.
        cpu = self.use_cpu or str_to_bool(os.environ.get("ACCELERATE_USE_CPU", "False"))
        if cpu and not PartialState._shared_state and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            PartialState(cpu=True, backend=self.ddp_backend, timeout=timedelta(seconds=self.ddp_timeout))
        return TrainingArguments._setup_devices.func(self)


@dataclass
class ACCOConfig(ACCOConfigMixin, TrainingArguments):
    """[`~transformers.TrainingArguments`] for [`ACCOTrainer`], with the ``acco_*`` settings of
    [`ACCOConfigMixin`].

    Trainer's defaults are kept: ``gradient_accumulation_steps`` (default 1) is the number of micro-batches per
    optimizer step per rank, as for Trainer. With ``acco_schedule="acco"`` and fixed accumulation the step's two
    halves come from that window unchanged: ``k // 2`` micro-batches in the first half and the rest in the second
    (1 + 2 for 3), and a window of one micro-batch is split along the batch dimension (its first
    ``batch_size // 2`` rows, then the rest).
    """


def check_supported(args: TrainingArguments) -> None:
    """Refuse settings ACCO cannot honour, with what to use instead."""
    if args.fp16:
        raise ValueError(
            "ACCO does not support fp16 (it needs dynamic loss scaling, which would have to skip steps inside the "
            "background round). Use bf16=True, or fp32."
        )
    if args.deepspeed:
        raise ValueError(
            "ACCO is its own ZeRO-1 sharded optimizer: do not combine it with DeepSpeed. Remove `deepspeed`, or use "
            "transformers.Trainer with DeepSpeed instead."
        )
    fsdp_config = args.fsdp_config if isinstance(args.fsdp_config, dict) else {}  # (a file name before post-init)
    if args.fsdp and int(fsdp_config.get("version", 2)) != 2:
        raise ValueError(
            "ACCO runs inside FSDP2 only (FSDP inside each machine, ACCO across machines); FSDP1 shards flat "
            "parameters ACCO cannot address. Set fsdp_config={'version': 2}."
        )
    parallelism = getattr(args, "parallelism_config", None)
    if parallelism is not None and any(
        (getattr(parallelism, name, 1) or 1) > 1 for name in ("tp_size", "cp_size", "sp_size")
    ):
        raise ValueError(
            "ACCO is data parallelism (with FSDP2 inside each machine at most): tensor, context and sequence "
            "parallelism are not supported. Set tp_size, cp_size and sp_size to 1 in `parallelism_config`."
        )
