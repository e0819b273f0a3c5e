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
import re
import sys

import hydra
import verl
from hydra.core.hydra_config import HydraConfig
from hydra.errors import HydraException
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException
from verl.trainer.main_ppo import run_ppo
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import validate_config
from verl.utils.device import auto_set_device

from recipe.spo.driver_config import prepare_for_ray
from recipe.spo.launch_checks import check_launch, check_models_verl_reads, gpu_problem, needs_gpu
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


# verl's own checks (``validate_config`` and its configuration classes, built through OmegaConf and Hydra)
# refuse with assertions and OmegaConf's or Hydra's errors as well as ValueError.
VERL_REFUSALS = (ValueError, AssertionError, TypeError, OmegaConfBaseException, HydraException)
VERL_CHECK = "verl's configuration check (verl.utils.config.validate_config) refused it"
# verl's batch rule on FSDP: every step's rows split evenly over all GPUs.
BATCH_RULE = re.compile(r"real_train_batch_size \((\d+)\) must be divisible by minimal possible batch size \((\d+)\)")
MOST_GPUS_LISTED = 64


def validate_or_exit(config) -> None:
    """Validate before Ray starts; a refusal exits with one line (Hydra would print its own "Error
    executing job" and a traceback for it; a SystemExit passes through Hydra untouched)."""
    try:
        auto_set_device(config)
        validate_spo_run(config)
    except ValueError as error:
        refuse(error)
    try:
        check_models_verl_reads(config)
    except ValueError as error:
        refuse(error)
    try:
        validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    except VERL_REFUSALS as error:
        refuse(error, verl_refusal(error, config))
    refuse_nodes_without_a_cluster(config)
    refuse_uneven_micro_batches(config)


