"""A half's sums taken by the round itself: the cast copy of ``accum`` into the round's buffer (fp32 sums into a
bf16 wire, for instance) runs first thing on the round's thread and, on CUDA, its stream, off the main thread and
stream; the main thread writes ``accum`` again only once the copy has been made.

Ordering on CUDA (the invariant at each sync point):

* before the copy: the round's stream has waited for the launch's ``ready`` event, recorded on the main stream after
  the half's last gradient was added into ``accum`` and ``hand_over`` zeroed what nothing wrote;
* ``taken`` is recorded on the round's stream after the copy;
* the next writer of ``accum`` (a gradient hook of the next half, on autograd's thread; or the main thread at a step
  boundary, evaluation or a checkpoint, which use ``accum`` as scratch) first waits on the host until the copy has
  been queued (a ``threading.Event``: a stream told to wait for an event not yet recorded would not wait at all),
  then makes its own stream wait for ``taken``: on the device, the host goes on.

On CPU the copy is over when the host event is set. Torch only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch


class LentSums:
    """``accum`` lent to a round until its copy is made (``take`` on the round's thread, ``wait`` by the writer)."""

    def __init__(self, copy: Callable[[], object], device: torch.device) -> None:
        self._copy = copy
        self._device = device
        self._queued = threading.Event()
        self._taken: torch.cuda.Event | None = None

    def take(self) -> None:
        """The round's first work, on its thread and stream: copy the sums, then let the writer go on (whatever
        happens: a copy that raised fails its round, which the main thread is told of when it waits for it)."""
        try:
            self._copy()
            if self._device.type == "cuda":
                taken = torch.cuda.Event()
                taken.record()  # on the round's stream, after the copy
                self._taken = taken
        finally:
            self.release()

    def release(self) -> None:
        """Let the writer go on: after the copy, or once a round that failed before it is over (nothing queued)."""
        self._queued.set()

    def wait(self) -> None:
        """Before writing ``accum`` again: the copy queued (host), then this stream after it (device)."""
        self._queued.wait()
        if self._taken is not None:
            torch.cuda.current_stream(self._device).wait_event(self._taken)
