"""The sharded optimizer: fp32 master shard + state for the owned shard only (ZeRO-1), pure torch.

An element-wise torch optimizer (AdamW by default) runs on *segments*: views of the master shard, one per run of
elements of the same parameter group, so per-group settings (weight decay for weights but not for biases and
norm weights) apply per element. Two kinds of update:

* ``commit``: the optimizer step, kept (master and state advance);
* ``estimate``: the same update computed as a look-ahead, written to an output buffer, leaving master and state
  bit-identical. For Adam/AdamW it is computed out of place, in chunks, without copying the state; other
  optimizers snapshot and restore.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .sharding import Segment

# Optimizers whose update of an element depends only on that element's gradient, parameter and state.
ELEMENTWISE_OPTIMIZERS: tuple[type[torch.optim.Optimizer], ...] = (
    torch.optim.SGD,
    torch.optim.Adam,
    torch.optim.AdamW,
    torch.optim.Adamax,
    torch.optim.Adagrad,
    torch.optim.Adadelta,
    torch.optim.RMSprop,
    torch.optim.NAdam,
    torch.optim.RAdam,
    torch.optim.Rprop,
    torch.optim.ASGD,
)

_ESTIMATE_CHUNK = 1 << 20  # elements per chunk of the out-of-place Adam estimate (bounds its temporaries)


def check_elementwise(optimizer_cls: type, allow_custom: bool = False) -> None:
    if issubclass(optimizer_cls, ELEMENTWISE_OPTIMIZERS) or allow_custom:
        return
    names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
    raise ValueError(
        f"ACCO shards the optimizer state element by element, so it needs an element-wise optimizer; "
        f"{optimizer_cls.__name__} is not known to be one (LBFGS, Adafactor, Muon and SparseAdam look at whole "
        f"tensors). Use one of: {names}. If your custom optimizer is element-wise, pass "
        "allow_custom_optimizer=True."
    )


class ShardOptimizer:
    """Master shard, gradient shard and the inner element-wise optimizer of one rank.

    Args:
        master: this rank's fp32 shard of the parameters (taken over, not copied).
        segments: this rank's real elements, by parameter group.
        group_hparams: hyper-parameters of each parameter group (``lr``, ``weight_decay``, ...).
        optimizer_cls: the element-wise torch optimizer.
        defaults: keyword arguments for ``optimizer_cls``.
    """

    def __init__(
        self,
        master: torch.Tensor,
        segments: Sequence[Segment],
        group_hparams: Sequence[dict[str, Any]],
        optimizer_cls: type[torch.optim.Optimizer],
        defaults: dict[str, Any],
        piece_numel: int | None = None,
    ) -> None:
        self.master = master
        self.piece_numel = piece_numel or master.numel()  # the shard is written out in pieces of this size
        self.grad = torch.zeros_like(master)
        self.segments = list(segments)
        self._seg_params: list[torch.nn.Parameter] = []
        groups: list[dict[str, Any]] = [{"params": [], **hp} for hp in group_hparams]
        for seg in self.segments:
            p = torch.nn.Parameter(master[seg.start : seg.end], requires_grad=True)  # aliases master
            p.grad = self.grad[seg.start : seg.end]
            self._seg_params.append(p)
            groups[seg.group]["params"].append(p)
        self.inner = optimizer_cls(groups, **defaults)
        self._flat_state: dict[str, torch.Tensor] = {}  # per-element state keys, as shard-sized vectors

    # ---- updates ------------------------------------------------------------------------------------------

    def commit(self, hparams: Sequence[dict[str, Any]]) -> None:
        """One kept optimizer step of the master shard with the gradient in ``self.grad``."""
        self._set_hparams(hparams)
        self.inner.step()
        self._consolidate_state()

    def estimate(self, hparams: Sequence[dict[str, Any]], out: torch.Tensor) -> None:
        """Write the look-ahead update of the master shard into ``out``; master and state stay as they are.

        ``out`` is shaped ``(shard_numel // piece_numel, piece_numel)`` and may be strided (the pieces of a
        communication buffer this rank owns).
        """
        out = out.view(-1, self.piece_numel) if out.is_contiguous() else out
        out.copy_(self.master.view(out.shape))  # padding starts from the committed values
        self._set_hparams(hparams)
        if self._adam_out_of_place_ok():
            self._adam_estimate(out)
        else:
            self._snapshot_estimate(out)

    # ---- state --------------------------------------------------------------------------------------------

    def state_tensors(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """(per-element state as shard-sized vectors, scalar state such as ``step``)."""
        scalars: dict[str, torch.Tensor] = {}
        for p in self._seg_params:
            for key, value in self.inner.state.get(p, {}).items():
                if key not in self._flat_state and torch.is_tensor(value):
                    scalars.setdefault(key, value.detach().clone())
        return dict(self._flat_state), scalars

    def load_state_tensors(self, flat: dict[str, torch.Tensor], scalars: dict[str, torch.Tensor]) -> None:
        self.inner.state.clear()
        self._flat_state = {k: v.to(self.master.device, torch.float32).clone() for k, v in flat.items()}
        for p, seg in zip(self._seg_params, self.segments):
            state = {k: v[seg.start : seg.end] for k, v in self._flat_state.items()}
            state.update({k: v.clone() for k, v in scalars.items()})
            self.inner.state[p] = state

    # ---- internals ----------------------------------------------------------------------------------------

    def _set_hparams(self, hparams: Sequence[dict[str, Any]]) -> None:
        for group, hp in zip(self.inner.param_groups, hparams):
            group.update(hp)

    def _consolidate_state(self) -> None:
        """Re-home per-element state tensors as views of one shard-sized vector per key (once)."""
        if not self._seg_params:
            return
        first = self.inner.state.get(self._seg_params[0], {})
        keys = [k for k, v in first.items() if torch.is_tensor(v) and v.shape == self._seg_params[0].shape]
        new_keys = [k for k in keys if k not in self._flat_state or not self._is_view_of(k)]
        for key in new_keys:
            flat = torch.zeros_like(self.master)
            for p, seg in zip(self._seg_params, self.segments):
                flat[seg.start : seg.end].copy_(self.inner.state[p][key])
                self.inner.state[p][key] = flat[seg.start : seg.end]
            self._flat_state[key] = flat

    def _is_view_of(self, key: str) -> bool:
        p, seg = self._seg_params[0], self.segments[0]
        return self.inner.state[p][key].data_ptr() == self._flat_state[key][seg.start :].data_ptr()

    def _adam_out_of_place_ok(self) -> bool:
        if not isinstance(self.inner, torch.optim.Adam):
            return False
        return not any(
            g.get("amsgrad") or g.get("maximize") or g.get("capturable") or g.get("differentiable")
            for g in self.inner.param_groups
        )

    @torch.no_grad()
    def _adam_estimate(self, out: torch.Tensor) -> None:
        """Adam/AdamW's update, the same elementary ops in the same order as torch's, out of place."""
        for p, seg in zip(self._seg_params, self.segments):
            group = self.inner.param_groups[seg.group]
            lr, wd, eps = float(group["lr"]), group["weight_decay"], group["eps"]
            beta1, beta2 = group["betas"]
            decoupled = group.get("decoupled_weight_decay", isinstance(self.inner, torch.optim.AdamW))
            state = self.inner.state.get(p, {})
            step = float(state["step"]) + 1 if "step" in state else 1.0
            bias_correction1 = 1 - beta1**step
            bias_correction2_sqrt = (1 - beta2**step) ** 0.5
            step_size = lr / bias_correction1
            for a, b in _chunks(seg.start, seg.end, self.piece_numel):
                theta, grad = self.master[a:b], self.grad[a:b]
                piece, offset = divmod(a, self.piece_numel)
                target = out[piece, offset : offset + (b - a)]
                # computed in fp32 (in place when ``out`` is fp32), rounded once into a narrower ``out``
                o = target if target.dtype == theta.dtype else theta.clone()
                if "exp_avg" in state:
                    m = self._flat_state["exp_avg"][a:b].clone()
                    v = self._flat_state["exp_avg_sq"][a:b].clone()
                else:
                    m, v = torch.zeros_like(theta), torch.zeros_like(theta)
                if wd != 0 and decoupled:
                    o.mul_(1 - lr * wd)
                elif wd != 0:
                    grad = grad.add(theta, alpha=wd)
                m.lerp_(grad, 1 - beta1)
                v.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                denom = (v.sqrt() / bias_correction2_sqrt).add_(eps)
                o.addcdiv_(m, denom, value=-step_size)
                if o is not target:
                    target.copy_(o)

    @torch.no_grad()
    def _snapshot_estimate(self, out: torch.Tensor) -> None:
        """Any element-wise optimizer: step, read the result, restore master and state bit for bit."""
        master_backup = self.master.clone()
        had_state = bool(self.inner.state)
        state_backup = {
            p: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in self.inner.state[p].items()}
            for p in self._seg_params
            if p in self.inner.state
        }
        self.inner.step()
        out.copy_(self.master.view(out.shape))
        self.master.copy_(master_backup)
        if not had_state:
            self.inner.state.clear()
            return
        for p, saved in state_backup.items():
            for k, v in saved.items():
                cur = self.inner.state[p][k]
                if torch.is_tensor(cur):
                    cur.copy_(v)
                else:
                    self.inner.state[p][k] = v


def _chunks(start: int, end: int, piece_numel: int) -> list[tuple[int, int]]:
    """Split ``[start, end)`` at multiples of ``piece_numel`` and into at most ``_ESTIMATE_CHUNK`` elements."""
    out = []
    a = start
    while a < end:
        b = min(end, (a // piece_numel + 1) * piece_numel, a + _ESTIMATE_CHUNK)
        out.append((a, b))
        a = b
    return out
