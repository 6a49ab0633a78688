"""Checkpoints under ACCOTrainer: which are complete (for the ranks that read them), which one to resume from (all
ranks agree), what a checkpoint holds beside Trainer's files (one optimizer shard per rank, the scheduler, the
position in the epoch), and the pre-emption (JIT) checkpoint taken by every rank at the same step."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from transformers import TrainerCallback, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from hf_acco.comm.communicator import node
from hf_acco.comm.failures import PeerFailure
from hf_acco.comm.groups import any_rank, barrier, every_rank
from hf_acco.engine.checkpoint import import_torch_state, load_optimizer_state, missing_shards, save_optimizer_state
from hf_acco.engine.shard_files import atomic_save, atomic_write_json, part_folders, shard_files
from hf_acco.engine.torch_format import FROM_SHARDS, local_state_from_full, scheduler_with_empty_groups
from hf_acco.integrations import fsdp
from hf_acco.integrations.trainer.engine import engine_of

if TYPE_CHECKING:  # the parts' trainer is always an ACCOTrainerMixin, seen through the attributes they use
    from hf_acco.integrations.trainer.run_state import TrainerParts

logger = logging.getLogger(__name__)

SCHEDULER_NAME = "scheduler.pt"
DATA_STATE_NAME = "acco_data_state.json"  # paced accumulation: the position in the epoch (pacing.Pacer.state_dict)
TRAINER_STATE_NAME = "trainer_state.json"
JIT_SENTINEL = "checkpoint-is-incomplete.txt"  # transformers' JIT checkpoint marks a checkpoint in progress
OPTIMIZER_NAME = "optimizer.pt"  # plain Trainer's optimizer state (transformers.trainer.OPTIMIZER_NAME)
FSDP_OPTIMIZER_NAME = "optimizer.bin"  # ... under FSDP with FULL_STATE_DICT (Accelerate's save_fsdp_optimizer)
FSDP_SHARDED_OPTIMIZER = "optimizer_0"  # ... with SHARDED_STATE_DICT: a DCP folder (not imported)


def trainer_checkpoint_kind(path: str) -> str | None:
    """``"ddp"`` for a checkpoint of plain Trainer (DDP or one process: ``optimizer.pt``, the whole optimizer state),
    ``"fsdp"`` for one of plain Trainer with FSDP (``optimizer.bin``: the whole state by parameter name; Trainer's
    ``FULL_STATE_DICT``), ``"fsdp_sharded"`` with ``SHARDED_STATE_DICT`` (an ``optimizer_0`` folder), when no ACCO
    shards are there; else None. ACCOTrainer resumes the first two (``import_trainer_*``)."""
    if shard_files(path) or part_folders(Path(path)):
        return None
    for kind, name in (
        ("ddp", OPTIMIZER_NAME),
        ("fsdp", FSDP_OPTIMIZER_NAME),
        ("fsdp_sharded", FSDP_SHARDED_OPTIMIZER),
    ):
        if os.path.exists(os.path.join(path, name)):
            return kind
    return None


def is_trainer_checkpoint(path: str) -> bool:
    """A checkpoint of plain Trainer, DDP's or FSDP's (``trainer_checkpoint_kind``)."""
    return trainer_checkpoint_kind(path) is not None


def stale_files(path: str) -> str | None:
    """Why ``path`` holds two optimizer states that disagree, or None: ACCO shards beside an ``optimizer.pt`` that
    was not made from them (``to-trainer`` marks the one it makes). Two runs saved the same step there (a plain
    Trainer run rewrote an ACCO checkpoint): which state goes with the model files cannot be told."""
    fsdp_file = os.path.join(path, FSDP_OPTIMIZER_NAME)
    if (part_folders(Path(path)) or shard_files(path)) and os.path.isfile(fsdp_file) and not _ours(fsdp_file):
        return (
            f"it holds ACCO's optimizer shards and a plain Trainer {FSDP_OPTIMIZER_NAME} (a plain Trainer FSDP run "
            "and an ACCO run saved this step into one directory): delete the stale one "
            f"({FSDP_OPTIMIZER_NAME}, or the acco_optimizer_rank*_of_*.pt files and fsdp_shard*_of_* folders) and "
            "resume"
        )
    optimizer_file = os.path.join(path, OPTIMIZER_NAME)
    found = shard_files(path)
    if not (found and os.path.isfile(optimizer_file)):
        return None
    try:
        made_from = torch.load(optimizer_file, map_location="cpu", weights_only=True, mmap=True).get(FROM_SHARDS)
        if made_from is not None and made_from.get("world_size") in found:
            files = found[made_from["world_size"]]
            shard = torch.load(next(iter(files.values())), map_location="cpu", weights_only=True, mmap=True)
            if made_from.get("step_count") == shard.get("step_count"):
                return None  # to-trainer's, from these shards
    except Exception as e:  # noqa: BLE001 - a damaged file: a reason, not a crash of the checkpoint scan
        return f"its {OPTIMIZER_NAME} or an optimizer shard cannot be read ({type(e).__name__}: {e})"
    return (
        f"it holds ACCO optimizer shards and a plain Trainer {OPTIMIZER_NAME} not made from them (a plain Trainer run "
        f"and an ACCO run saved this step into one directory): delete the stale one ({OPTIMIZER_NAME}, or the "
        "acco_optimizer_rank*_of_*.pt files) and resume"
    )


def _ours(optimizer_file: str) -> bool:
    """Whether an ``optimizer.bin`` is the placeholder ``prepare_acco``'s Accelerate ``save_state`` writes."""
    try:
        saved = torch.load(optimizer_file, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - unreadable: not ours
        return False
    return isinstance(saved, dict) and "hf_acco" in saved


def checkpoint_incomplete(path: str, world_size: int | None = None, ranks: list[int] | None = None) -> str | None:
    """Why ``path`` is not a complete ACCOTrainer checkpoint for ``ranks`` of a run on ``world_size`` ranks (for
    every rank when not given), or None.

    Every rank writes its files, then the ranks meet, then rank 0 (each node's first process with
    ``save_on_each_node``) writes ``trainer_state.json``: a checkpoint with a readable trainer state (and no JIT
    sentinel) has all its files. One killed while it was written lacks it. A per-node checkpoint holds only its
    node's optimizer shards: complete for the ranks that read it.
    """
    state = os.path.join(path, TRAINER_STATE_NAME)
    if not os.path.isfile(state):
        return f"it has no {TRAINER_STATE_NAME} (it was being written when the run stopped)"
    try:
        with open(state, encoding="utf-8") as f:
            json.load(f)
    except ValueError:
        return f"its {TRAINER_STATE_NAME} is truncated"
    if os.path.exists(os.path.join(path, JIT_SENTINEL)):
        return "its pre-emption (JIT) checkpoint did not finish"
    if is_trainer_checkpoint(path):  # plain Trainer's, complete once its trainer state is written
        return None
    stale = stale_files(path)
    if stale:
        return stale
    missing = missing_shards(path, world_size, ranks)
    return f"it lacks {missing}" if missing else None


def complete_checkpoints(output_dir: str, world_size: int | None = None, ranks: list[int] | None = None) -> dict:
    """{N: path} of the checkpoint-N directories in ``output_dir`` complete for ``ranks`` (see
    ``checkpoint_incomplete``); the others are named in a warning."""
    if not os.path.isdir(output_dir):
        return {}
    found = {}
    for name in os.listdir(output_dir):
        match = re.fullmatch(r"checkpoint-(\d+)", name)
        path = os.path.join(output_dir, name)
        if match and os.path.isdir(path):
            reason = checkpoint_incomplete(path, world_size, ranks)
            if reason is None:
                found[int(match.group(1))] = path
            else:
                # per rank, per node (each node may have its own copy): say which one saw it
                where = f"rank {ranks[0]}, {node()}" if ranks and len(ranks) == 1 else node()
                logger.warning("Skipping %s (on %s): %s.", path, where, reason)
    return found


def last_complete_checkpoint(
    output_dir: str, world_size: int | None = None, ranks: list[int] | None = None
) -> str | None:
    """The checkpoint-N directory with the highest N that is complete (see ``checkpoint_incomplete``), or None."""
    found = complete_checkpoints(output_dir, world_size, ranks)
    return found[max(found)] if found else None


def resolve_resume(args: TrainingArguments, resume_from_checkpoint: str | bool | None) -> str | bool | None:
    """The checkpoint ``train(resume_from_checkpoint=...)`` resumes from, agreed by all ranks (collective).

    Each rank checks what it reads (its own shard: on a per-node checkpoint, save_on_each_node, only its node's are
    there), so that no rank resumes from step 8 while another resumes from step 4, and a bad checkpoint fails on
    every rank alike. ``True``: the latest checkpoint complete on every rank."""
    world, rank = args.world_size, args.process_index
    if resume_from_checkpoint is True:
        mine = complete_checkpoints(args.output_dir, world, [rank])  # type: ignore[arg-type]  # (set by then)
        everywhere = set.intersection(*(set(steps) for steps in every_rank(sorted(mine))))
        for step in sorted(set(mine) - everywhere):
            logger.warning(
                "Skipping %s (on rank %d, %s): incomplete on another rank (its shard or its node's files).",
                mine[step],
                rank,
                node(),
            )
        if not everywhere:
            raise ValueError(  # Trainer's words, then ACCO's detail
                f"No valid checkpoint found in output directory ({args.output_dir}): no complete "
                "checkpoint to resume from. Start without resume_from_checkpoint, or point it at a checkpoint "
                "directory. A machine replaced with an empty disk (save_on_each_node): copy a surviving machine's "
                "checkpoint-N there and run python -m hf_acco.checkpoint rebuild checkpoint-N."
            )
        return mine[max(everywhere)]
    if isinstance(resume_from_checkpoint, str):
        if not os.path.isdir(resume_from_checkpoint):
            raise ValueError(f"Can't find a valid checkpoint at {resume_from_checkpoint}: not a directory.")
        reasons = every_rank(checkpoint_incomplete(resume_from_checkpoint, world, [rank]))
        reason = next((f"{r} (on rank {i})" for i, r in enumerate(reasons) if r is not None), None)
        if reason is not None:
            latest = last_complete_checkpoint(os.path.dirname(os.path.abspath(resume_from_checkpoint)))
            raise ValueError(
                f"Can't find a valid checkpoint at {resume_from_checkpoint}: {reason}. "
                + (f"The latest complete checkpoint is {latest}." if latest else "No complete checkpoint is there.")
            )
    return resume_from_checkpoint


def peer_failure(args: TrainingArguments, error: BaseException) -> PeerFailure:
    """What a rank says when a peer died or stopped answering: who, where, and the checkpoint to resume from."""
    rank, world = args.process_index, args.world_size
    latest = last_complete_checkpoint(args.output_dir)  # type: ignore[arg-type]  # (set by then)
    return PeerFailure(
        f"Training stopped on rank {rank} ({node()}): peer rank(s) {[r for r in range(world) if r != rank]} "
        "died or "
        f"stopped answering ({type(error).__name__}). The last complete checkpoint is {latest}; restart all "
        f"ranks with resume_from_checkpoint=True to continue from it. Cause: {error}"
    )


def save_engine_state(trainer: TrainerParts, output_dir: str) -> None:
    """Every rank's optimizer shard; on the writing process the scheduler and, with paced accumulation, the position
    in the epoch (the same on every rank at a step boundary)."""
    save_optimizer_state(engine_of(trainer), output_dir)  # every rank writes its own shard
    pacer = trainer.acco_run.pacer
    data = pacer.state_dict() if pacer is not None else None  # collective with streams
    if trainer.args.should_save:
        atomic_save(trainer.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))  # type: ignore[union-attr]
        if data is not None:
            atomic_write_json(data, os.path.join(output_dir, DATA_STATE_NAME))


