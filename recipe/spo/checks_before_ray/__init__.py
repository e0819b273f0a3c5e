"""Every check a launch runs before Ray, behind one entry, :func:`check_before_ray`, which the recipe's entry
point calls for a launch and for ``--check`` alike (the run scripts reach it through that entry point):

* the configuration (``configuration.py``: the SPO settings against verl's, and the names verl looks up;
  ``verl_check.py``: verl's own check, its refusal in the keys a user sets);
* the checkpoint folder: another run training into it (``recipe/spo/run_lock.py``), the checkpoint it would
  resume or another run's it would write over (``recipe/spo/resume_guard.py``); checked before the GPU, which
  it does not need, so that a launch that must not run is told so wherever it is started;
* a GPU (``gpu_environment.py``, which the launcher also runs alone before importing verl, so a CPU
  environment on a GPU node costs a second);
* the model, data, attention kernel, GPU count and Ray cluster (``launch_needs.py``).

A refusal prints one line, ``spo: <why>``, to stderr and exits with status 2; ``SPO_DEBUG=1`` raises the
error instead, with its traceback.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Any

import verl

from recipe.spo.checks_before_ray.configuration import check_micro_batches, check_nodes_join_a_cluster, validate_spo_run
from recipe.spo.checks_before_ray.launch_needs import check_launch, check_models_verl_reads, gpu_problem
from recipe.spo.checks_before_ray.verl_check import check_with_verl, one_line
from recipe.spo.driver_config import prepare_for_ray
from recipe.spo.resume_guard import overwrite_problem, resume_problem
from recipe.spo.run_lock import lock_problem

REFUSED_EXIT_STATUS = 2  # as the launcher's unknown SETTING: the run was refused, nothing started
DEBUG_VARIABLE = "SPO_DEBUG"
VERL_WRITTEN_FOR = "0.9.1"  # the verl whose internals docs/VERL_SURFACE.md lists (pyproject pins it)


@dataclass(frozen=True)
class CheckReport:
    """What the checks found that a user should know (``found``), and why this Python has no usable GPU
    (``gpu``; None: it has one, or none is needed)."""

    found: list[str]
    gpu: str | None


def check_before_ray(config: Any, setting: str, require_gpu: bool) -> CheckReport:
    """Every check, in the order above; a refusal exits (:func:`refuse`). The configuration is resolved here
    for every node (``recipe/spo/driver_config.py``). ``require_gpu``: refuse a launch without a usable GPU
    (``--check`` reports it instead)."""
    warn_if_another_verl()
    check_configuration_or_exit(config)
    for note in prepare_for_ray(config):
        print(f"spo: {note}", flush=True)
    folder = checkpoint_folder_or_exit(config)
    gpu = gpu_problem(config, setting)
    if gpu is not None and require_gpu:
        refuse(ValueError(gpu))
    try:
        found = check_launch(config)
    except ValueError as error:
        refuse(error)
    return CheckReport([*found, *folder], gpu)


def warn_if_another_verl(version: str = verl.__version__) -> bool:
    """Say so when the installed verl is not the one the plugin's overrides and workarounds were written
    for: pip's pin can be bypassed (``--no-deps``, a verl checkout), and most of those would fail silently."""
    if version == VERL_WRITTEN_FOR:
        return False
    print(f"spo: warning: verl {version} is installed, spo-verl was written for verl {VERL_WRITTEN_FOR}; the verl "
          "internals it relies on are listed in docs/VERL_SURFACE.md: check them before trusting a run",
          file=sys.stderr, flush=True)
    return True


def check_configuration_or_exit(config: Any) -> None:
    """The configuration, SPO's checks first, then the models verl reads, verl's own check, the nodes and
    the micro-batches; the first refusal exits with one line (Hydra would print its own "Error executing
    job" and a traceback for it; a SystemExit passes through Hydra untouched)."""
    from verl.utils.device import auto_set_device

    try:
        auto_set_device(config)
        validate_spo_run(config)
        check_models_verl_reads(config)
        check_with_verl(config)
        check_nodes_join_a_cluster(config)
        check_micro_batches(config)
    except ValueError as error:
        refuse(error)


def checkpoint_folder_or_exit(config: Any, announce: bool = True, holding_lock: bool = False) -> list[str]:
    """The checkpoint folder is this run's to write into, or the launch is refused with one line.
    ``holding_lock``: this launch holds the folder's lock (checked once more under it)."""
    folder = config.trainer.default_local_dir
    refusal, in_use = (None, "held by this launch") if holding_lock else lock_problem(folder)
    if refusal is None:
        refusal = overwrite_problem(config)
    if refusal is None:
        refusal, resuming = resume_problem(config)
    if refusal is not None:
        refuse(ValueError(refusal))
    if announce:
        print(f"spo: checkpoints: {folder}: {resuming}", flush=True)
    return [f"checkpoints: {resuming}", f"checkpoint folder: {in_use}"]


def refuse(error: BaseException):
    """Exit with the refusal on one line, ``spo: <why>``."""
    if os.environ.get(DEBUG_VARIABLE, "") not in ("", "0"):
        raise error
    print(refusal_line(error), file=sys.stderr, flush=True)
    sys.exit(REFUSED_EXIT_STATUS)


def refusal_line(error: BaseException) -> str:
    return "spo: " + one_line(error)
