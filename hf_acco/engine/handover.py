"""A half's sums taken by the round itself: the cast copy of ``accum`` into the round's buffer (fp32 sums into a
bf16 wire, for instance) runs first thing on the round's thread and, on CUDA, its stream, off the main thread and
stream; the main thread writes ``accum`` again only once the copy has been made.

Ordering on CUDA (the invariant at each sync point):

* before the copy: the round's stream has waited for the launch's ``ready`` event, recorded on the main stream after
  the half's last gradient was added into ``accum`` and ``hand_over`` zeroed what nothing wrote;
* ``taken`` is recorded on the round's stream after the copy;
* every writer of ``accum`` until the next hand-over (the next half's gradient hooks, on autograd's thread, on the
  stream each parameter's backward ran on; or the main thread at a step boundary, evaluation or a checkpoint, which
  use ``accum`` as scratch) first waits on the host until the copy has been queued (a ``threading.Event``: a stream
  told to wait for an event not yet recorded would not wait at all), then makes its own stream wait for ``taken``,
  once per stream: on the device, the host goes on.

The round's thread never waits here (it would wait for itself): ``wait`` refuses to run there.

The other direction, ``HookStreams``: the gradient hooks' kernels run on whatever stream autograd or FSDP2 runs them
on (FSDP2: its reduce-scatter stream, ``with stream(post_reduce_stream)``). Invariant: before the main thread reads
or writes ``accum`` after a backward (a hand-over, a step boundary's scratch use), the main stream waits, on the
device, for every stream a hook ran on since the last such point (``wait_stream``: an event recorded now on that
stream, which already holds every kernel the hooks queued, since backward has returned on the host). This holds
whatever FSDP's own end-of-backward synchronisation does (``set_is_last_backward(False)`` turns it off).

On CPU the copy is over when the host event is set, and every kernel is over when its call returns. Torch only.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from hf_acco.engine.runner import ROUND_THREAD


def current_stream(device: torch.device) -> torch.cuda.Stream:
    """The calling thread's current stream on ``device`` (a seam: the tests put fake streams here)."""
    return torch.cuda.current_stream(device)


class LentSums:
    """``accum`` lent to a round until its copy is made (``take`` on the round's thread, ``wait`` by the writer)."""

    def __init__(self, copy: Callable[[], object], device: torch.device) -> None:
        self._copy = copy
        self._device = device
        self._queued = threading.Event()
        self._taken: torch.cuda.Event | None = None
        self._ordered: set[int] = set()  # the streams made to wait for ``taken``

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
        """Before writing ``accum`` again: the copy queued (host), then this stream after it (device, once)."""
        if not self._queued.is_set():
            if threading.current_thread().name == ROUND_THREAD:
                raise AssertionError("the round's thread waited for its own copy of the sums")  # invariant
            self._queued.wait()
        if self._taken is not None:
            stream = current_stream(self._device)
            if stream.stream_id not in self._ordered:
                stream.wait_event(self._taken)
                self._ordered.add(stream.stream_id)


class HookStreams:
    """The streams the gradient hooks ran on since the main stream last waited for them (see the module's
    docstring). ``note`` runs in each hook (autograd's thread; backward has returned before the main thread reads
    the sums, so the two never run at once); ``order_main`` on the main thread, before it touches ``accum``."""

    def __init__(self, device: torch.device) -> None:
        self._cuda = device.type == "cuda"
        self._device = device
        self._streams: dict[int, torch.cuda.Stream] = {}

    def note(self) -> None:
        if self._cuda:
            stream = current_stream(self._device)
            self._streams.setdefault(stream.stream_id, stream)

    def order_main(self) -> None:
        """The main stream after every kernel the hooks queued (on the device: the host goes on)."""
        if not self._streams:
            return
        main = current_stream(self._device)
        for stream_id, stream in self._streams.items():
            if stream_id != main.stream_id:
                main.wait_stream(stream)
        self._streams.clear()