def save_fsdp_model_state(trainer: TrainerParts, output_dir: str) -> None:
    """The committed parameters in Accelerate's FSDP model files (``pytorch_model_fsdp.bin``, or the sharded folder
    with ``SHARDED_STATE_DICT``), as Trainer's FSDP checkpoint has them: its resume loads them. Collective."""
    from accelerate.utils import save_fsdp_model
    from transformers.distributed.fsdp import get_fsdp_ckpt_kwargs

    with engine_of(trainer).committed_parameters():  # (the keyword arguments Trainer's FSDP save and load pass)
        save_fsdp_model(trainer.accelerator.state.fsdp_plugin, trainer.accelerator, trainer.model, output_dir,
                        **get_fsdp_ckpt_kwargs())  # fmt: skip


def load_engine_state(trainer: TrainerParts, checkpoint: str) -> None:
    acco = engine_of(trainer)
    plain = every_rank(trainer_checkpoint_kind(checkpoint))  # the same path on every rank (collectives follow)
    if len(set(plain)) > 1:
        raise ValueError(
            f"The ranks see different files in {checkpoint}: a plain Trainer optimizer state without ACCO shards on "
            f"ranks {[r for r, p in enumerate(plain) if p]}, ACCO shards on the others. Resume from a checkpoint "
            "every node holds alike."
        )
    if plain[0] == "ddp":
        import_trainer_optimizer(trainer, checkpoint)
    elif plain[0] == "fsdp":
        import_trainer_fsdp_optimizer(trainer, checkpoint)
    else:
        load_optimizer_state(acco, checkpoint)  # collective; re-shards if the world size changed
    scheduler_file = os.path.join(checkpoint, SCHEDULER_NAME)
    if os.path.isfile(scheduler_file):
        state = torch.load(scheduler_file, map_location="cpu", weights_only=True)
        state = scheduler_with_empty_groups(state, [len(g["params"]) for g in acco.param_groups])  # 0.1.0's
        trainer.lr_scheduler.load_state_dict(state)  # type: ignore[union-attr]  # (Trainer's, built by then)


