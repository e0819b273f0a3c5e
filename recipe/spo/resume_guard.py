"""One run per checkpoint folder: a launch that would resume a checkpoint written under another
configuration is refused before Ray, naming the settings that differ.

verl's ``resume_mode=auto`` loads whatever checkpoint lies in ``trainer.default_local_dir``: a smoke
test's, or a variant's with another learning rate, would be continued without a word. Each launch
therefore records its configuration in that folder (``RECORD_FILE``), and a launch that would resume
compares its own with the record. The settings that may change between the parts of one run (how long
it trains: steps, epochs or generated tokens; how often it validates and saves; where it logs; how it is
validated) are ``MAY_CHANGE``.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf

RECORD_FILE = "spo_run_config.yaml"
FORCE_KEY = "spo_launch.resume_despite_changes"
# Key prefixes that a resumed part of the same run may set differently.
MAY_CHANGE = (
    "trainer.total_training_steps", "trainer.total_epochs", "trainer.save_freq", "trainer.test_freq",
    "trainer.resume_mode", "trainer.resume_from_path", "trainer.logger", "trainer.val_before_train",
    "trainer.val_only", "trainer.validation_data_dir", "trainer.rollout_data_dir", "trainer.log_val_generations",
    "trainer.max_actor_ckpt_to_keep", "trainer.max_critic_ckpt_to_keep",
    "trainer.project_name", "trainer.experiment_name",
    "actor_rollout_ref.rollout.val_kwargs", "data.val_files", "data.val_max_samples", "data.val_batch_size",
    *(f"{spo}.{key}" for spo in ("algorithm.spo", "actor_rollout_ref.actor.policy_loss.spo")  # the loss's copy
      for key in ("budget", "diagnostics")),
    "ray_kwargs", "spo_launch",
)
SHOWN_DIFFERENCES = 8


def checkpoint_to_resume(config: DictConfig) -> Path | None:
    """The checkpoint verl's trainer would load at this launch, None if it trains from the base model."""
    trainer = config.trainer
    if trainer.resume_mode == "disable":
        return None
    if trainer.resume_mode == "resume_path":
        return Path(trainer.resume_from_path) if trainer.get("resume_from_path") else None
    folder = Path(trainer.default_local_dir)
    tracker = folder / "latest_checkpointed_iteration.txt"  # verl's get_checkpoint_tracker_filename
    if not tracker.is_file():
        return None
    step = tracker.read_text().strip()
    checkpoint = folder / f"global_step_{step}"
    return checkpoint if checkpoint.is_dir() else None


def record_of(checkpoint: Path) -> Path:
    """Where the configuration of the run that wrote ``checkpoint`` is recorded: beside its steps."""
    return checkpoint.parent / RECORD_FILE


def comparable(config: DictConfig) -> dict[str, object]:
    """Every setting of ``config`` as ``dotted.key: value``, without the ones in ``MAY_CHANGE``."""
    flat: dict[str, object] = {}

    def walk(node, prefix: str):
        if isinstance(node, dict) and node:
            for key, value in node.items():
                walk(value, f"{prefix}.{key}" if prefix else str(key))
        elif not any(prefix == allowed or prefix.startswith(allowed + ".") for allowed in MAY_CHANGE):
            flat[prefix] = node

    walk(OmegaConf.to_container(config, resolve=True), "")
    return flat


def differences(recorded: dict[str, object], current: dict[str, object]) -> list[str]:
    """``key: recorded -> current`` for each setting that differs, in key order (``(unset)`` where a side
    lacks the key)."""
    missing = "(unset)"
    keys = sorted(set(recorded) | set(current))
    return [f"{key}: {recorded.get(key, missing)!r} -> {current.get(key, missing)!r}"
            for key in keys if recorded.get(key, missing) != current.get(key, missing)]


def resume_problem(config: DictConfig) -> tuple[str | None, str | None]:
    """(why this launch must not resume, what it will do): the first is None where it may."""
    checkpoint = checkpoint_to_resume(config)
    if checkpoint is None:
        return None, "training from the base model (no checkpoint to resume)"
    record = record_of(checkpoint)
    if not record.is_file():
        return None, (f"resuming {checkpoint}; its folder has no record of the run's configuration ({RECORD_FILE}), "
                      "so it is not compared")
    changed = differences(yaml.safe_load(record.read_text()) or {}, comparable(config))
    if not changed:
        return None, f"resuming {checkpoint}, written under this same configuration"
    shown = "; ".join(changed[:SHOWN_DIFFERENCES]) + (
        f"; and {len(changed) - SHOWN_DIFFERENCES} more" if len(changed) > SHOWN_DIFFERENCES else "")
    if OmegaConf.select(config, FORCE_KEY, default=False):
        return None, f"resuming {checkpoint} despite {len(changed)} changed setting(s) ({FORCE_KEY}=true): {shown}"
    return (f"{checkpoint} was written under another configuration ({len(changed)} setting(s) differ: {shown}). "
            f"To start a new run, give it its own experiment name (EXPERIMENT_NAME=... or trainer.experiment_name=...) "
            f"or set trainer.resume_mode=disable; to resume it anyway, set {FORCE_KEY}=true"), None


def record_configuration(config: DictConfig) -> Path:
    """Write this launch's configuration where its checkpoints go (what a later launch compares with)."""
    folder = Path(config.trainer.default_local_dir)
    folder.mkdir(parents=True, exist_ok=True)
    record = folder / RECORD_FILE
    record.write_text(yaml.safe_dump(comparable(config), sort_keys=True))
    return record
