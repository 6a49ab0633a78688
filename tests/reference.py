"""A single-process implementation of the equations in docs/algorithm.md, used as the tests' oracle.

It shares no code with hf_acco: full (unsharded) torch optimizer on the model's own parameters,
``torch.nn.utils.clip_grad_norm_`` for clipping, and snapshot/restore (deepcopy) for the estimate step.
Gradient sums are formed the way the equations say: per rank, micro-batch after micro-batch, then over ranks.
A parameter that got no gradient in a sum on any rank has ``grad`` None in its update, so torch's optimizer leaves
it out (no weight decay, no moment update, its step count unchanged), as under DDP.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch

from .helpers import rel as relative_error  # noqa: F401  (its name here, for the tests)

Batch = dict[str, torch.Tensor]
LossFn = Callable[[torch.nn.Module, Batch], tuple[torch.Tensor, float]]


class Reference:
    def __init__(
        self,
        model: torch.nn.Module,
        param_groups: list[dict],
        optimizer_cls: type[torch.optim.Optimizer],
        max_grad_norm: float | None,
        loss_fn: LossFn,
        **defaults,
    ) -> None:
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad]  # model order, like the tests
        self.opt = optimizer_cls(param_groups, **defaults)
        self.max_grad_norm = max_grad_norm
        self.loss_fn = loss_fn
        self.norms: list[float] = []
        self.touched: set[int] = set()  # the parameters the last ``grad_sum`` got a gradient of

    def params_now(self) -> list[torch.Tensor]:
        return [p.detach().clone() for p in self.params]

    def set_params(self, values: Sequence[torch.Tensor]) -> None:
        with torch.no_grad():
            for p, v in zip(self.params, values):
                p.copy_(v)

    def grad_sum(self, at: Sequence[torch.Tensor], batches: Sequence[Batch], start=None):
        """Σ g(at; ξ) over ``batches`` in order, added onto ``start``; and Σ weights."""
        self.set_params(at)
        sums = [s.clone() for s in start] if start is not None else [torch.zeros_like(p) for p in self.params]
        weight = 0.0
        self.touched = set()
        for batch in batches:
            for p in self.params:
                p.grad = None
            loss, w = self.loss_fn(self.model, batch)
            loss.backward()
            for i, (s, p) in enumerate(zip(sums, self.params)):
                if p.grad is not None:
                    s.add_(p.grad)
                    self.touched.add(i)
            weight += w
        return sums, weight

    def grad_sums(self, at, per_rank_batches, starts=None):
        """``grad_sum`` for each rank: ([(sums, weight)], the parameters any rank got a gradient of)."""
        out, touched = [], set()
        for r, batches in enumerate(per_rank_batches):
            out.append(self.grad_sum(at, batches, None if starts is None else starts[r]))
            touched |= self.touched
        return out, touched

    def update(self, theta: Sequence[torch.Tensor], avg_grad: Sequence[torch.Tensor], keep: bool, touched=None):
        """Opt(θ, s; ḡ) with clipping; with ``keep=False`` the state is restored afterwards. A parameter not in
        ``touched`` (None: all) has no gradient: the optimizer leaves it out."""
        saved = None if keep else copy.deepcopy(self.opt.state_dict())
        self.set_params(theta)
        for i, (p, g) in enumerate(zip(self.params, avg_grad)):
            p.grad = g.clone() if touched is None or i in touched else None
        if self.max_grad_norm is not None:
            norm = torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm)
        else:
            norm = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(g) for g in avg_grad])
            )  # untouched: 0
        if keep:
            self.norms.append(float(norm))
        self.opt.step()
        out = self.params_now()
        if saved is not None:
            self.opt.load_state_dict(saved)
        return out


def _over_ranks(per_rank: list[list[torch.Tensor]], wire: torch.dtype | None = None) -> list[torch.Tensor]:
    """Σ over ranks; with ``wire``, each rank's sums are rounded to that dtype first (what goes on the wire)."""
    if wire is not None:
        per_rank = [[t.to(wire).float() for t in sums] for sums in per_rank]
    total = [t.clone() for t in per_rank[0]]
    for other in per_rank[1:]:
        for a, b in zip(total, other):
            a.add_(b)
    return total


def _avg(sums, weight):
    return [s / weight for s in sums]


def run_sync(
    ref: Reference, steps: list[list[list[Batch]]], wire: torch.dtype | None = None
) -> list[list[torch.Tensor]]:
    """θ_{t+1} = Opt(θ_t; Σ g(θ_t) / W). ``steps[t][rank]``: that rank's micro-batches of step t."""
    theta, history = ref.params_now(), []
    for per_rank in steps:
        sums, touched = ref.grad_sums(theta, per_rank)
        avg = _avg(_over_ranks([s for s, _ in sums], wire), sum(w for _, w in sums))
        theta = ref.update(theta, avg, keep=True, touched=touched)
        history.append(theta)
    return history


def run_dpu(
    ref: Reference, steps: list[list[list[Batch]]], wire: torch.dtype | None = None
) -> list[list[torch.Tensor]]:
    """θ_{t+1} = Opt(θ_t; ḡ(θ_{t-1})), θ_{-1} = θ_0."""
    theta = ref.params_now()
    previous, history = theta, []
    for per_rank in steps:
        sums, touched = ref.grad_sums(previous, per_rank)
        avg = _avg(_over_ranks([s for s, _ in sums], wire), sum(w for _, w in sums))
        new = ref.update(theta, avg, keep=True, touched=touched)
        previous, theta = theta, new
        history.append(theta)
    return history


def run_acco(
    ref: Reference, steps: list[list[tuple[list[Batch], list[Batch]]]], wire: torch.dtype | None = None
) -> list[list[torch.Tensor]]:
    """``steps[t][rank] = (half A batches, half B batches)``; returns the committed θ after each step."""
    theta = ref.params_now()
    estimate, history = theta, []
    for per_rank in steps:
        half_a, touched_a = ref.grad_sums(estimate, [a for a, _ in per_rank])
        weight_a = sum(w for _, w in half_a)
        avg_a = _avg(_over_ranks([s for s, _ in half_a], wire), weight_a)
        next_estimate = ref.update(theta, avg_a, keep=False, touched=touched_a)
        full, touched_b = ref.grad_sums(theta, [b for _, b in per_rank], starts=[s for s, _ in half_a])
        weight = weight_a + sum(w for _, w in full)
        avg = _avg(_over_ranks([s for s, _ in full], wire), weight)
        theta = ref.update(theta, avg, keep=True, touched=touched_a | touched_b)
        estimate = next_estimate
        history.append(theta)
    return history
