"""The ``spo_cpu`` platform: verl's ``PlatformBase`` for processes that compute on the CPU.

verl's engine and workers ask the platform for a device name, a ``torch.cuda``-like module, a
communication backend and a Ray resource. Here: device ``cpu``, backend ``gloo``, no CUDA IPC (the
weight sync takes verl's shared-memory path), and the Ray resource stays ``GPU`` so verl's resource
pools work unchanged when Ray is started with logical GPUs (``ray_init.num_gpus``).
"""

from __future__ import annotations

import contextlib
import os
import platform as host_platform
import types
from typing import Any, Optional

import torch
from verl.plugin.platform.platform_base import PlatformBase


def _cpu_device_module() -> types.ModuleType:
    """``torch.cpu`` plus the ``torch.cuda`` functions verl calls through ``get_torch_device()``
    (memory statistics report 0: the CPU has no separate device memory to account)."""
    module = types.ModuleType("spo_cpu_device")
    for name in ("is_available", "synchronize", "Stream", "Event", "current_stream", "stream", "device_count",
                 "current_device", "set_device", "StreamContext"):
        setattr(module, name, getattr(torch.cpu, name))
    zero = lambda *args, **kwargs: 0  # noqa: E731
    nothing = lambda *args, **kwargs: None  # noqa: E731
    for name in ("memory_allocated", "memory_reserved", "max_memory_allocated", "max_memory_reserved"):
        setattr(module, name, zero)
    for name in ("empty_cache", "ipc_collect", "reset_peak_memory_stats", "set_per_process_memory_fraction"):
        setattr(module, name, nothing)
    module.mem_get_info = lambda *args, **kwargs: (_available_memory(), _total_memory())
    module.get_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    module.set_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    module.manual_seed = torch.manual_seed
    module.manual_seed_all = torch.manual_seed
    module.get_device_name = lambda *args, **kwargs: host_platform.processor() or "cpu"
    return module


def _total_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _available_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


class CPUPlatform(PlatformBase):
    _device_module = _cpu_device_module()

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return self._device_module

    def is_available(self) -> bool:
        return True

    def current_device(self) -> str:
        # A string, not 0: verl calls model.to(get_device_id()), and torch reads an int as an
        # accelerator index.
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        return None

    def synchronize(self, device_index: Optional[int] = None) -> None:
        return None

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        return None

    def empty_cache(self) -> None:
        return None

    def get_device_capability(self, device_index: int = 0) -> tuple[Optional[int], Optional[int]]:
        return None, None

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"  # what Ray sets for its (logical) GPU resource

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        return None

    def profiler_stop(self) -> None:
        return None

    def ray_resource_name(self) -> str:
        return "GPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def rollout_env_vars(self) -> dict[str, str]:
        # vLLM's CPU backend (spo_verl.adapters.cpu_platform.environment).
        from spo_verl.adapters.cpu_platform.environment import vllm_cpu_env

        return vllm_cpu_env()

    def cudart(self) -> Any:
        return None
