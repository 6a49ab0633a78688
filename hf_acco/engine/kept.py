"""A shard optimizer's master and state kept aside and put back bit for bit, for an update that must not stand: a
commit the ranks did not all complete (the vote, ``rounds.RoundBody``), and the estimate of an optimizer without an
out-of-place update (``ShardOptimizer._snapshot_estimate``: step, read the result, put everything back). Torch only.

What is kept: the master shard, and every segment's state as the inner torch optimizer holds it (its per-element
moments are views of one vector per key, copied segment by segment: the same bytes as the vectors). Memory: a copy
of the master and of each per-element state vector (AdamW: three shard-sized fp32 vectors) until it is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch


class Kept:
    """A shard's ``master`` and the state ``inner`` (its torch optimizer) holds for ``params`` (its segments), as
    they are now, with its per-element vectors by name (``flat``); ``restore()`` puts them back (the shard's own
    tensors keep their storage: views stay views). ``ShardOptimizer.keep`` makes one."""

    def __init__(
        self, master: torch.Tensor, inner: torch.optim.Optimizer, params: Sequence[Any], flat: dict[str, torch.Tensor]
    ) -> None:
        self.live, self.inner, self.params, self.flat = master, inner, list(params), flat
        self.master = master.clone()
        self.state: dict[Any, dict[str, Any]] = {
            p: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in inner.state[p].items()}
            for p in self.params
            if p in inner.state
        }
        self.flat_keys = set(flat)

    @torch.no_grad()
    def restore(self) -> None:
        self.live.copy_(self.master)
        added = set(self.flat) - self.flat_keys  # per-element vectors the update undone made: they go
        for p in self.params:
            saved = self.state.get(p)
            if saved is None:  # stepped for the first time by the update undone: no state, as before it
                self.inner.state.pop(p, None)
                continue
            current = self.inner.state[p]
            for key in [k for k in current if k not in saved]:
                del current[key]
            for key, value in saved.items():
                now = current.get(key)
                if key not in added and torch.is_tensor(now) and torch.is_tensor(value) and now.shape == value.shape:
                    now.copy_(value)  # (a view of a kept per-element vector stays one)
                else:
                    current[key] = value
        for key in added:  # (the segments hold the kept tensors of that key again, as before the update)
            del self.flat[key]