def clear_for_rewrite(trainer: TrainerParts, trial: Any) -> None:
    """Before a checkpoint is written: where this step was saved before (a run resumed from an earlier step, or a
    plain Trainer run into the same output_dir), its ``trainer_state.json`` and a plain Trainer optimizer state go
    first. The checkpoint is then incomplete until the new trainer state is written (after every rank's files), and
    no optimizer state of the other run stays beside the new model files."""
    if not trainer.args.should_save:
        return
    folder = os.path.join(trainer._get_output_dir(trial=trial), f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}")
    for name in (TRAINER_STATE_NAME, OPTIMIZER_NAME, FSDP_OPTIMIZER_NAME):
        with contextlib.suppress(FileNotFoundError):
            os.remove(os.path.join(folder, name))
    shutil.rmtree(os.path.join(folder, FSDP_SHARDED_OPTIMIZER), ignore_errors=True)  # (never ACCOTrainer's)


def import_trainer_optimizer(trainer: TrainerParts, checkpoint: str) -> None:
    """Plain Trainer's ``optimizer.pt`` into the engine (collective): the same moments, each parameter's step count,
    the groups' hyper-parameters, every rank reading only its own ranges (memory-mapped); the master weights are
    the model Trainer has just loaded from the checkpoint's model files, the engine's step count the checkpoint's
    ``global_step``. A bad file raises on every rank, and nothing is loaded."""

    def read() -> tuple[dict[str, Any], int]:
        saved = torch.load(os.path.join(checkpoint, OPTIMIZER_NAME), map_location="cpu", weights_only=True, mmap=True)
        with open(os.path.join(checkpoint, TRAINER_STATE_NAME), encoding="utf-8") as f:
            return saved, int(json.load(f)["global_step"])

    def explain(e: Exception) -> Exception:
        return ValueError(
            f"Could not resume the plain Trainer checkpoint {checkpoint} under ACCOTrainer: {e} Resume it with "
            "plain Trainer, or start from its model files without the optimizer state."
        )

    steps = import_torch_state(engine_of(trainer), read, explain)
    logger.info("Resumed plain Trainer's optimizer state from %s (%d steps)", checkpoint, steps)


