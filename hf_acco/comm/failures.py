"""The failure vocabulary of the collectives: a peer's death or silence (``PeerFailure``), told apart from this rank's
own error (out of memory, CUDA, a bug), which must surface as itself. Torch only."""

from __future__ import annotations

import torch
import torch.distributed as dist


class PeerFailure(RuntimeError):
    """A collective of an ACCO round failed: a peer rank died, or stopped answering until the timeout."""


# what gloo and NCCL say when a peer process is gone or hung (DistError subclasses are matched by type)
PEER_ERRORS = (
    "Connection reset by peer",
    "Connection closed by peer",
    "Broken pipe",  # a write to a peer that has gone (gloo's writev)
    "Socket Timeout",
    "Timed out waiting",
    "remote process exited",
    "Watchdog caught collective operation timeout",
)


def is_peer_failure(error: BaseException) -> bool:
    """Whether ``error`` says that another rank died or stopped answering (not this rank's own failure, such as
    an out-of-memory error or a CUDA error, which must surface as itself)."""
    if isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower():
        return False  # this rank's own, also when NCCL reports it (e.g. setting up the round's communicator)
    return isinstance(error, (PeerFailure, dist.DistError)) or any(m in str(error) for m in PEER_ERRORS)
