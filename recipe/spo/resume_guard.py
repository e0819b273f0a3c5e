"""One run per checkpoint folder: a launch that would resume a checkpoint written under another
configuration, or write over another run's checkpoints, is refused before Ray, naming what differs.

verl's ``resume_mode=auto`` loads whatever checkpoint lies in ``trainer.default_local_dir``: a smoke
test's, or a variant's with another learning rate, would be continued without a word. Each launch
therefore records its configuration in that folder (``RECORD_FILE``), and a launch that would resume
compares its own with the record. The settings that may change between the parts of one run (when it
stops: steps, epochs or generated tokens, where these do not set the learning-rate schedule's length; how
often it validates and saves; where it logs and under which names; how it is validated) are
``MAY_CHANGE``. The schedule's length is compared where an optimiser's schedule depends on it (a cosine
decay, a warm-up given as a share of the steps): a resumed run would jump to another point of the curve.

A launch that does not resume this folder's checkpoints (``resume_mode=disable``, a ``resume_from_path``
elsewhere, or ``auto`` with no tracker to follow) would train from elsewhere and write its own
``global_step_*`` and record over them: refused while the folder holds any (``overwrite_problem``).
"""

from __future__ import annotations

from pathlib import Path

import yaml
from omegaconf import DictConfig, OmegaConf

RECORD_FILE = "spo_run_config.yaml"
TRACKER_FILE = "latest_checkpointed_iteration.txt"  # verl's get_checkpoint_tracker_filename
# The way to a new run that leads somewhere: the experiment name moves the folder only where the launcher
# chooses it (CHECKPOINT_DIR unset).
NEW_FOLDER = ("give it a checkpoint folder of its own (CHECKPOINT_DIR=a new folder, or EXPERIMENT_NAME=... where "
              "CHECKPOINT_DIR is not set)")
FORCE_KEY = "spo_launch.resume_despite_changes"
# Key prefixes that a resumed part of the same run may set differently.
MAY_CHANGE = (
    "trainer.total_training_steps", "trainer.total_epochs",  # compared as SCHEDULE_LENGTH where they set it
    "trainer.save_freq", "trainer.test_freq", "trainer.default_local_dir",  # the folder: checked on its own
    "trainer.resume_mode", "trainer.resume_from_path", "trainer.logger", "trainer.val_before_train",
    "trainer.val_only", "trainer.validation_data_dir", "trainer.rollout_data_dir", "trainer.log_val_generations",
    "trainer.max_actor_ckpt_to_keep", "trainer.max_critic_ckpt_to_keep",
    "trainer.project_name", "trainer.experiment_name",
    # Where rollout traces are logged and under which names (a renamed experiment renames them).
    "actor_rollout_ref.rollout.trace.project_name", "actor_rollout_ref.rollout.trace.experiment_name",
    "actor_rollout_ref.rollout.val_kwargs", "data.val_files", "data.val_max_samples", "data.val_batch_size",
    *(f"{spo}.{key}" for spo in ("algorithm.spo", "actor_rollout_ref.actor.policy_loss.spo")  # the loss's copy
      for key in ("budget", "diagnostics")),
    "ray_kwargs", "spo_launch",
)
SHOWN_DIFFERENCES = 8
# The learning-rate schedule's length (verl: trainer.total_training_steps, else the data loader's length
# times trainer.total_epochs), recorded under this name where a schedule depends on it.
SCHEDULE_LENGTH = "trainer.total_training_steps (the learning-rate schedule's length)"
OPTIMISERS = ("actor_rollout_ref.actor.optim", "critic.optim")


def checkpoint_to_resume(config: DictConfig) -> Path | None:
    """The checkpoint verl's trainer would load at this launch, None if it trains from the base model."""
    trainer = config.trainer
    if trainer.resume_mode == "disable":
        return None
    if trainer.resume_mode == "resume_path":
        return Path(trainer.resume_from_path) if trainer.get("resume_from_path") else None
    folder = Path(trainer.default_local_dir)
    tracker = folder / TRACKER_FILE
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
        elif not allowed_to_change(prefix):
            flat[prefix] = node

    walk(OmegaConf.to_container(config, resolve=True), "")
    if schedule_depends_on_length(config):
        steps = config.trainer.get("total_training_steps", None)
        flat[SCHEDULE_LENGTH] = steps if steps is not None else f"{config.trainer.total_epochs} epochs of the data"
    return flat


