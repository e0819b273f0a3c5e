"""The environment a CPU run needs, defined once: vLLM's CPU backend and nothing fetched from the network.

Read by the ``spo_cpu`` platform (the environment verl gives its rollout servers), the launcher
(``scripts/spo_launch.sh`` evaluates ``python -m spo_verl.adapters.cpu_platform.environment``, which prints
these as shell exports), the tests' standalone verl server and the task calibration. A value already
in the environment wins, except the two that the CPU backend cannot run without.
"""

from __future__ import annotations

import os
import shlex

VLLM_CPU_ENV = {
    "VLLM_TARGET_DEVICE": "cpu",
    # KV cache in GiB; a CPU run's sequences are short.
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # Do not pin OpenMP threads to cores (the "auto" binding reserves cores and is fragile in containers).
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
    # vLLM's CPU platform spawns its worker anyway; the engine-core process must be spawned too
    # (forking a process that runs Ray or asyncio threads is unsafe).
    "VLLM_WORKER_MULTIPROC_METHOD": "spawn",
    # vLLM's CPU sampler is torch.compile-d; compiling it on the first request takes ~25 s on two
    # cores. Disabled, it runs eagerly (same maths); the model runs eagerly anyway (enforce_eager).
    "TORCH_COMPILE_DISABLE": "1",
}
REQUIRED = ("VLLM_TARGET_DEVICE", "VLLM_WORKER_MULTIPROC_METHOD")
OFFLINE_ENV = {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "VLLM_NO_USAGE_STATS": "1",
    "RAY_USAGE_STATS_ENABLED": "0",
    "DO_NOT_TRACK": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def vllm_cpu_env() -> dict[str, str]:
    """``VLLM_CPU_ENV`` with this process's own values where it has them (except ``REQUIRED``)."""
    return {key: value if key in REQUIRED else os.environ.get(key, value) for key, value in VLLM_CPU_ENV.items()}


def cpu_run_env() -> dict[str, str]:
    return {**vllm_cpu_env(), **{key: os.environ.get(key, value) for key, value in OFFLINE_ENV.items()}}


if __name__ == "__main__":
    for key, value in cpu_run_env().items():
        print(f"export {key}={shlex.quote(value)}")
