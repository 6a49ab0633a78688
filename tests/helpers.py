"""Helpers the tests share (one definition each)."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def rel(a: torch.Tensor | Sequence[torch.Tensor], b: torch.Tensor | Sequence[torch.Tensor]) -> float:
    """Relative error ``|a - b| / |b|`` of two tensors, or of two lists of tensors taken as one vector, in float64."""
    flat = lambda x: x.flatten().double() if torch.is_tensor(x) else torch.cat([t.flatten().double() for t in x])  # noqa: E731
    fa, fb = flat(a), flat(b)
    return float((fa - fb).norm() / fb.norm())
