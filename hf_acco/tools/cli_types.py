"""Argument types of the command-line tools: a value out of range is argparse's one-line error (exit code 2, the
flag named, no traceback), not a traceback from deep inside the arithmetic."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def at_least(kind: Callable[[str], float], low: float, inclusive: bool = True) -> Callable[[str], float]:
    """An argparse ``type``: ``kind(text)``, refused unless >= ``low`` (> ``low`` when not ``inclusive``)."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if value < low or (value == low and not inclusive):
            raise argparse.ArgumentTypeError(f"must be {'>=' if inclusive else '>'} {low:g}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its message
    return parse


POSITIVE_FLOAT = at_least(float, 0.0, inclusive=False)
NONNEGATIVE_FLOAT = at_least(float, 0.0)
POSITIVE_INT = at_least(int, 1)

# Dense bf16 tensor-core peak (FLOP/s) and memory (GiB) of common GPUs (NVIDIA's datasheets): --gpu of both tools
GPUS = {"a100-40gb": (312e12, 40), "a100-80gb": (312e12, 80), "h100-80gb": (989e12, 80), "h200": (989e12, 141)}