def import_trainer_fsdp_optimizer(trainer: TrainerParts, checkpoint: str) -> None:
    """Plain Trainer's FSDP ``optimizer.bin`` (the whole optimizer state by parameter name) into the engine over FSDP
    inside machines (collective): each rank takes its FSDP shard's piece of each tensor, as FSDP2 shards the
    parameter (its DTensor's placement on the machine's mesh), then its own ranges of that, memory-mapped; the
    master weights are the model Trainer has just loaded from the FSDP model files. A bad file raises on every rank."""
    acco = engine_of(trainer)

    def read() -> tuple[dict[str, Any], int]:
        whole = torch.load(os.path.join(checkpoint, FSDP_OPTIMIZER_NAME), map_location="cpu", weights_only=True,
                           mmap=True)  # fmt: skip
        with open(os.path.join(checkpoint, TRAINER_STATE_NAME), encoding="utf-8") as f:
            step = int(json.load(f)["global_step"])
        groups = [list(g["param_names"]) for g in acco.param_groups]
        owners = {n: p for g in acco.param_groups for n, p in zip(g["param_names"], g["params"])}
        pieces = {n: fsdp.local_piece(p) for n, p in owners.items()}
        return local_state_from_full(whole, groups, pieces, {n: p.shape for n, p in owners.items()}), step

    def explain(e: Exception) -> Exception:
        return ValueError(
            f"Could not resume the plain Trainer FSDP checkpoint {checkpoint} under ACCOTrainer: {e} Resume it with "
            "plain Trainer, or start from its model files without the optimizer state."
        )

    steps = import_torch_state(acco, read, explain)
    logger.info("Resumed plain Trainer's FSDP optimizer state from %s (%d steps)", checkpoint, steps)


