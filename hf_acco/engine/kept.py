"""A shard optimizer's master and state kept aside and put back bit for bit, for an update that must not stand: a
commit the ranks did not all complete (the vote, ``rounds.RoundBody``), and the estimate of an optimizer without an
out-of-place update (``ShardOptimizer._snapshot_estimate``: step, read the result, put everything back). Torch only.

What is kept: the master shard, and every segment's state as the inner torch optimizer holds it (its per-element
moments are views of one vector per key, copied segment by segment: the same bytes as the vectors). Memory: a copy
of the master and of each per-element state vector (AdamW: three shard-sized fp32 vectors) until it is dropped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from hf_acco.engine.optim import ShardOptimizer


class Kept:
    """``shard``'s master and state as they are now; ``restore()`` puts them back (the shard's own tensors keep their
    storage: views stay views). Reads ``ShardOptimizer``'s internals: it is that class's helper."""

    def __init__(self, shard: ShardOptimizer) -> None:
        self.shard = shard
        self.master = shard.master.clone()
        self.state: dict[Any, dict[str, Any]] = {
            p: {k: (v.clone() if torch.is_tensor(v) else v) for k, v in shard.inner.state[p].items()}
            for p in shard._seg_params
            if p in shard.inner.state
        }
        self.flat_keys = set(shard._flat_state)

    @torch.no_grad()
    def restore(self) -> None:
        shard = self.shard
        shard.master.copy_(self.master)
        for p in shard._seg_params:
            saved = self.state.get(p)
            if saved is None:  # stepped for the first time by the update undone: no state, as before it
                shard.inner.state.pop(p, None)
                continue
            current = shard.inner.state[p]
            for key in [k for k in current if k not in saved]:
                del current[key]
            for key, value in saved.items():
                now = current.get(key)
                if torch.is_tensor(now) and torch.is_tensor(value) and now.shape == value.shape:
                    now.copy_(value)
                else:
                    current[key] = value
        for key in set(shard._flat_state) - self.flat_keys:
            del shard._flat_state[key]
