"""The configuration as the driver hands it to Ray: every value that depends on where the launch runs is
fixed here, in the driver.

verl's TaskRunner is a Ray actor, and on a cluster started with ``ray start`` it may run on another node.
It resolves the configuration there, so an ``${oc.env:DATA_DIR}`` would read that node's environment and
a relative path that worker's directory; and the workers that ``ray start`` began see none of the
launching shell's exports (verl forwards only its own few variables). So the driver resolves every
interpolation, makes every path absolute and hands the variables the workers read to every Ray worker
through ``ray_init.runtime_env``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from omegaconf import DictConfig, ListConfig, OmegaConf, open_dict

from spo_verl.adapters.cpu_platform.environment import OFFLINE_ENV, VLLM_CPU_ENV

# Read by processes that Ray starts: verl's file logger and TensorBoard (each worker that logs), the
# plugin's CPU platform and vLLM's CPU backend (every worker and rollout server), the model hub's
# location and offline switches (every process that loads the tokenizer or model), and the launcher's
# quieting of known import warnings.
FORWARDED_VARIABLES = (
    "VERL_FILE_LOGGER_PATH", "TENSORBOARD_DIR",
    "VERL_PLATFORM", "VERL_ENGINE_DEVICE", *VLLM_CPU_ENV, *OFFLINE_ENV,
    "HF_HOME", "HF_HUB_CACHE", "HF_DATASETS_OFFLINE",
    "PYTHONWARNINGS",
)

# Files and folders the run reads or writes, made absolute against the driver's working directory.
PATH_KEYS = (
    "data.train_files", "data.val_files",
    "trainer.default_local_dir", "trainer.validation_data_dir", "trainer.rollout_data_dir",
    "trainer.resume_from_path", "algorithm.spo.diagnostics.sample_log.dir",
    "custom_reward_function.path",
)
# Model folders: a relative path that exists here is made absolute; anything else is a model hub id.
MODEL_KEYS = ("actor_rollout_ref.model.path", "actor_rollout_ref.model.tokenizer_path", "critic.model.path",
              "critic.model.tokenizer_path")

# A Ray the driver starts gets these logical resources; a running cluster has its own, and Ray refuses
# them when it connects to one.
LOCAL_RAY_RESOURCES = ("num_cpus", "num_gpus")


def prepare_for_ray(config: DictConfig, environ: Mapping[str, str] | None = None,
                    cwd: str | Path | None = None) -> list[str]:
    """Resolve ``config`` in place as described above; returns one line for each thing it changed that a
    user should know (the resources dropped for a running cluster)."""
    environ = os.environ if environ is None else environ
    cwd = Path.cwd() if cwd is None else Path(cwd)
    OmegaConf.resolve(config)
    for key in PATH_KEYS:
        _absolute(config, key, cwd, only_if_present=False)
    for key in MODEL_KEYS:
        _absolute(config, key, cwd, only_if_present=True)
    notes = []
    ray_init = config.get("ray_kwargs", {}).get("ray_init", None)
    with open_dict(config):
        if ray_init is None:
            config.ray_kwargs = config.get("ray_kwargs") or {}
            config.ray_kwargs.ray_init = {}
            ray_init = config.ray_kwargs.ray_init
        runtime_env = ray_init.get("runtime_env") or {}
        env_vars = dict(runtime_env.get("env_vars") or {})
        for name in FORWARDED_VARIABLES:
            if name in environ and name not in env_vars:
                env_vars[name] = environ[name]
        ray_init.runtime_env = {**runtime_env, "env_vars": env_vars}
        address = ray_init.get("address") or environ.get("RAY_ADDRESS")
        if address:
            dropped = [name for name in LOCAL_RAY_RESOURCES if ray_init.get(name) is not None]
            for name in dropped:
                ray_init.pop(name)
            if dropped:
                notes.append(f"joining the running Ray cluster at {address}: its own resources count, not the "
                             f"setting's ray_kwargs.ray_init {', '.join(dropped)} (for a Ray the launch starts itself)")
    return notes


def forwarded_variables(config: DictConfig) -> dict[str, str]:
    """What every Ray worker of this run is given (after :func:`prepare_for_ray`)."""
    ray_init = config.get("ray_kwargs", {}).get("ray_init", {}) or {}
    return dict((ray_init.get("runtime_env") or {}).get("env_vars") or {})


def _absolute(config: DictConfig, key: str, cwd: Path, only_if_present: bool) -> None:
    value = OmegaConf.select(config, key, default=None)
    if value is None:
        return
    if isinstance(value, (ListConfig, list)):
        fixed = [_absolute_path(str(item), cwd, only_if_present) for item in value]
    else:
        fixed = _absolute_path(str(value), cwd, only_if_present)
    OmegaConf.update(config, key, fixed, merge=False, force_add=True)


def _absolute_path(value: str, cwd: Path, only_if_present: bool) -> str:
    if not value or value.startswith("/") or "://" in value:  # absolute, or remote (hdfs://, s3://, ...)
        return value
    expanded = Path(value).expanduser()
    if expanded.is_absolute():
        return str(expanded)
    if only_if_present and not (cwd / expanded).exists():
        return value
    return str((cwd / expanded).resolve())