def schedule_depends_on_length(config: DictConfig) -> bool:
    """Whether an optimiser's learning rate at a step depends on the run's total steps (verl's FSDP
    engine: a cosine decay to the last step, or a warm-up of ``lr_warmup_steps_ratio`` x the total steps
    where ``lr_warmup_steps`` is not set)."""
    for key in OPTIMISERS:
        optim = OmegaConf.select(config, key, default=None)
        if optim is None:
            continue
        if optim.get("lr_scheduler_type", optim.get("warmup_style", "constant")) not in (None, "constant"):
            return True
        warmup_steps = optim.get("lr_warmup_steps", -1)
        if (warmup_steps is None or warmup_steps <= 0) and (optim.get("lr_warmup_steps_ratio", 0.0) or 0.0) > 0:
            return True
    return False


def allowed_to_change(key: str) -> bool:
    return any(key == allowed or key.startswith(allowed + ".") for allowed in MAY_CHANGE)


def differences(recorded: dict[str, object], current: dict[str, object]) -> list[str]:
    """``key: recorded -> current`` for each setting that differs, in key order (``(unset)`` where a side
    lacks the key)."""
    missing = "(unset)"
    # A record written by an earlier version of this guard may hold keys it has since let change, and lack
    # the schedule's length (compared only where both sides have it).
    recorded = {key: value for key, value in recorded.items() if not allowed_to_change(key)}
    if SCHEDULE_LENGTH not in recorded or SCHEDULE_LENGTH not in current:
        recorded, current = ({key: value for key, value in side.items() if key != SCHEDULE_LENGTH}
                             for side in (recorded, current))
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
            f"To continue that run, launch it with its own settings; to start a new run, {NEW_FOLDER}; "
            f"to resume it anyway, set {FORCE_KEY}=true"), None


def checkpoints_in(folder: Path) -> list[str]:
    """The ``global_step_*`` folders (and verl's tracker file) that ``folder`` holds, by step."""
    if not folder.is_dir():
        return []
    steps = sorted((path for path in folder.glob("global_step_*") if path.is_dir()),
                   key=lambda path: (len(path.name), path.name))
    tracker = folder / TRACKER_FILE
    return [path.name for path in steps] + ([tracker.name] if tracker.is_file() else [])


def overwrite_problem(config: DictConfig) -> str | None:
    """Why this launch would write over another run's checkpoints, or None: it writes into
    ``trainer.default_local_dir``, which must then hold no checkpoint or the one this launch resumes."""
    folder = Path(config.trainer.default_local_dir)
    held = checkpoints_in(folder)
    if not held:
        return None
    checkpoint = checkpoint_to_resume(config)
    if checkpoint is not None and checkpoint.parent == folder:
        return None
    mode = config.trainer.resume_mode
    doing = ("trains from the base model" if checkpoint is None
             else f"resumes {checkpoint}, outside that folder")
    if mode == "auto":
        doing = f"finds no {TRACKER_FILE} there to resume from, so it {doing}"
    shown = ", ".join(held[:4]) + (f" and {len(held) - 4} more" if len(held) > 4 else "")
    return (f"trainer.default_local_dir={folder} holds another run's checkpoints ({shown}), and this launch "
            f"(trainer.resume_mode={mode}) {doing}: it would write its own checkpoints over them. To continue that "
            f"run, launch it again with trainer.resume_mode=auto and its settings; to start a new run, {NEW_FOLDER}; "
            f"or move {folder} away first")


def record_configuration(config: DictConfig) -> Path:
    """Write this launch's configuration where its checkpoints go (what a later launch compares with)."""
    folder = Path(config.trainer.default_local_dir)
    folder.mkdir(parents=True, exist_ok=True)
    record = folder / RECORD_FILE
    record.write_text(yaml.safe_dump(comparable(config), sort_keys=True))
    return record
