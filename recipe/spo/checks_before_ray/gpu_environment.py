"""Whether a Python environment can train a GPU setting: torch installed, built with CUDA, and seeing a
device. The launcher runs this file with the Python it is about to train with (``python
recipe/spo/checks_before_ray/gpu_environment.py SETTING``), before Ray starts, so a CPU environment on a GPU node, or a
node without a GPU, costs seconds and says so instead of falling back or hanging.

It runs as a plain script (standard library and torch only): the environment under test need not have
this package installed for the message to be clear.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

# What a GPU node needs next to this package (README, docs/CLUSTER.md).
GPU_INSTALL = "pip install 'verl[vllm]==0.9.1' && pip install -e . (on the GPU node, in the cluster's Python)"


def _nvidia_smi() -> str:
    if shutil.which("nvidia-smi") is None:
        return "nvidia-smi is not on PATH"
    try:
        listed = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as error:
        return f"nvidia-smi -L failed ({error})"
    lines = (listed.stdout or listed.stderr).strip().splitlines()
    return f"nvidia-smi -L: {lines[0] if lines else f'exit {listed.returncode}, no output'}"


def problem(setting: str, torch_module=None) -> str | None:
    """Why this Python cannot train ``setting`` on a GPU, or None when it can. ``torch_module``: torch
    itself by default (a stand-in in the tests)."""
    python = sys.executable
    if torch_module is None:
        try:
            import torch as torch_module
        except ImportError:
            return f"SETTING={setting} trains on GPUs, but {python} has no torch. Install the GPU stack: {GPU_INSTALL}; or set PYTHON to the Python that has it."
    version = torch_module.__version__
    if torch_module.version.cuda is None and getattr(torch_module.version, "hip", None) is None:
        return (f"SETTING={setting} trains on GPUs, but {python} has torch {version}, a CPU-only build (the set-up "
                f"script's .venv is the CPU stack). Install the GPU stack: {GPU_INSTALL}; or set PYTHON to the Python that has it.")
    if torch_module.cuda.device_count() == 0:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        return (f"SETTING={setting} trains on GPUs, but torch {version} in {python} sees no GPU "
                f"(torch.cuda.device_count() == 0; CUDA_VISIBLE_DEVICES={visible if visible is not None else 'unset'}; "
                f"{_nvidia_smi()}). Run it on a GPU node; with no SETTING, a machine without a GPU trains the CPU default.")
    return None


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python recipe/spo/checks_before_ray/gpu_environment.py SETTING", file=sys.stderr)
        return 2
    reason = problem(argv[0])
    if reason is None:
        return 0
    print(f"spo: {reason}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
