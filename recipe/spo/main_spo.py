"""Entry point of the SPO recipe: ``python -m recipe.spo.main_spo [hydra overrides]`` from the repo root.

Composes verl 0.9.1's ``ppo_trainer`` configuration with ``config/spo_trainer.yaml``, runs every check
before Ray (``checks_before_ray/``: the configuration, the checkpoint folder, a GPU for a GPU setting, the
model, data and attention kernel), takes the checkpoint folder's lock, then runs verl's ``run_ppo`` with a
TaskRunner that trains with SPO (default v1 trainer, or the legacy one with ``trainer.use_v1=false``), once
more if Ray itself timed out starting.

``--check`` (anywhere among the arguments) runs every check, reports the GPU instead of requiring one,
prints what it found and exits 0: a job checked before it is queued.

A configuration refused before Ray starts prints one line, ``spo: <why>``, to stderr and exits with
status 2; ``SPO_DEBUG=1`` raises the error instead, with its traceback.
"""

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from verl.trainer.main_ppo import run_ppo

from recipe.spo.checks_before_ray import check_before_ray, checkpoint_folder_or_exit, refuse
from recipe.spo.checks_before_ray.launch_needs import needs_gpu
from recipe.spo.resume_guard import record_configuration
from recipe.spo.run_lock import acquire
from spo_verl.adapters.trainer.runners import run_with_one_restart, task_runner_for

CHECK_FLAG = "--check"


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
    setting = chosen_setting()
    report = check_before_ray(config, setting, require_gpu=not CHECK_ONLY)
    if CHECK_ONLY:
        report_check(config, report.found, report.gpu, setting)
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


def take_check_flag(argv: list[str]) -> bool:
    """Remove ``--check`` from the arguments (Hydra would refuse it) and say whether it was there."""
    present = CHECK_FLAG in argv
    argv[:] = [argument for argument in argv if argument != CHECK_FLAG]
    return present


# Hydra's flags that take a value, and --info's optional one.
HYDRA_VALUE_FLAGS = {"--cfg", "-c", "--package", "-p", "--config-path", "-cp", "--config-name", "-cn",
                     "--config-dir", "-cd", "--experimental-rerun", "--shell-completion", "-sc"}
HYDRA_INFO_FLAGS = {"--info", "-i"}
HYDRA_INFO_VALUES = {"all", "config", "defaults", "defaults-tree", "plugins", "searchpath"}


def hydra_flags_last(argv: list[str]) -> None:
    """Put Hydra's flags (with their values) after the overrides: Hydra's argument parser takes the overrides
    only before a flag (``--cfg job key=value`` is refused there), while a user writes them on either side,
    and the launcher appends its own overrides' extra arguments after the ones it sets."""
    overrides, flags = [], []
    arguments = iter(argv[1:])
    for argument in arguments:
        if not argument.startswith("-"):
            overrides.append(argument)
            continue
        flags.append(argument)
        if argument in HYDRA_VALUE_FLAGS:
            flags.append(next(arguments, ""))
        elif argument in HYDRA_INFO_FLAGS:
            rest = list(arguments)
            if rest and rest[0] in HYDRA_INFO_VALUES:
                flags.append(rest.pop(0))
            arguments = iter(rest)
    argv[1:] = [*overrides, *[flag for flag in flags if flag != ""]]


CHECK_ONLY = False

if __name__ == "__main__":
    CHECK_ONLY = take_check_flag(sys.argv)
    hydra_flags_last(sys.argv)
    main()