def refuse_uneven_micro_batches(config) -> None:
    """With micro-batches of a set number of rows (``use_dynamic_bsz=false``), an optimizer step's rows
    (``ppo_mini_batch_size`` x ``rollout.n``) must split evenly over the GPUs (verl's actor worker asserts
    it, after Ray and the models are up) and then into whole micro-batches: the reference loss whitens over
    each micro-batch (docs/FIDELITY.md, item 6), so a short last one would be a group of another size."""
    actor = config.actor_rollout_ref.actor
    micro = actor.get("ppo_micro_batch_size_per_gpu", None)
    if actor.use_dynamic_bsz or not micro:
        return
    rows = actor.ppo_mini_batch_size * config.actor_rollout_ref.rollout.n
    trainer = config.trainer
    gpus = trainer.n_gpus_per_node * trainer.nnodes
    if rows % gpus == 0 and (rows // gpus) % micro == 0:
        return
    allowed = [count for count in range(1, MOST_GPUS_LISTED + 1) if rows % count == 0 and (rows // count) % micro == 0]
    refuse(ValueError(
        f"actor_rollout_ref.actor.ppo_mini_batch_size={actor.ppo_mini_batch_size} x actor_rollout_ref.rollout.n="
        f"{config.actor_rollout_ref.rollout.n} = {rows} rows an optimizer step over trainer.n_gpus_per_node="
        f"{trainer.n_gpus_per_node} (GPUS_PER_NODE) x trainer.nnodes={trainer.nnodes} (NNODES) = {gpus} GPUs is not a "
        f"whole number of micro-batches of actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={micro} rows on each: "
        f"GPU counts that are: {', '.join(map(str, allowed)) or 'none'}"))


def verl_refusal(error: BaseException, config) -> str:
    """verl's refusal on one line, with the keys it is about and their values (its messages name its own
    variables, not the keys a user sets)."""
    reason = refusal_line(error).removeprefix("spo: ")
    batch = BATCH_RULE.search(reason)
    if batch:
        rows, gpus = int(batch.group(1)), int(batch.group(2))
        trainer, data = config.trainer, config.data
        allowed = [count for count in range(1, MOST_GPUS_LISTED + 1) if rows % count == 0]
        return (f"{VERL_CHECK}: data.train_batch_size={data.train_batch_size} x actor_rollout_ref.rollout.n="
                f"{config.actor_rollout_ref.rollout.n} = {rows} rows a step must divide evenly over the "
                f"trainer.n_gpus_per_node={trainer.n_gpus_per_node} (GPUS_PER_NODE) x trainer.nnodes={trainer.nnodes} "
                f"(NNODES) = {gpus} GPUs; GPU counts up to {MOST_GPUS_LISTED} that divide {rows}: "
                f"{', '.join(map(str, allowed))} (or change data.train_batch_size)")
    named = keys_named_in(reason, config)
    return f"{VERL_CHECK}: {reason}" + (f" (the keys: {', '.join(named)})" if named else "")


def keys_named_in(reason: str, config) -> list[str]:
    """``key=value`` for each configuration key whose last part the message names (verl's messages use
    the field names of its configuration classes), in the sections verl validates."""
    try:
        container = OmegaConf.to_container(config, resolve=True)
    except OmegaConfBaseException:
        return []
    found = []

    def walk(node, prefix):
        if isinstance(node, dict):
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        elif re.search(rf"\b{re.escape(prefix.rsplit('.', 1)[-1])}\b", reason) and "_" in prefix.rsplit(".", 1)[-1]:
            found.append(f"{prefix}={node}")

    # verl prefixes a field of the actor's or the critic's configuration with "actor." or "[critic]": where the
    # message names one of them, the other's field of the same name is not meant.
    sides = {"actor_rollout_ref.actor": "actor", "critic": "critic"}
    named_sides = {side for side in sides.values() if re.search(rf"\b{side}\b", reason)}
    for section in ("data", "trainer", "actor_rollout_ref.actor", "actor_rollout_ref.rollout", "critic"):
        if named_sides and section in sides and sides[section] not in named_sides:
            continue
        node = container
        for part in section.split("."):
            node = node.get(part, {}) if isinstance(node, dict) else {}
        walk(node, section)
    return found[:6]


def refuse_nodes_without_a_cluster(config) -> None:
    """Several nodes train only in a Ray cluster started on them, which the launch joins: without an address
    it would start a Ray of its own on this node and wait for the other nodes' GPUs for ever."""
    nodes = config.trainer.nnodes
    ray_init = (config.get("ray_kwargs") or {}).get("ray_init") or {}
    if nodes > 1 and not (ray_init.get("address") or os.environ.get("RAY_ADDRESS")):
        refuse(ValueError(
            f"trainer.nnodes={nodes} (NNODES) needs a running Ray cluster of {nodes} nodes to join, and this launch "
            "names none: start Ray on every node (ray start --head on this one, ray start --address=<head>:6379 on the "
            "others) and launch with +ray_kwargs.ray_init.address=auto (or RAY_ADDRESS=<head>:6379); on one node, "
            "NNODES=1 (docs/CLUSTER.md, \"Several nodes\")"))


def launch_checks_or_exit(config) -> list[str]:
    """What the launch needs (``launch_checks.py``), found or refused with one line."""
    try:
        return check_launch(config)
    except ValueError as error:
        refuse(error)


def refuse(error: BaseException, line: str | None = None):
    """Exit with the refusal on one line (``line``, else the error's own message)."""
    if os.environ.get(DEBUG_VARIABLE, "") not in ("", "0"):
        raise error
    print(refusal_line(error) if line is None else "spo: " + line, file=sys.stderr, flush=True)
    sys.exit(REFUSED_EXIT_STATUS)


def refusal_line(error: BaseException) -> str:
    """The reason on one line. A check that fails while OmegaConf resolves an interpolation (the tree's
    rollout.n) or builds a configuration class reaches here wrapped in OmegaConf's or Hydra's error: the
    wrapped error's own message is the reason."""
    while isinstance(error, (OmegaConfBaseException, HydraException)) and isinstance(error.__cause__, (ValueError, AssertionError)):
        error = error.__cause__
    text = " ".join(line.strip() for line in str(error).splitlines() if line.strip())
    if isinstance(error, AssertionError):
        text = text or "an assertion without a message"
    return "spo: " + text


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
