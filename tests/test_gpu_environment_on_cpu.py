"""A GPU setting on a machine or Python that cannot train it stops before Ray, in seconds, saying what
was checked; the launcher never takes the set-up script's CPU .venv for a GPU run
(recipe/spo/checks_before_ray/gpu_environment.py, scripts/spo_launch.sh)."""

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from recipe.spo.checks_before_ray import gpu_environment

REPO = Path(__file__).resolve().parents[1]
TORCH_IS_A_CUDA_BUILD = torch.version.cuda is not None  # the set-up's .venv has the CPU build


def launch(script: str, **env) -> tuple[subprocess.CompletedProcess, float]:
    started = time.monotonic()
    result = subprocess.run(["bash", str(REPO / "scripts" / script)], env={**os.environ, **env}, capture_output=True,
                            text=True, timeout=120, cwd="/")
    return result, time.monotonic() - started


@pytest.mark.parametrize("script, setting", [("run_spo_tree.sh", "math-r1-1.5b"), ("run_spo_chain.sh", "gsm8k-rhomath-1.1b")])
def test_a_gpu_setting_with_a_cpu_only_torch_stops_before_ray(script, setting):
    result, seconds = launch(script, SETTING=setting, PYTHON=sys.executable)  # this .venv: torch's CPU build
    assert result.returncode == 2 and seconds < 60
    if TORCH_IS_A_CUDA_BUILD:  # a GPU user's torch on this machine without a GPU (scripts/test_gpu_user_versions.sh)
        assert f"spo: SETTING={setting} trains on GPUs, but torch " in result.stderr and "sees no GPU" in result.stderr
    else:
        assert f"spo: SETTING={setting} trains on GPUs, but {sys.executable} has torch " in result.stderr
        assert "a CPU-only build" in result.stderr and "pip install 'verl[vllm]==0.9.1'" in result.stderr
    output = result.stdout + result.stderr
    assert "Started a local Ray instance" not in output and "ray init kwargs" not in output


def test_a_gpu_run_uses_the_clusters_python_not_the_cpu_venv(tmp_path):
    # The cluster's python3, first on PATH: it records how it was called; asked whether verl is there (the
    # launcher's `-c` look before anything else) it says yes, as the cluster's Python with verl would.
    shim = tmp_path / "python3"
    shim.write_text('#!/bin/sh\necho "cluster python3: $*" >&2\n[ "$1" = "-c" ] && exit 0\nexit 7\n')
    shim.chmod(0o755)
    env = {key: value for key, value in os.environ.items() if key != "PYTHON"}
    env["PATH"] = f"{tmp_path}:{env['PATH']}"
    result = subprocess.run(["bash", str(REPO / "scripts" / "run_spo_tree.sh")], env={**env, "SETTING": "math-r1-1.5b"},
                            capture_output=True, text=True, timeout=120, cwd="/")
    assert result.returncode == 2
    assert f"cluster python3: {REPO}/recipe/spo/checks_before_ray/gpu_environment.py math-r1-1.5b" in result.stderr


def test_a_missing_python_and_an_unknown_setting_are_named():
    result, _ = launch("run_spo_chain.sh", SETTING="gsm8k-rhomath-1.1b", PYTHON="/nonexistent/python")
    assert result.returncode == 2 and "PYTHON=/nonexistent/python, which is not found" in result.stderr
    result, _ = launch("run_spo_tree.sh", SETTING="math-r1")
    assert result.returncode == 2
    assert "unknown SETTING=math-r1 (allowed: cpu-smollm2 cpu-tiny gsm8k-rhomath-1.1b math-r1-1.5b)" in result.stderr


def _torch(cuda: str | None, devices: int):
    """torch as this check reads it. This machine's torch is the CPU build, so a CUDA build with or
    without a device is a stand-in."""
    return SimpleNamespace(__version__="2.13.0+cu128", version=SimpleNamespace(cuda=cuda, hip=None),
                           cuda=SimpleNamespace(device_count=lambda: devices))


def test_a_cuda_build_that_sees_no_device_is_refused_naming_what_was_checked(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    reason = gpu_environment.problem("math-r1-1.5b", _torch("12.8", 0))
    assert "sees no GPU (torch.cuda.device_count() == 0; CUDA_VISIBLE_DEVICES=;" in reason
    assert "nvidia-smi" in reason and "with no SETTING, a machine without a GPU trains the CPU default" in reason
    assert gpu_environment.problem("math-r1-1.5b", _torch("12.8", 8)) is None


def test_the_real_torch_here_is_named_by_what_keeps_it_from_a_gpu():
    """The set-up's CPU build is named as one; a GPU user's CUDA build on this machine sees no GPU."""
    assert ("sees no GPU" if TORCH_IS_A_CUDA_BUILD else "a CPU-only build") in gpu_environment.problem("cpu-check", None)
