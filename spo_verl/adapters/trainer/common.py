"""What both verl trainers need from SPO: the actor loss to install, the batch's SPO rows (from the
rollout's extra fields) and their ``spo/*`` metrics, the parsed ``algorithm.spo`` settings, plain
validation answers when the rollout uses an SPO agent loop, and the refusal of per-prompt
``__rollout_n__`` under ``spo_tree``."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from functools import partial
from typing import Any

import numpy as np

from spo_verl.core.batch_context import SPOBatchContext
from spo_verl.core.config import SPOSettings, parse_spo_settings
from spo_verl.core.metadata import (EPISODE_FIELD, SPO_ALGORITHMS, ChainRow, CutpointTreeStatistics,
                                    EpisodeStatistics, TreeLeafRow, episode_from_extra_field)
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


def spo_settings_of(trainer: Any) -> SPOSettings:
    """The trainer's ``algorithm.spo``, parsed once (validated before Ray started; fixed for the run)."""
    settings = getattr(trainer, "_spo_settings", None)
    if settings is None:
        settings = trainer._spo_settings = parse_spo_settings(trainer.config.algorithm.get("spo"))
    return settings


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


def without_padding(items: Sequence[Any], padding: Sequence[bool]) -> list[Any]:
    """``items`` (one per batch row) with None for the rows ``padding`` marks: verl's v1 trainer pads a
    batch with copies of its first row, extra fields included, which must not count twice."""
    return [None if index < len(padding) and padding[index] else item for index, item in enumerate(items)]


def batch_metrics(context: SPOBatchContext, response_mask,
                  episodes: Sequence[EpisodeStatistics | None] = (), padding: Sequence[bool] = ()) -> dict[str, float]:
    """``spo/*`` metrics of one training batch: tree shape and cost (one entry per tree), chain
    boundaries, MC cost and truncated continuations, how much of the response the segment training
    keeps, and (``episodes``, one per row, as :func:`episodes_from_extra_fields` reads them) the
    ``spo/turns/*`` of multi-turn episodes. Rows that ``padding`` marks are left out."""
    metrics = dict(context.metrics)
    rows, episodes = without_padding(context.rows, padding), without_padding(episodes, padding)
    trees = {}
    for row in rows:
        if isinstance(row, TreeLeafRow) and row.tree is not None:
            trees.setdefault(row.tree_id, row.tree)
    if trees:
        stats = list(trees.values())
        metrics["spo/tree/trees"] = float(len(stats))
        metrics["spo/tree/nodes_per_tree"] = float(np.mean([s.nodes for s in stats]))
        metrics["spo/tree/leaves_per_tree"] = float(np.mean([s.leaves for s in stats]))
        early = np.array([s.early_stops_per_depth for s in stats], dtype=float)
        for depth, count in enumerate(early.mean(axis=0), start=1):
            metrics[f"spo/tree/early_stops_per_tree/depth{depth}"] = float(count)
        generated = sum(s.generated_tokens for s in stats)
        independent = sum(s.independent_sample_tokens for s in stats)
        metrics["spo/tree/generated_tokens"] = float(generated)
        metrics["spo/tree/independent_sample_tokens"] = float(independent)
        metrics["spo/tree/generated_over_independent"] = generated / max(independent, 1)
        # Every node is one segment, generated once.
        metrics["spo/tree/segment_tokens_mean"] = generated / max(sum(s.nodes for s in stats), 1)
        cutpoint_trees = [s for s in stats if isinstance(s, CutpointTreeStatistics)]
        if cutpoint_trees:
            paths = sum(s.paths for s in cutpoint_trees)
            positions = [p for s in cutpoint_trees for p in s.fork_positions]
            metrics["spo/tree/paths_per_tree"] = paths / len(cutpoint_trees)
            metrics["spo/tree/forks_per_response"] = sum(s.forks for s in cutpoint_trees) / max(paths, 1)
            metrics["spo/tree/no_fork_fraction"] = float(np.mean([s.forks == 0 for s in cutpoint_trees]))
            if positions:  # a fork's response offset over that response's length
                metrics["spo/tree/fork_position_mean"] = float(np.mean(positions))
            metrics["spo/tree/cutpoint_requests"] = float(sum(s.cutpoint_requests for s in cutpoint_trees))
    chains = [row for row in rows if isinstance(row, ChainRow) and row.chain is not None]
    if chains:
        stats = [row.chain for row in chains]
        values = [v for row in chains for v in row.boundary_values]
        metrics["spo/chain/boundaries_per_response"] = float(np.mean([s.boundaries for s in stats]))
        continuations = sum(s.mc_continuations for s in stats)
        metrics["spo/chain/mc_continuations"] = float(continuations)
        metrics["spo/chain/mc_tokens"] = float(sum(s.mc_tokens for s in stats))
        if continuations:
            # Continuations may use what the response left of rollout.response_length (docs/FIDELITY.md).
            metrics["spo/chain/mc_truncated_fraction"] = sum(s.mc_truncated for s in stats) / continuations
        metrics["spo/chain/cutpoint_requests"] = float(sum(s.cutpoint_requests for s in stats))
        metrics["spo/chain/no_cutpoint_fraction"] = float(np.mean([s.no_cutpoint for s in stats]))
        metrics["spo/chain/capped_responses"] = float(sum(s.capped for s in stats))
        if values:
            metrics["spo/chain/boundary_value_mean"] = float(np.mean(values))
            metrics["spo/chain/boundary_value_std"] = float(np.std(values))
            metrics["spo/chain/boundary_value_min"] = float(np.min(values))
            metrics["spo/chain/boundary_value_max"] = float(np.max(values))
    metrics.update(turn_metrics(episodes, rows, metrics))
    if context.trained_mask is not None:
        response_tokens = float(response_mask.sum())
        metrics["spo/trained_tokens"] = float(context.trained_mask.sum())
        metrics["spo/trained_token_fraction"] = float(context.trained_mask.sum()) / max(response_tokens, 1.0)
    return metrics


