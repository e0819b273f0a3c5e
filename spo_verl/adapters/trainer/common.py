"""What both verl trainers take from SPO besides its step: the actor loss to install, each row's SPO
metadata and episode from the rollout's extra fields, plain validation answers when the rollout uses an
SPO agent loop, and the refusal of per-prompt ``__rollout_n__`` under ``spo_tree``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np

from spo_verl.core.metadata import EPISODE_FIELD, SPO_ALGORITHMS, EpisodeStatistics, episode_from_extra_field
from spo_verl.adapters.agent_loops.episode_agent_loop import EPISODE_AGENT_LOOP  # a multi-turn task's answer is an episode
from spo_verl.adapters.policy_loss import LOSS_NAME, spo_ppo_loss

SPO_ESTIMATORS = SPO_AGENT_LOOPS = SPO_ALGORITHMS
# The v1 trainer mode that hands SPO metadata to the estimators (spo_verl.adapters.trainer.v1 registers it).
TRAINER_MODE = "spo"
# Validation scores one answer per session: SPO's trees and Monte Carlo continuations are for training.
VALIDATION_AGENT_LOOP = "single_turn_agent"


def plays_episodes(config: Any) -> bool:
    """The rollout plays multi-turn episodes: SPO-chain or SPO-tree over turns, or verl's estimators on
    ``spo_episode``."""
    loop = config.actor_rollout_ref.rollout.agent.default_agent_loop
    spo = (config.get("algorithm") or {}).get("spo") or {}
    return (loop == EPISODE_AGENT_LOOP or (loop == "spo_chain" and (spo.get("chain") or {}).get("partition") == "turn")
            or (loop == "spo_tree" and (spo.get("tree") or {}).get("branch_at") == "turn"))


class PlainValidationBatches:
    """A validation dataloader whose batches name verl's single-turn loop (or, for multi-turn episodes,
    the episode loop) instead of SPO's loops.

    verl validates through the rollout's default agent loop unless a row names one (``agent_name``);
    an SPO loop there would sample a whole tree (or run Monte Carlo continuations) per validation
    answer. Everything else about the dataloader (length, state) is verl's."""

    def __init__(self, dataloader, agent_loop: str = VALIDATION_AGENT_LOOP):
        self._dataloader = dataloader
        self._agent_loop = agent_loop

    def __iter__(self):
        for batch in self._dataloader:
            rows = len(batch["raw_prompt"])
            named = batch.get("agent_name")
            names = [self._agent_loop if named is None or named[i] in SPO_AGENT_LOOPS else named[i] for i in range(rows)]
            batch["agent_name"] = np.array(names, dtype=object)
            yield batch

    def __len__(self):
        return len(self._dataloader)

    def __getattr__(self, name):
        return getattr(self._dataloader, name)


def plain_validation(trainer: Any) -> None:
    """Make ``trainer.val_dataloader`` sample plain responses when the rollout uses an SPO loop."""
    if trainer.config.actor_rollout_ref.rollout.agent.default_agent_loop in SPO_AGENT_LOOPS:
        loop = EPISODE_AGENT_LOOP if plays_episodes(trainer.config) else VALIDATION_AGENT_LOOP
        trainer.val_dataloader = PlainValidationBatches(trainer.val_dataloader, loop)


def uses_spo_metadata(config: Any) -> bool:
    return config.algorithm.adv_estimator in SPO_ESTIMATORS


def check_no_per_row_rollout_n(config: Any, dataset: Any) -> None:
    """verl's default trainer lets a dataset column ``__rollout_n__`` change the number of sessions of
    a prompt; the ``spo_tree`` loop needs exactly one session per leaf slot."""
    columns = getattr(getattr(dataset, "dataframe", None), "column_names", None) or []
    if config.actor_rollout_ref.rollout.agent.default_agent_loop == "spo_tree" and "__rollout_n__" in columns:
        raise ValueError(
            "the training data has a __rollout_n__ column, which changes the number of sessions per prompt; "
            "spo_tree needs actor_rollout_ref.rollout.n (the tree's leaf slots) for every prompt: drop the column"
        )


def install_spo_actor_loss(actor_worker_group: Any, config: Any) -> bool:
    """Put ``spo_ppo_loss`` (verl's ``ppo_loss`` plus the reference's masked KL) on the actor workers
    when the ``spo_prob_mask`` loss is selected. Returns whether it was installed."""
    if config.actor_rollout_ref.actor.policy_loss.get("loss_mode", "vanilla") != LOSS_NAME:
        return False
    if config.get("distillation", {}).get("enabled", False):
        return False  # verl's distillation loss wraps ppo_loss itself; keep verl's
    from verl.utils.config import omega_conf_to_dataclass

    actor_config = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    actor_worker_group.set_loss_fn(partial(spo_ppo_loss, config=actor_config))
    return True


def extra_field_values(extra_fields: Sequence[Any], field: str) -> list[Mapping | None]:
    rows = []
    for value in extra_fields:
        value = getattr(value, "data", value)  # TransferQueue hands back NonTensorData
        rows.append(value.get(field) if isinstance(value, Mapping) else None)
    return rows


def episodes_from_extra_fields(extra_fields: Sequence[Any]) -> list[EpisodeStatistics | None]:
    """Each row's multi-turn episode (None for a row that is none, or a copy that trains nothing)."""
    return [episode_from_extra_field(value) for value in extra_field_values(extra_fields, EPISODE_FIELD)]
