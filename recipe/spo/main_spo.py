"""Entry point of the SPO recipe: ``python -m recipe.spo.main_spo [hydra overrides]`` from the repo root.

Composes verl 0.9.1's ``ppo_trainer`` configuration with ``config/spo_trainer.yaml``, validates the
SPO settings, the names verl looks up in its registries and verl's own settings, then what the launch
needs (model, tokenizer, data files, attention kernel: ``launch_checks.py``) and, for a GPU setting, a
GPU, before anything starts; then runs verl's ``run_ppo`` with a TaskRunner that trains with SPO
(default v1 trainer, or the legacy one with ``trainer.use_v1=false``), once more if Ray itself timed out
starting.

``--check`` (anywhere among the arguments) runs every check, reports the GPU instead of requiring one,
prints what it found and exits 0: a job checked before it is queued.

A configuration refused before Ray starts prints one line, ``spo: <why>``, to stderr and exits with
status 2; ``SPO_DEBUG=1`` raises the error instead, with its traceback.
"""

import os
import sys

import hydra
import verl
from hydra.core.hydra_config import HydraConfig
from omegaconf.errors import OmegaConfBaseException
from verl.trainer.main_ppo import run_ppo
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import validate_config
from verl.utils.device import auto_set_device

from recipe.spo.driver_config import prepare_for_ray
from recipe.spo.launch_checks import check_launch, gpu_problem, needs_gpu
from recipe.spo.resume_guard import overwrite_problem, record_configuration, resume_problem
from recipe.spo.run_lock import acquire, lock_problem
from spo_verl.adapters.trainer.runners import run_with_one_restart, task_runner_for
from spo_verl.adapters.trainer.validation import validate_spo_run

REFUSED_EXIT_STATUS = 2  # as the launcher's unknown SETTING: the run was refused, nothing started
DEBUG_VARIABLE = "SPO_DEBUG"
CHECK_FLAG = "--check"
VERL_WRITTEN_FOR = "0.9.1"  # the verl whose internals docs/VERL_SURFACE.md lists (pyproject pins it)


def warn_if_another_verl(version: str = verl.__version__) -> bool:
    """Say so when the installed verl is not the one the plugin's overrides and workarounds were written
    for: pip's pin can be bypassed (``--no-deps``, a verl checkout), and most of those would fail silently."""
    if version == VERL_WRITTEN_FOR:
        return False
    print(f"spo: warning: verl {version} is installed, spo-verl was written for verl {VERL_WRITTEN_FOR}; the verl "
          "internals it relies on are listed in docs/VERL_SURFACE.md: check them before trusting a run",
          file=sys.stderr, flush=True)
    return True


def validate_or_exit(config) -> None:
    """Validate before Ray starts; a refusal exits with one line (Hydra would print its own "Error
    executing job" and a traceback for it; a SystemExit passes through Hydra untouched)."""
    try:
        auto_set_device(config)
        validate_spo_run(config)
        validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    except ValueError as error:
        refuse(error)


def launch_checks_or_exit(config) -> list[str]:
    """What the launch needs (``launch_checks.py``), found or refused with one line."""
    try:
        return check_launch(config)
    except ValueError as error:
        refuse(error)


def refuse(error: ValueError):
    if os.environ.get(DEBUG_VARIABLE, "") not in ("", "0"):
        raise error
    print(refusal_line(error), file=sys.stderr, flush=True)
    sys.exit(REFUSED_EXIT_STATUS)


def refusal_line(error: ValueError) -> str:
    """The reason on one line. A check that fails while OmegaConf resolves an interpolation (the tree's
    rollout.n) reaches here wrapped in OmegaConf's error: its own message is the reason."""
    if isinstance(error, OmegaConfBaseException) and isinstance(error.__cause__, ValueError):
        error = error.__cause__
    return "spo: " + " ".join(line.strip() for line in str(error).splitlines() if line.strip())


def chosen_setting() -> str:
    """The setting's name as the scripts' ``SETTING`` names it (Hydra's choice of the config group)."""
    setting = HydraConfig.get().runtime.choices.get("setting") if HydraConfig.initialized() else None
    return setting or "(no setting)"


def report_check(config, found: list[str], gpu: str | None, setting: str) -> None:
    for line in found:
        print(f"spo: check: {line}", flush=True)
    seen = gpu or ("this Python can train on the GPUs it sees" if needs_gpu(config) else "none needed (trainer.device=cpu)")
    print(f"spo: check: GPU: {seen}", flush=True)
    print(f"spo: check passed: setting={setting}: the configuration, verl's own checks, the checkpoint folder, the model, "
          "the data and the attention kernel are ready; nothing was started", flush=True)


@hydra.main(config_path="config", config_name="spo_trainer", version_base=None)
def main(config):
    warn_if_another_verl()
    setting = chosen_setting()
    found, gpu = checks_before_ray(config, setting, require_gpu=not CHECK_ONLY)
    if CHECK_ONLY:
        report_check(config, found, gpu, setting)
        return
    with hold_checkpoint_folder(config):
        record_configuration(config)
        run_with_one_restart(run_ppo, config, task_runner_for(config))


def hold_checkpoint_folder(config):
    """The folder's lock for this driver while it trains. Taken after the checks, so two launches at once
    both pass them and one gets the lock: the folder is checked once more under it."""
    folder = config.trainer.default_local_dir
    try:
        lock, note = acquire(folder, command=" ".join(sys.argv))
    except ValueError as error:
        refuse(error)
    if note is not None:
        print(f"spo: checkpoints: {note}", flush=True)
    print(f"spo: checkpoints: lock taken by pid {lock.holder['pid']} on host {lock.holder['host']} ({lock.path}): no "
          "other launch trains into this folder until this run ends", flush=True)
    try:
        checkpoint_folder_or_exit(config, announce=False, holding_lock=True)
    except SystemExit:
        lock.release()
        raise
    return lock


def checks_before_ray(config, setting: str, require_gpu: bool) -> tuple[list[str], str | None]:
    """Everything checked before Ray: the configuration (then resolved here, for every node:
    ``driver_config.py``), the checkpoint folder (another run training into it: ``run_lock.py``; the
    checkpoint it would resume, or another run's it would write over: ``resume_guard.py``; checked before
    the GPU, which it does not need, so that a launch that must not run is told so wherever it is
    started), a GPU (``--check`` reports it instead), then the model, data and attention kernel. Returns
    what the checks found and why there is no usable GPU (None: there is, or none is needed)."""
    validate_or_exit(config)
    for note in prepare_for_ray(config):
        print(f"spo: {note}", flush=True)
    folder = checkpoint_folder_or_exit(config)
    gpu = gpu_problem(config, setting)
    if gpu is not None and require_gpu:
        refuse(ValueError(gpu))
    found = launch_checks_or_exit(config)
    return [*found, *folder], gpu


def checkpoint_folder_or_exit(config, announce: bool = True, holding_lock: bool = False) -> list[str]:
    """The checkpoint folder is this run's to write into, or the launch is refused with one line."""
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


def take_check_flag(argv: list[str]) -> bool:
    """Remove ``--check`` from the arguments (Hydra would refuse it) and say whether it was there."""
    present = CHECK_FLAG in argv
    argv[:] = [argument for argument in argv if argument != CHECK_FLAG]
    return present


CHECK_ONLY = False

if __name__ == "__main__":
    CHECK_ONLY = take_check_flag(sys.argv)
    main()
