"""The sharded optimizer: fp32 master shard + state for the owned shard only (ZeRO-1), pure torch.

An element-wise torch optimizer (AdamW by default) runs on *segments*: views of the master shard, one per run of
elements of the same parameter group, so per-group settings (weight decay for weights but not for biases and
norm weights) apply per element. Two kinds of update:

* ``commit``: the optimizer step, kept (master and state advance);
* ``estimate``: the same update computed as a look-ahead, written to an output buffer, leaving master and state
  bit-identical. For Adam/AdamW it is computed out of place, in chunks, without copying the state; other
  optimizers snapshot and restore.

Both take the parameters that received no gradient on any rank (``skip``): their segments are left out of the
update exactly as torch's optimizers leave out a parameter whose ``grad`` is None (master, state and the
parameter's own step count untouched; a look-ahead of such a parameter is the parameter itself). Segments built
by ``FlatLayout.shard_param_segments`` are one per parameter piece, so the step count is per parameter, as torch's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Collection, Iterator, Sequence
from typing import Any

import torch
from torch.optim.adam import adam as functional_adam
from torch.optim.optimizer import _get_scalar_dtype

from hf_acco.comm.sharding import Segment
from hf_acco.engine.kept import Kept

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

ESTIMATE_TEMPORARIES = 6  # window-sized fp32 temporaries of the Adam estimate at once, at most (m, v, denominator,
# an L2 gradient, a narrow output, and one of the previous window's while the next is allocated)


def estimate_window(shard_numel: int) -> int:
    """Elements per window of the out-of-place Adam estimate: its temporaries stay within one shard's size, and
    the number of windows (of foreach calls) stays small: at most 16M elements, at least 1M."""
    return max(1 << 20, min(1 << 24, shard_numel // ESTIMATE_TEMPORARIES))


def check_elementwise(
    optimizer_cls: type, allow_custom: bool = False, how_to_allow: str = "pass allow_custom_optimizer=True"
) -> None:
    if issubclass(optimizer_cls, ELEMENTWISE_OPTIMIZERS) or allow_custom:
        return
    names = ", ".join(c.__name__ for c in ELEMENTWISE_OPTIMIZERS)
    raise ValueError(
        f"ACCO shards the optimizer state element by element, so it needs an element-wise optimizer; "
        f"{optimizer_cls.__name__} is not known to be one (LBFGS, Adafactor, Muon and SparseAdam look at whole "
        f"tensors). Use one of: {names}. If your custom optimizer is element-wise, {how_to_allow}."
    )


class ShardOptimizer:
    """Master shard, gradient shard and the inner element-wise optimizer of one rank.

    The shard is written out in pieces of ``piece_numel`` (one per bucket), and the gradient is a
    ``(num_pieces, piece_numel)`` tensor whose rows may lie apart: a round can place it in its own buffer
    (``use_grad``), so the optimizer's parameters are the segments split at piece boundaries.

    Args:
        master: this rank's fp32 shard of the parameters (taken over, not copied).
        segments: this rank's real elements, by parameter group.
        group_hparams: hyper-parameters of each parameter group (``lr``, ``weight_decay``, ...).
        optimizer_cls: the element-wise torch optimizer.
        defaults: keyword arguments for ``optimizer_cls``.
        piece_numel: elements per piece (the whole shard by default).
        keep_grad: hold a gradient of its own (else every update is given one with ``use_grad``).
        num_params: parameters in the layout (the length of ``param_scalars``' vectors); default: from ``segments``.
    """

    def __init__(
        self,
        master: torch.Tensor,
        segments: Sequence[Segment],
        group_hparams: Sequence[dict[str, Any]],
        optimizer_cls: type[torch.optim.Optimizer],
        defaults: dict[str, Any],
        piece_numel: int | None = None,
        keep_grad: bool = True,
        num_params: int | None = None,
    ) -> None:
        self.master = master
        self.piece_numel = piece_numel or master.numel()
        num_pieces = master.numel() // self.piece_numel
        self.own_grad = torch.zeros(num_pieces, self.piece_numel, device=master.device) if keep_grad else None
        self.grad: torch.Tensor | None = None
        self.segments = [
            Segment(a, b, seg.group, seg.param)
            for seg in segments
            for a, b in _chunks(seg.start, seg.end, self.piece_numel)
        ]
        highest = max((seg.param for seg in self.segments), default=-1)
        self.num_params = num_params if num_params is not None else highest + 1
        self._seg_params: list[torch.nn.Parameter] = []
        groups: list[dict[str, Any]] = [{"params": [], **hp} for hp in group_hparams]
        for seg in self.segments:
            p = torch.nn.Parameter(master[seg.start : seg.end], requires_grad=True)  # aliases master
            self._seg_params.append(p)
            groups[seg.group]["params"].append(p)
        self.inner, self.defaults = optimizer_cls(groups, **defaults), dict(defaults)
        self._flat_state: dict[str, torch.Tensor] = {}  # per-element state keys, as shard-sized vectors
        self._adam_state_in_place()
        self._grad_views: dict[tuple[int, tuple[int, ...]], list[torch.Tensor]] = {}
        if self.own_grad is not None:
            self.use_grad(None)
        self._windows = _estimate_windows(self.segments, estimate_window(master.numel()))
        covered = [(seg.start, seg.end) for seg in self.segments]
        self._padding = [
            piece for a, b in _gaps(covered, master.numel()) for piece in _chunks(a, b, self.piece_numel)
        ]  # fmt: skip

    def use_grad(self, grad: torch.Tensor | None) -> torch.Tensor:
        """The gradient the next update reads: ``grad`` ((num_pieces, piece_numel), e.g. a view of a round's
        buffer), or None for the optimizer's own. Returns it."""
        grad = self.own_grad if grad is None else grad
        if grad is None:
            raise AssertionError("this shard optimizer holds no gradient of its own: pass one")
        key = (grad.data_ptr(), grad.stride())
        if self.grad is None or key != (self.grad.data_ptr(), self.grad.stride()):
            if key not in self._grad_views:  # views of each place a gradient lives (two buffers swap), made once
                self._grad_views[key] = [_piece_range(grad, s.start, s.end, self.piece_numel) for s in self.segments]
            for p, view in zip(self._seg_params, self._grad_views[key]):
                p.grad = view
            self.grad = grad
        return self.grad

    # ---- updates ------------------------------------------------------------------------------------------

    def keep(self) -> Kept:
        """The master and state as they are now, to put back (``Kept.restore``) after an update that must not stand."""
        return Kept(self.master, self.inner, self._seg_params, self._flat_state)

    def commit(self, hparams: Sequence[dict[str, Any]], skip: Collection[int] = ()) -> None:
        """One kept optimizer step of the master shard with the gradient in ``self.grad``; the parameters in ``skip``
        (layout indices) are left out, as torch leaves out a parameter whose ``grad`` is None."""
        self._set_hparams(hparams)
        with self._left_out(skip):
            self.inner.step()
        self._consolidate_state()

    def estimate(self, hparams: Sequence[dict[str, Any]], out: torch.Tensor, skip: Collection[int] = ()) -> None:
        """Write the look-ahead update of the master shard into ``out``; master and state stay as they are.

        ``out`` is shaped ``(num_pieces, piece_numel)`` (or is contiguous) and may be strided, and may be
        ``self.grad`` itself: every element's gradient is read before that element of ``out`` is written. The
        parameters in ``skip`` get their master values, as a step that leaves them out would.
        """
        out = out.view(-1, self.piece_numel) if out.is_contiguous() else out
        self._set_hparams(hparams)
        if self._adam_out_of_place_ok():
            self._adam_estimate(out, frozenset(skip))
        else:
            with self._left_out(skip):
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

    def param_scalars(self) -> dict[str, torch.Tensor]:
        """Each parameter's scalar state (``step``, ...) as a float64 host vector over the layout's parameters, NaN
        for a parameter this shard holds no stepped piece of: parameters left out of some steps count fewer."""
        found: dict[str, list[tuple[int, torch.Tensor]]] = {}
        for p, seg in zip(self._seg_params, self.segments):
            for key, value in self.inner.state.get(p, {}).items():
                if seg.param >= 0 and key not in self._flat_state and torch.is_tensor(value) and value.numel() == 1:
                    found.setdefault(key, []).append((seg.param, value.detach().reshape(())))
        out = {}
        for key, pairs in found.items():
            vector = torch.full((self.num_params,), float("nan"), dtype=torch.float64)
            values = torch.stack([v for _, v in pairs]).to("cpu", torch.float64)  # one copy from the device
            vector[torch.tensor([i for i, _ in pairs])] = values
            out[key] = vector
        return out

    def load_state_tensors(
        self,
        flat: dict[str, torch.Tensor],
        scalars: dict[str, torch.Tensor],
        param_scalars: dict[str, torch.Tensor] | None = None,
        copy: bool = True,
    ) -> None:
        """Restore the state: per-element vectors (as ``state_tensors`` gives them) and scalars such as ``step``:
        one for every segment, or each parameter's own (``param_scalars``, as ``param_scalars()`` gives them; a
        parameter with NaN there was never stepped and gets no state, as torch keeps none for it). ``copy=False``
        takes the per-element vectors over when they are already on the master's device and dtype (a resume hands
        new ones: a second device copy of every moment would raise the peak by a shard-sized vector each).

        Every value is placed by torch's own ``Optimizer.load_state_dict`` (its per-parameter policy: a fused or
        capturable Adam gets ``step`` as float32 on the parameter's device, the others keep it where it was saved).
        The per-element vectors are moved to the master shard's device and dtype first, as that policy moves a
        parameter's floating state, so the segments' state stays views of one vector per key."""
        self._flat_state = {
            k: v.to(device=self.master.device, dtype=self.master.dtype, copy=copy) for k, v in flat.items()
        }
        index = {id(p): i for i, p in enumerate(p for g in self.inner.param_groups for p in g["params"])}  # torch's
        state = {}
        for p, seg in zip(self._seg_params, self.segments):
            values = {k: v[seg.start : seg.end] for k, v in self._flat_state.items()}
            values.update({k: v.clone() for k, v in scalars.items()})  # one each: steps are incremented in place
            if param_scalars and seg.param >= 0:
                own = {k: float(v[seg.param]) for k, v in param_scalars.items()}
                if any(value != value for value in own.values()):  # NaN: never stepped
                    continue
                values.update({k: torch.tensor(own[k], dtype=scalars[k].dtype) for k in own if k in scalars})
            state[index[id(p)]] = values
        self.inner.state.clear()
        self.inner.load_state_dict({"state": state, "param_groups": self.inner.state_dict()["param_groups"]})
        self._consolidate_state()  # re-homes any value the policy had to move (none when it kept the views)
        self._adam_state_in_place()  # a parameter never stepped: zeros in place, not allocated at its first step

    # ---- internals ----------------------------------------------------------------------------------------

    def _set_hparams(self, hparams: Sequence[dict[str, Any]]) -> None:
        for group, hp in zip(self.inner.param_groups, hparams):
            group.update(hp)

    def _consolidate_state(self) -> None:
        """Re-home per-element state tensors as views of one shard-sized vector per key. A segment stepped for the
        first time (all of them at the first step; later, a parameter that had no gradient until then) brings new
        tensors: copied in, replaced by views. A segment never stepped has zeros there and no state."""
        for p, seg in zip(self._seg_params, self.segments):
            state = self.inner.state.get(p)
            for key, value in (state or {}).items():
                if not (torch.is_tensor(value) and value.shape == p.shape and value.dim()):
                    continue
                if key not in self._flat_state:
                    self._flat_state[key] = torch.zeros_like(self.master)
                view = self._flat_state[key][seg.start : seg.end]
                if value.data_ptr() != view.data_ptr():
                    view.copy_(value)
                    state[key] = view  # type: ignore[index]

    def _adam_state_in_place(self) -> None:
        """Adam / AdamW: every segment's state made once as views of one shard-sized vector per moment, before any
        step (what torch's first step creates, zeros and a step of 0, whose update is the same). Left to torch, the
        first step would allocate the moments segment by segment and ``_consolidate_state`` copy them into flat
        vectors: a second set of moments at the peak, left cached by the allocator."""
        if not isinstance(self.inner, torch.optim.Adam) or not self._seg_params:
            return
        keys = ["exp_avg", "exp_avg_sq"] + (
            ["max_exp_avg_sq"] if any(g["amsgrad"] for g in self.inner.param_groups) else []
        )
        for key in keys:
            if key not in self._flat_state:
                self._flat_state[key] = torch.zeros_like(self.master)
        groups = {id(p): g for g in self.inner.param_groups for p in g["params"]}
        for p, seg in zip(self._seg_params, self.segments):
            state = self.inner.state[p]
            if state:
                continue
            group = groups[id(p)]
            state["step"] = _zero_step(group, self.master.device)
            for key in keys[:2] + (keys[2:] if group["amsgrad"] else []):
                state[key] = self._flat_state[key][seg.start : seg.end]

    @contextlib.contextmanager
    def _left_out(self, skip: Collection[int]) -> Iterator[None]:
        """The segments of the parameters in ``skip`` have no gradient inside (torch's optimizers skip them)."""
        out = [(p, p.grad) for p, seg in zip(self._seg_params, self.segments) if seg.param in skip] if skip else []
        for p, _ in out:
            p.grad = None
        try:
            yield
        finally:
            for p, grad in out:
                p.grad = grad

    def _adam_out_of_place_ok(self) -> bool:
        return isinstance(self.inner, torch.optim.Adam)  # AdamW too, with every flag (fused, foreach, amsgrad, ...)

    @torch.no_grad()
    def _adam_estimate(self, out: torch.Tensor, skip: frozenset[int] = frozenset()) -> None:
        """Adam/AdamW's update out of place, through torch's own functional ``adam`` with the group's flags (fused,
        foreach, capturable, amsgrad, maximize, decoupled weight decay) exactly as ``Adam.step`` calls it: the
        estimate is the committed update's arithmetic, whatever kernel that is, on copies of the moments and step.

        Window by window (``estimate_window`` elements at most, which bounds the temporaries); the step is never
        read on the host (a fused or capturable step lives on the device: reading it would be a device sync)."""
        pn, grad = self.piece_numel, self.grad
        if grad is None:
            raise AssertionError("an estimate with no gradient in use (use_grad sets it)")
        for a, b in self._padding:  # padding takes the committed values
            _piece_range(out, a, b, pn).copy_(self.master[a:b])
        for window in self._windows:
            for g, runs in window.items():
                if skip:  # left out: the look-ahead of a parameter without a gradient is the parameter
                    for a, b, _ in (run for run in runs if self.segments[run[2]].param in skip):
                        _piece_range(out, a, b, pn).copy_(self.master[a:b])
                    runs = [run for run in runs if self.segments[run[2]].param not in skip]
                if runs:
                    self._adam_estimate_runs(self.inner.param_groups[g], runs, grad, out)

    def _adam_estimate_runs(
        self, group: dict[str, Any], runs: list[tuple[int, int, int]], grad: torch.Tensor, out: torch.Tensor
    ) -> None:
        """``runs``: (start, end, segment) of one group. Each segment's own step (a parameter left out of earlier
        steps counts fewer); a segment never stepped has zero moments in the flat state and step 0."""
        pn = self.piece_numel
        thetas = [self.master[a:b] for a, b, _ in runs]
        grads = [_piece_range(grad, a, b, pn) for a, b, _ in runs]
        targets = [_piece_range(out, a, b, pn) for a, b, _ in runs]
        # the update is computed in fp32 in place of a copy of θ: straight in ``out`` when it is fp32 and does not
        # hold the gradient (the kernel reads the gradient while it writes θ), else in a temporary rounded once
        direct = targets[0].dtype == thetas[0].dtype and not overlaps(out, self.grad)
        params = targets if direct else [torch.empty_like(t) for t in thetas]
        torch._foreach_copy_(params, thetas)

        def copies(key: str) -> list[torch.Tensor]:  # x * 1 is x, bit for bit
            if key in self._flat_state:
                return list(torch._foreach_mul([self._flat_state[key][a:b] for a, b, _ in runs], 1.0))
            return [torch.zeros_like(t) for t in thetas]

        exp_avgs, exp_avg_sqs = copies("exp_avg"), copies("exp_avg_sq")
        max_exp_avg_sqs = copies("max_exp_avg_sq") if group["amsgrad"] else []
        states = [self.inner.state.get(self._seg_params[k], {}) for _, _, k in runs]
        steps = [st["step"].clone() if "step" in st else _zero_step(group, thetas[0].device) for st in states]
        beta1, beta2 = group["betas"]
        flags = {key: group[key] for key in _ADAM_FLAGS}
        if (
            flags["foreach"] is None
            and not flags["fused"]
            and not flags["differentiable"]
            and not torch.is_tensor(group["lr"])
        ):  # torch's default: foreach on CUDA, one tensor at a time on CPU. The two do the same elementary ops in
            # the same order (bit for bit: tests/test_optim.py), and foreach's calls do not grow with the number of
            # parameters: the round holds the GIL for 10 calls per window, not 10 per parameter
            flags["foreach"] = True
        functional_adam(
            params,
            grads,
            exp_avgs,
            exp_avg_sqs,
            max_exp_avg_sqs,
            steps,
            has_complex=False,
            beta1=beta1,
            beta2=beta2,
            lr=group["lr"],
            **flags,
        )
        if not direct:
            torch._foreach_copy_(targets, params)

    @torch.no_grad()
    def _snapshot_estimate(self, out: torch.Tensor) -> None:
        """Any element-wise optimizer: step, read the result, restore master and state bit for bit."""
        kept = self.keep()
        self.inner.step()  # reads the gradient before ``out`` (possibly the same memory) is written
        out.copy_(self.master.view(out.shape))
        kept.restore()


_ADAM_FLAGS: tuple[str, ...] = ("amsgrad", "weight_decay", "eps", "maximize", "foreach", "capturable")
_ADAM_FLAGS += ("differentiable", "fused", "decoupled_weight_decay")


def _zero_step(group: dict[str, Any], device: torch.device) -> torch.Tensor:
    """The ``step`` Adam creates for a parameter without state (as ``Adam._init_group``: on the parameter's device
    when fused or capturable, else on the host)."""
    on_device = group["fused"] or group["capturable"]
    dtype = _get_scalar_dtype(is_fused=group["fused"])
    return torch.zeros((), dtype=dtype, device=device if on_device else "cpu")


def overlaps(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    """Whether the memory spans of two tensors intersect."""
    if b is None:
        return False

    def span(t: torch.Tensor) -> tuple[int, int]:
        last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()

    (a0, a1), (b0, b1) = span(a), span(b)
    return a0 < b1 and b0 < a1


def _chunks(start: int, end: int, piece_numel: int) -> list[tuple[int, int]]:
    """Split ``[start, end)`` at multiples of ``piece_numel``."""
    cuts = range((start // piece_numel + 1) * piece_numel, end, piece_numel)
    bounds = [start, *cuts, end]
    return [(a, b) for a, b in zip(bounds, bounds[1:]) if a < b]


def _piece_range(t: torch.Tensor, start: int, end: int, piece_numel: int) -> torch.Tensor:
    """Shard elements ``[start, end)`` (inside one piece) of a ``(num_pieces, piece_numel)`` tensor."""
    piece, offset = divmod(start, piece_numel)
    return t[piece, offset : offset + (end - start)]


def _gaps(runs: list[tuple[int, int]], numel: int) -> list[tuple[int, int]]:
    """The ranges of ``[0, numel)`` that no run (sorted, disjoint) covers."""
    ends, starts = [0] + [b for _, b in runs], [a for a, _ in runs] + [numel]
    return [(a, b) for a, b in zip(ends, starts) if a < b]


def _estimate_windows(segments: Sequence[Segment], window: int) -> list[dict[int, list[tuple[int, int, int]]]]:
    """Consecutive runs (start, end, segment index) of at most ``window`` elements in all, by parameter group, in
    shard order."""
    windows: list[dict[int, list[tuple[int, int, int]]]] = [{}]
    room = window
    for k, seg in enumerate(segments):
        a = seg.start
        while a < seg.end:
            if room == 0:
                windows.append({})
                room = window
            b = min(seg.end, a + room)
            windows[-1].setdefault(seg.group, []).append((a, b, k))
            room -= b - a
            a = b
    return [w for w in windows if w]
