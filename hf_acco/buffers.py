"""The pair of full-size buffers, and the rule that the main thread never touches the one a round owns.

``accum``: the main thread's fp32 gradient sums, filled by a post-accumulate-grad hook on every trainable parameter
(bf16 gradients accumulate in fp32, mixed dtypes work, ``p.grad`` stays ``None``). ``comm``: owned by the round
in flight (gradients in, parameters out); the main thread touches it only between the round's ``wait()`` and the
next launch. Handing a half's gradients to a round either swaps the two (the step's sums go; accumulation restarts
from zero) or copies ``accum`` into ``comm`` (half B keeps accumulating on top of half A's sums). The synchronous
schedule has no overlap: its round works in ``accum`` itself and there is no second buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .sharding import FlatLayout


class BufferPair:
    """``accum`` and ``comm`` over ``params`` in ``layout`` (one buffer when ``separate`` is False)."""

    def __init__(self, params: Sequence[torch.Tensor], layout: FlatLayout, device: torch.device, separate: bool):
        self.params = list(params)
        self.layout = layout
        self.device = device
        self.accum = layout.new_flat(device)
        self.comm = layout.new_flat(device) if separate else self.accum
        self.grad_scale = 1.0  # multiplies the gradients of the next backward passes as they are accumulated
        self.hook_calls = 0  # gradients accumulated since the counter was last reset
        # per-parameter views of each buffer, made once: the two buffers swap roles every step
        self._views_of = {
            id(buf): {id(p): v for p, v in zip(self.params, layout.views(buf))} for buf in (self.accum, self.comm)
        }
        self.grad_views = self._views_of[id(self.accum)]
        self._hooks: list = []

    def attach(self) -> None:
        """From now on every backward adds the parameters' gradients into ``accum`` (call it last when building
        the engine: a failed build must leave the model's autograd untouched)."""
        if not self._hooks:
            self._hooks = [p.register_post_accumulate_grad_hook(self._grad_hook) for p in self.params]

    def check_devices(self) -> None:
        for p, name in zip(self.params, self.layout.names):
            if p.device != self.device:
                raise RuntimeError(
                    f"Parameter {name} is on {p.device}, the ACCO optimizer on {self.device}: move the model to "
                    "its device before building the optimizer, and keep all trainable parameters on one device."
                )

    @property
    def separate(self) -> bool:
        return self.comm is not self.accum

    def _grad_hook(self, p: torch.Tensor) -> None:
        # Runs when autograd has finished p's gradient for this backward: accumulate it in fp32, free it.
        if self.grad_scale == 1.0:
            self.grad_views[id(p)].add_(p.grad)
        else:
            self.grad_views[id(p)].add_(p.grad, alpha=self.grad_scale)
        p.grad = None
        self.hook_calls += 1

    def hand_over(self, swap: bool) -> torch.Tensor:
        """Give ``accum``'s sums to the next round: returns the buffer the round will own (``comm``).

        Call ``restart`` after the round is launched (on CUDA its ready event is recorded first)."""
        if self.separate:
            if swap:  # the round takes the sums; the main thread restarts from the (zeroed) old round buffer
                self.comm, self.accum = self.accum, self.comm
                self.grad_views = self._views_of[id(self.accum)]
            else:
                self.comm.copy_(self.accum)
        return self.comm

    def restart(self, swap: bool) -> None:
        """After a swap, accumulation restarts from zero in the buffer the previous round gave back."""
        if swap and self.separate:
            self.accum.zero_()

    def round_returned(self) -> None:
        """The round's output has been read: with one buffer, it goes back to accumulating gradients."""
        if not self.separate:
            self.accum.zero_()

    @torch.no_grad()
    def load_into_model(self, flat: torch.Tensor) -> None:
        torch._foreach_copy_(self.params, self.layout.views(flat))

    def model_to(self, out: torch.Tensor) -> torch.Tensor:
        """The model's current parameters, flattened into ``out``."""
        return self.layout.flatten(self.params, out)

    def release(self) -> None:
        """Remove the gradient hooks: the parameters no longer feed this engine."""
        for h in self._hooks:
            h.remove()
        self._hooks = []
