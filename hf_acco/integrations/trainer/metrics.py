"""ACCO's figures next to Trainer's loss: exposed communication, round time, micro-batches per step, and with paced
accumulation each rank's micro-batches and tokens and the loss of each step's global batch."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from hf_acco.integrations.trainer.engine import engine_of

if TYPE_CHECKING:  # the parts' trainer is always an ACCOTrainerMixin, seen through the attributes they use
    from hf_acco.integrations.trainer.run_state import TrainerParts

RUN_DEPENDENT_METRICS = ("acco_exposed_comm_s", "acco_round_s")  # logged, not kept in state.log_history


def acco_metrics(trainer: TrainerParts, paced: bool) -> dict[str, float]:
    """Per optimizer step since the last log: exposed communication, round time, micro-batches, weight."""
    acco = engine_of(trainer)
    totals = dict(acco.totals)
    delta = {k: v - trainer.acco_run.logged_totals.get(k, 0.0) for k, v in totals.items()}
    trainer.acco_run.logged_totals = totals
    steps = max(delta["steps"], 1.0)
    out = {
        "acco_exposed_comm_s": delta["wait_s"] / steps,
        "acco_round_s": delta["round_s"] / steps,
        "acco_micro_batches": delta["micro_batches"] / steps,
        "acco_skipped_steps": totals["skipped_steps"],
    }
    if acco.last_commit is not None:
        out["acco_global_micro_batches"] = float(acco.last_commit.micro_batches)
    out["acco_optimizer_steps"] = float(acco.step_count)  # restored by a resume
    if paced:  # micro-batches differ per rank: log each (all ranks log at the same step: one gather)
        out.update(per_rank_metrics(trainer, delta["micro_batches"], steps))
    return out


def per_rank_metrics(trainer: TrainerParts, micro_batches: float, steps: float) -> dict[str, float]:
    """Dynamic mode: every rank's micro-batches and tokens, and the loss of each step's global batch, weighted as
    its gradient (whoever computed which micro-batch), averaged over the steps as Trainer does: what DDP logs,
    not a mean of per-rank means."""
    args, out, run = trainer.args, {}, trainer.acco_run
    tokens, run.logged_tokens = run.input_tokens - run.logged_tokens, run.input_tokens
    counts = torch.tensor([micro_batches, tokens], dtype=torch.float64, device=args.device)
    losses = torch.stack(run.step_losses).double().flatten() if run.step_losses else counts[:0]
    run.step_losses = []
    gathered = trainer.accelerator.gather(torch.cat([counts, losses])).view(args.world_size, -1)
    sums = gathered[:, 2:].sum(0).view(-1, 2)
    if len(sums):
        out["loss"] = float((sums[:, 0] / sums[:, 1]).mean())
    per_rank = gathered[:, :2].tolist()
    for rank, (rank_micro_batches, rank_tokens) in enumerate(per_rank):
        out[f"acco_micro_batches_rank{rank}"] = rank_micro_batches / steps
        out[f"acco_tokens_rank{rank}"] = rank_tokens / steps
    global_tokens = sum(t for _, t in per_rank)
    out["acco_global_batch_tokens"] = global_tokens / steps
    if args.include_num_input_tokens_seen != "no":
        trainer.state.num_input_tokens_seen += int(global_tokens)
    return out
