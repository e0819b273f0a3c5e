"""verl on a machine without an accelerator: a ``cpu`` platform for verl's platform registry.

Selected with ``VERL_PLATFORM=spo_cpu`` (the run scripts set it when no GPU is visible). The plugin's
registration (``spo_verl.adapters.registration``, in every process that imports verl) activates it only
then, so GPU users never load its platform or workarounds. On selection it registers :class:`CPUPlatform` and applies the narrow
workarounds of :mod:`spo_verl.adapters.cpu_platform.workarounds` (each names the verl code it works around).
"""

from __future__ import annotations

import os

PLATFORM_NAME = "spo_cpu"


def selected() -> bool:
    return os.environ.get("VERL_PLATFORM", "").strip().lower() == PLATFORM_NAME


def activate() -> None:
    """Register the platform and apply the workarounds (idempotent)."""
    from verl.plugin.platform.platform_manager import PlatformRegistry

    from spo_verl.adapters.cpu_platform import workarounds
    from spo_verl.adapters.cpu_platform.platform import CPUPlatform

    if PlatformRegistry.get(PLATFORM_NAME) is not CPUPlatform:
        PlatformRegistry.register(PLATFORM_NAME)(CPUPlatform)
    workarounds.apply_all()