TREE_VALUE_PREFIX = "spo/tree/value_mean/depth"


def episodes_from_extra_fields(extra_fields: Sequence[Any]) -> list[EpisodeStatistics | None]:
    """Each row's multi-turn episode (None for a row that is none, or a copy that trains nothing)."""
    return [episode_from_extra_field(value) for value in extra_field_values(extra_fields, EPISODE_FIELD)]


def turn_metrics(episodes: Sequence[EpisodeStatistics | None], rows: Sequence[ChainRow | TreeLeafRow | None] = (),
                 step_metrics: Mapping[str, float] | None = None) -> dict[str, float]:
    """``spo/turns/*`` of the step's episodes, whichever algorithm played them: the model's turns an
    episode, the environment's tokens, how episodes ended, and the mean value of the dialogue at the
    start of each turn (turn 1: the prompt's): SPO-chain's boundary values, or for a tree over turns its
    nodes' values by depth (``step_metrics``' ``spo/tree/value_mean/depthD``: a node above the last depth
    ends after its turn, so the nodes at depth k - 1, the roots for k = 1, hold the values before turn k).
    ``rows``: the SPO metadata of the same rows, where there is any. A tree's leaves are its episodes."""
    played = [i for i, episode in enumerate(episodes) if episode is not None]
    if not played:
        return {}
    stats = [episodes[i] for i in played]
    metrics = {
        "spo/turns/turns_per_episode": float(np.mean([s.turns for s in stats])),
        "spo/turns/reply_tokens_per_episode": float(np.mean([s.reply_tokens for s in stats])),
        "spo/turns/ended_by_environment_fraction": float(np.mean([s.ended_by == "environment" for s in stats])),
        "spo/turns/environment_errors": float(sum(s.environment_error is not None for s in stats)),
    }
    spo_rows = [rows[i] for i in played if i < len(rows)]
    chains = [row for row in spo_rows if isinstance(row, ChainRow)]
    for turn in range(1, max((len(row.boundary_values) for row in chains), default=0) + 1):
        values = [row.boundary_values[turn - 1] for row in chains if len(row.boundary_values) >= turn]
        metrics[f"spo/turns/value_before_turn{turn}"] = float(np.mean(values))
    if any(isinstance(row, TreeLeafRow) for row in spo_rows):
        for key, value in (step_metrics or {}).items():
            if key.startswith(TREE_VALUE_PREFIX):
                metrics[f"spo/turns/value_before_turn{int(key.removeprefix(TREE_VALUE_PREFIX)) + 1}"] = value
    return metrics


def lift_spo_metrics(metrics: dict) -> None:
    """The loss's ``spo/*`` metrics out of verl's ``actor/`` prefix, beside the step's other ``spo/*``."""
    for key in [k for k in metrics if k.startswith("actor/spo/")]:
        metrics[key.removeprefix("actor/")] = metrics.pop(key)
