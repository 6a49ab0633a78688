"""Test-only: Accelerate runs FSDP on CPU ranks (gloo). Accelerate turns FSDP on for accelerator devices only and
picks MULTI_CPU on CPU; every ``AcceleratorState()`` built later copies that type back (../shared/docs/fsdp2.md
section 7). The library never does this: on GPUs Accelerate chooses FSDP itself."""

from __future__ import annotations

from typing import Any


def allow_fsdp_on_cpu() -> None:
    """Patch ``AcceleratorState.__init__`` in this process so that a state with an FSDP plugin is an FSDP state,
    with the plugin's mixed precision set as Accelerate sets it on GPUs. Idempotent."""
    from accelerate.state import AcceleratorState
    from accelerate.utils import DistributedType

    if getattr(AcceleratorState.__init__, "_fsdp_on_cpu", False):
        return
    original = AcceleratorState.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        plugin = kwargs.get("fsdp_plugin") or getattr(self, "fsdp_plugin", None)
        if plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no":
                plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = plugin

    init._fsdp_on_cpu = True  # type: ignore[attr-defined]
    AcceleratorState.__init__ = init