def ranks_meet_before_trainer_state() -> None:
    """Every rank's files are on disk before rank 0 writes trainer_state.json, which marks the checkpoint complete
    (see checkpoint_incomplete): a checkpoint cut short by a crash is never resumed from."""
    barrier()


class _JITAgreement(TrainerCallback):
    """Transformers' SIGTERM (JIT) checkpoint, requested on all ranks at the same step boundary.

    Its SIGTERM timer sets a flag per process, at any moment: ranks would save at different steps, and an
    ACCO checkpoint needs every rank's shard of the same step. The timer here only marks the request; at each
    step's start the ranks all-reduce it (one small collective per step, only with ``enable_jit_checkpoint``)
    and then all raise the flag the JIT callback checks, which saves at that step boundary and stops.
    """

    def __init__(self, trainer: TrainerParts, manager: Any) -> None:
        self.trainer, self.manager, self.pending = trainer, manager, False
        manager._enable_checkpoint = self._mark  # called by the SIGTERM timer thread
        original = manager.execute_jit_checkpoint
        manager.execute_jit_checkpoint = lambda: self._execute(original)  # what the JIT callback calls

    def _mark(self) -> None:
        self.pending = True

    def _execute(self, original: Any) -> None:
        """Transformers' JIT checkpoint, its sentinel removed by every rank before any rank looks for it.

        Each rank writes the sentinel into the checkpoint, saves, then removes it if it exists (a check, then a
        remove): ranks sharing one output directory race there, and a rank whose remove finds the file already gone
        fails with FileNotFoundError at the end of a checkpoint that did complete. Here each rank removes it (gone
        already is fine) right after its save, and the ranks meet before transformers' check finds nothing."""
        trainer, save = self.trainer, self.trainer._save_checkpoint

        def save_then_clear(*args: Any, **kwargs: Any) -> Any:
            out = save(*args, **kwargs)
            folder = f"{PREFIX_CHECKPOINT_DIR}-{trainer.state.global_step}"
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(trainer._get_output_dir(trial=None), folder, JIT_SENTINEL))
            barrier()
            return out

        own = "_save_checkpoint" in vars(trainer)  # already set on the instance (by its user): put it back after
        trainer._save_checkpoint = save_then_clear  # type: ignore[method-assign]
        try:
            original()
        finally:
            if own:
                trainer._save_checkpoint = save  # type: ignore[method-assign]
            else:
                del trainer._save_checkpoint  # the class's method again

    def on_step_begin(self, args: TrainingArguments, state: Any, control: Any, **kwargs: Any) -> None:
        if any_rank(torch.tensor([1.0 if self.pending else 0.0], device=args.device)).item():
            self.pending = False
            self.manager.is_checkpoint_requested = True


def agree_on_jit_checkpoints(trainer: TrainerParts) -> None:
    """Put a _JITAgreement callback in front of transformers' JIT checkpoint callback, if there is one."""
    callbacks = trainer.callback_handler.callbacks
    for i, cb in enumerate(callbacks):
        manager = getattr(cb, "jit_manager", None)
        if manager is not None:
            callbacks.insert(i, _JITAgreement(trainer, manager))
            return


@contextlib.contextmanager
def model_files_on_this_node(trainer: TrainerParts) -> Any:
    """With ``save_on_each_node``, each node's first process writes the model files too (every node holds the full
    parameters: a per-node checkpoint then resumes without a shared file system). transformers 5.24's
    ``save_pretrained`` writes on global rank 0 only (``should_save_on_this_rank``); Trainer passes
    ``is_main_process=should_save``, which is what this node's first process needs."""
    model = trainer.accelerator.unwrap_model(trainer.model)
    override = trainer.args.save_on_each_node and hasattr(model, "should_save_on_this_rank")
    if override:
        model.should_save_on_this_rank = lambda is_main_process: is_main_process
    try:
        yield
    finally:
        if override:
            del model.should_save_on_this_rank
