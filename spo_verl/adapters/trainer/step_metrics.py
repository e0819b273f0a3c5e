"""The ``spo/*`` metrics of a training step: the trees' shape and cost, the chains' boundaries and Monte
Carlo cost, the multi-turn episodes, how much of the response the segment training keeps, and the
loss's own ``spo/*`` lifted out of verl's ``actor/`` prefix. verl's padding rows count nowhere."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from spo_verl.core.metadata import ChainRow, CutpointTreeStatistics, EpisodeStatistics, TreeLeafRow
from spo_verl.adapters.advantage_channel import SPOBatchContext

TREE_VALUE_PREFIX = "spo/tree/value_mean/depth"


def without_padding(items: Sequence[Any], padding: Sequence[bool]) -> list[Any]:
    """``items`` (one per batch row) with None for the rows ``padding`` marks: verl's v1 trainer pads a
    batch with copies of its first row, extra fields included, which must not count twice."""
    return [None if index < len(padding) and padding[index] else item for index, item in enumerate(items)]


def batch_metrics(context: SPOBatchContext, response_mask,
                  episodes: Sequence[EpisodeStatistics | None] = (), padding: Sequence[bool] = ()) -> dict[str, float]:
    """``spo/*`` metrics of one training batch: the estimator's own, tree shape and cost (one entry per
    tree), chain boundaries, MC cost and truncated continuations, how much of the response the segment
    training keeps, and (``episodes``, one per row, as ``episodes_from_extra_fields`` reads them) the
    ``spo/turns/*`` of multi-turn episodes. Rows that ``padding`` marks are left out."""
    metrics = dict(context.metrics)
    rows, episodes = without_padding(context.rows, padding), without_padding(episodes, padding)
    trees = {}
    for row in rows:
        if isinstance(row, TreeLeafRow) and row.tree is not None:
            trees.setdefault(row.tree_id, row.tree)
    if trees:
        metrics.update(tree_metrics(list(trees.values())))
    chains = [row for row in rows if isinstance(row, ChainRow) and row.chain is not None]
    if chains:
        metrics.update(chain_metrics(chains))
    metrics.update(turn_metrics(episodes, rows, metrics))
    if context.trained_mask is not None:
        response_tokens = float(response_mask.sum())
        metrics["spo/trained_tokens"] = float(context.trained_mask.sum())
        metrics["spo/trained_token_fraction"] = float(context.trained_mask.sum()) / max(response_tokens, 1.0)
    return metrics


def tree_metrics(stats: Sequence[Any]) -> dict[str, float]:
    """``spo/tree/*`` of the batch's trees (each tree's statistics once), cutpoint trees' forks among them."""
    metrics = {
        "spo/tree/trees": float(len(stats)),
        "spo/tree/nodes_per_tree": float(np.mean([s.nodes for s in stats])),
        "spo/tree/leaves_per_tree": float(np.mean([s.leaves for s in stats])),
    }
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
    return metrics


def chain_metrics(chains: Sequence[ChainRow]) -> dict[str, float]:
    """``spo/chain/*`` of the batch's chains (rows with their chain statistics)."""
    stats = [row.chain for row in chains]
    values = [v for row in chains for v in row.boundary_values]
    continuations = sum(s.mc_continuations for s in stats)
    metrics = {
        "spo/chain/boundaries_per_response": float(np.mean([s.boundaries for s in stats])),
        "spo/chain/mc_continuations": float(continuations),
        "spo/chain/mc_tokens": float(sum(s.mc_tokens for s in stats)),
    }
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
    return metrics


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
