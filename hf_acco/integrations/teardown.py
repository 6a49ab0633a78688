"""A run's end (``hf_acco.end_training``): the ranks leave together, and the wrapped models go before the process
groups. Duck-typed over Accelerate's ``Accelerator`` and transformers' ``Trainer``: it imports neither."""

from __future__ import annotations

import gc
from typing import Any


def end_training(accelerator: Any, trainer: Any = None) -> None:
    """A run's last distributed act, in the order that cannot hang at exit: every rank here, then the wrapped
    models released, then the process groups destroyed (``accelerator.end_training()``). Call it last; the
    caller drops its own references to a DistributedDataParallel model before it.

    A DistributedDataParallel model that outlives ``destroy_process_group()`` is left holding the last reference
    to the gloo process group, in its C++ reducer. torch binds the reducer without giving up the GIL in its
    destructor, so the group's destructor, which joins its worker threads, then runs with the GIL held, while a
    worker thread that still has to let go of a finished collective's tensors waits for the GIL: that rank never
    exits (seen in CI: the main thread in a destructor as ``main()`` returned, a second thread with no Python frame).
    Released first, the model drops a reference that the process-group registry still holds; the registry lets go
    of the last one from Python, and that destructor does give up the GIL while it joins.
    """
    accelerator.wait_for_everyone()
    if trainer is not None:
        trainer.model_wrapped = trainer.model  # the Trainer's reference to the wrapper
    accelerator.free_memory()  # Accelerate's references to what it prepared (the wrapper among them)
    gc.collect()  # a wrapper held only in reference cycles goes now, not at exit
    accelerator.end_training()
