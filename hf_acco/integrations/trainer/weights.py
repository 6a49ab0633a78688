"""The weight of each micro-batch's gradient under Trainer, so that ACCO averages gradients exactly as Trainer + DDP
does: what undoes Trainer's normalisation of each micro-batch's loss, the label tokens a loss sums, and the two
halves a window of one micro-batch is split into under fixed ``acco``."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:  # the parts' trainer is always an ACCOTrainerMixin, seen through the attributes they use
    from hf_acco.integrations.trainer.run_state import TrainerParts


def loss_is_scaled(trainer: TrainerParts, num_items_in_batch: torch.Tensor | int | None) -> bool:
    """Whether Trainer normalised the loss by ``num_items_in_batch`` (else by the window's micro-batch count)."""
    if trainer.loss_is_scaled_for_ga is not None:
        return trainer.loss_is_scaled_for_ga
    return (
        trainer.model_accepts_loss_kwargs and num_items_in_batch is not None
    ) or trainer.compute_loss_func is not None


def micro_batch_weight(
    trainer: TrainerParts,
    inputs: dict[str, Any],
    num_items_in_batch: torch.Tensor | int | None,
    share: float,
    paced: bool,
) -> tuple[float | torch.Tensor, float]:
    """(weight, gradient scale) that undo Trainer's normalisation of this micro-batch's loss.

    Trainer divides a token-summed loss by the window's token count ``num_items_in_batch`` (times the number
    of processes, which DDP divides out again), or a mean loss by the number of micro-batches in the window.
    Fixed mode: the same factor for every micro-batch of a step on every rank, so weight = factor x tokens
    makes the engine's sum / weight the exact token-weighted average, for each half as for the whole step.
    Dynamic mode (``paced``): each micro-batch is its own window (its ``num_items_in_batch`` is its own token
    count), so the gradient is scaled back to a plain token sum and the weight is the token count.

    ``share``: the fraction of the micro-batch's rows in this part of it (a window of one micro-batch split into
    two halves). The part's gradient is scaled by it, and a token-normalised loss is given ``num_items_in_batch
    x share`` (training_step): a loss summed over the window's N tokens then sums over N as one micro-batch's
    would, and a model that takes the loss kwargs but returns a mean (it ignores N) gives the mean of the batch,
    as Trainer+DDP computes it for the whole micro-batch (not twice it).

    A window without a label token (``num_items_in_batch == 0``: this rank's, or every rank's when tokens are
    averaged across devices): Trainer's loss is 0/0, its gradient exactly 0 (cross-entropy with every target
    ignored writes no gradient), and DDP still counts the rank in its average and takes the step (momentum and
    weight decay move the parameters). Its micro-batches weigh 1 / gradient_accumulation_steps each, so the
    window weighs what a rank's window weighs (1): the averages, and the step, are DDP's.
    """
    if not loss_is_scaled(trainer, num_items_in_batch):
        return share / trainer.current_gradient_accumulation_steps, share
    if num_items_in_batch is None:
        return 1.0, 1.0
    processes = 1.0
    if trainer.args.average_tokens_across_devices and (trainer.model_accepts_loss_kwargs or trainer.compute_loss_func):
        processes = float(trainer.accelerator.num_processes // trainer.get_tp_size())
    empty = share / trainer.current_gradient_accumulation_steps
    tokens = trainer.count_label_tokens(inputs)
    if not paced and torch.is_tensor(num_items_in_batch):
        # Trainer's counts are on the device: the weight stays there (float64, as the host's floats), read by the
        # engine once per half, not here (two host synchronisations per micro-batch)
        items = num_items_in_batch.to(torch.float64)
        per_item = torch.full_like(items, processes).div_(items.clamp(min=1))  # rounded once, as processes / float(n)
        weight = torch.as_tensor(tokens, dtype=torch.float64, device=items.device) * per_item
        return torch.where(items == 0, torch.full_like(weight, empty), weight), share
    if float(num_items_in_batch) == 0:
        return empty, share
    factor = processes / float(num_items_in_batch)
    if paced:
        return float(tokens), 1.0 / factor
    return float(tokens) * factor, share


def label_tokens(inputs: dict[str, Any], shifts_labels: bool) -> torch.Tensor:
    """Labels other than -100 in ``shift_labels`` when the batch has them, else in ``labels`` after the shift the
    model's loss applies (causal LMs drop the first label): what Trainer counts as ``num_items_in_batch``."""
    if "shift_labels" in inputs:
        labels = inputs["shift_labels"]
    else:
        labels = inputs["labels"][..., 1:] if shifts_labels else inputs["labels"]
    return labels.ne(-100).sum()  # where the labels are (read on the host only when the caller needs it)


def input_tokens(trainer: TrainerParts, inputs: dict[str, Any]) -> float:
    """The input tokens of a micro-batch as Trainer counts them for ``num_input_tokens_seen``."""
    if "attention_mask" in inputs and trainer.args.include_num_input_tokens_seen != "all":
        return float(inputs["attention_mask"].sum())
    main = inputs.get(getattr(trainer.model, "main_input_name", "input_ids"))
    return float(main.numel()) if torch.is_tensor(main) else 0.0


def split_rows(inputs: dict[str, Any]) -> list[tuple[dict[str, Any], float]]:
    """A micro-batch as two halves along the batch dimension, with each one's share of the rows; one row stays
    whole (a window that cannot be split ends its step early, as a short window does)."""
    rows = next((v.shape[0] for v in inputs.values() if torch.is_tensor(v) and v.dim() > 0), 0)
    if rows < 2:
        return [(inputs, 1.0)]
    cut = rows // 2

    def part(lo: int, hi: int) -> dict[str, Any]:
        return {
            k: v[lo:hi] if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == rows else v for k, v in inputs.items()
        }

    return [(part(0, cut), cut / rows), (part(cut, rows), (rows - cut) / rows)]
