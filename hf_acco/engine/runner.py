"""Where a round runs: one background thread (on CUDA, its own stream), one round at a time, and the handle the
main thread waits on. The collectives themselves: ``comm.py``."""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

import torch

ROUND_THREAD = "acco-round"  # the name of the round's thread


@dataclass
class RoundHandle:
    """A round launched in the background. ``wait()`` returns its result and orders the caller's stream."""

    future: Future
    launched_at: float = field(default_factory=time.perf_counter)
    failed_event: Any = None  # on CUDA, a round that raised: recorded after the work it had queued

    def done(self) -> bool:
        if not self.future.done():
            return False
        event = self.future.result()[1] if self.future.exception() is None else None
        return event is None or event.query()

    def wait(self) -> Any:
        try:
            result, event = self.future.result()  # re-raises an exception of the round
        except BaseException:
            if self.failed_event is not None:  # a caller that goes on must not touch what the failed round used
                torch.cuda.current_stream().wait_event(self.failed_event)
            raise
        if event is not None:
            torch.cuda.current_stream().wait_event(event)  # main stream reads what the round wrote
        return result


class CompletedRound(RoundHandle):
    """Stands for a round whose output is already in place (after a resume)."""

    def __init__(self, result: Any = None) -> None:
        future: Future = Future()
        future.set_result((result, None))
        super().__init__(future)


class RoundRunner:
    """Runs one round at a time on a background thread; on CUDA, on its own stream.

    Ordering on CUDA: ``launch`` records an event on the caller's stream after the caller filled the round's
    buffer; the side stream waits for it before the round's first kernel, and records ``done`` after its last.
    ``RoundHandle.wait`` makes the caller's stream wait for ``done`` before it reads the round's output.

    The thread is a daemon: a process that fails while its round waits on a dead or hung peer exits at once,
    instead of joining that thread until the round's collective times out (``acco_comm_timeout_s``).
    """

    def __init__(self, device: torch.device) -> None:
        # High priority (-1, CUDA's highest): a round's kernels, its blocking collectives included (since torch 2.8
        # ``async_op=False`` launches on the current stream, this one), are scheduled ahead of the compute's queued
        # kernels, so a round is not held up behind a whole micro-batch of them and the next boundary waits less.
        self._stream = torch.cuda.Stream(device=device, priority=-1) if device.type == "cuda" else None
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._work, name=ROUND_THREAD, daemon=True)
        self._thread.start()

    def _work(self) -> None:
        if self._stream is not None:  # a new thread's current device is 0: without this, rank r's first stream
            torch.cuda.set_device(self._stream.device)  # switch would create a CUDA context on GPU 0 too
        while (item := self._queue.get()) is not None:
            future, run = item
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(run())
                except BaseException as e:  # noqa: BLE001 - handed to the main thread by RoundHandle.wait
                    future.set_exception(e)

    def launch(self, fn: Callable[[], Any]) -> RoundHandle:
        ready = None
        if self._stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self._stream.device))

        future: Future = Future()
        handle = RoundHandle(future)

        def run() -> tuple[Any, torch.cuda.Event | None]:
            if self._stream is None or ready is None:  # (both or neither: CPU)
                return fn(), None
            with torch.cuda.stream(self._stream):
                self._stream.wait_event(ready)
                try:
                    result = fn()
                except BaseException:
                    handle.failed_event = torch.cuda.Event()  # set before the future takes the exception
                    handle.failed_event.record(self._stream)
                    raise
                done = torch.cuda.Event()
                done.record(self._stream)
            return result, done

        if not self._thread.is_alive():
            raise RuntimeError("This ACCO optimizer was closed: build a new one to train again.")
        self._queue.put((future, run))
        return handle

    def shutdown(self) -> None:
        """Finish the queued rounds and stop the thread."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()
