"""verl adapters: the ``spo_chain`` and ``spo_tree`` advantage estimators.

Both take verl's estimator arguments and read the segment/tree metadata of each row from
``spo_verl.core.batch_context``, where the SPO trainer adapters put it (as ``spo_verl.core.metadata`` rows); the
maths is in ``spo_verl.core.algorithms``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from verl.trainer.ppo.core_algos import register_adv_est

from spo_verl.core.algorithms.batched import chain_token_advantages_batched
from spo_verl.core.algorithms.tree_rows import tree_token_advantages
from spo_verl.core.batch_context import (
    SPOBatchContext, TreeNodes, advantages_deferred, current_spo_context, is_padding_uid,
)
from spo_verl.core.config import SPOSettings, parse_spo_settings
from spo_verl.core.metadata import SPO_FIELD, ChainRow, SPOMetadataMissingError, TreeLeafRow, from_extra_field

__all__ = ["SPOMetadataMissingError", "compute_spo_chain_advantage", "compute_spo_tree_advantage"]


def _missing_metadata(estimator: str) -> SPOMetadataMissingError:
    return SPOMetadataMissingError(
        f"algorithm.adv_estimator={estimator} needs the per-response SPO metadata (extra_fields['{SPO_FIELD}']) "
        f"that the '{estimator}' agent loop produces and the SPO trainer hands to the estimator. Set "
        f"actor_rollout_ref.rollout.agent.default_agent_loop={estimator} and launch through the SPO recipe "
        f"(python -m recipe.spo.main_spo, or scripts/run_{estimator}.sh), which installs that trainer."
    )


def _padding_rows(index: Any, batch_size: int) -> np.ndarray:
    if index is None:
        return np.zeros(batch_size, dtype=bool)
    return np.array([is_padding_uid(uid) for uid in index], dtype=bool)


def _deferred_placeholder(token_level_rewards: torch.Tensor):
    """Zeros while the legacy trainer defers the SPO advantage step to its actor update
    (``batch_context.advantages_at_actor_update``); None when this call is the real one."""
    if current_spo_context() is None and advantages_deferred():
        zeros = torch.zeros_like(token_level_rewards)
        return zeros, zeros
    return None


def _rows_for(estimator: str, batch_size: int, index: Any) -> tuple[list, SPOBatchContext]:
    context = current_spo_context()
    if context is None:
        raise _missing_metadata(estimator)
    rows = context.rows
    if len(rows) != batch_size:
        raise ValueError(f"{estimator}: {len(rows)} metadata rows for a batch of {batch_size}")
    padding = _padding_rows(index, batch_size)
    # Skip verl's padding rows and the legacy trainer's stand-in copies of early-stopped leaves.
    rows = [None if pad else from_extra_field(row) for row, pad in zip(rows, padding)]
    rows = [None if row is None or (isinstance(row, TreeLeafRow) and not row.trains) else row for row in rows]
    expected = TreeLeafRow if estimator == "spo_tree" else ChainRow
    wrong = next((b for b, row in enumerate(rows) if row is not None and not isinstance(row, expected)), None)
    if wrong is not None:
        raise SPOMetadataMissingError(f"{estimator}: row {wrong} carries {type(rows[wrong]).__name__} metadata; "
                                      f"algorithm.adv_estimator and the agent loop must name the same algorithm")
    if batch_size and all(row is None for row in rows) and not padding.all():
        raise _missing_metadata(estimator)
    return rows, context


def _settings(config: Any, context: SPOBatchContext) -> SPOSettings:
    """The trainer's settings when it handed them over (parsed once per trainer), else ``config``'s."""
    if context.settings is not None:
        return context.settings
    return parse_spo_settings(config.get("spo") if config is not None else None)


def scores_zero(row: TreeLeafRow | ChainRow | None, settings: SPOSettings) -> bool:
    """Whether a row's trajectory reward R is 0 whatever the reward function said: a response cut by
    the length limit under ``algorithm.spo.truncated_response_score=zero`` (the rule the Monte Carlo
    continuations follow too); a row without the flag counts as finished."""
    return settings.truncated_response_score == "zero" and row is not None and row.truncated


def _trajectory_rewards(token_level_rewards: torch.Tensor, rows: Sequence[TreeLeafRow | ChainRow | None],
                        settings: SPOSettings) -> torch.Tensor:
    """R of each row: its summed token-level reward, or 0 where ``scores_zero``."""
    rewards = token_level_rewards.sum(dim=-1)
    if settings.truncated_response_score == "zero":
        truncated = torch.tensor([scores_zero(row, settings) for row in rows],
                                 dtype=torch.bool, device=rewards.device)
        rewards = torch.where(truncated, torch.zeros_like(rewards), rewards)
    return rewards


@register_adv_est("spo_chain")
def compute_spo_chain_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray | None = None,
    config: Any = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SPO-chain: ``A_j = V_{j+1} - V_j`` broadcast to the tokens of segment j.

    Row metadata: ``segment_starts`` (token offsets) and ``boundary_values`` (MC value of the prefix
    before each start). The reward R is the row's summed token-level reward (0 for a truncated response
    under ``algorithm.spo.truncated_response_score=zero``).

    Args:
        token_level_rewards: `(torch.Tensor)`
            shape is (bs, response_length)
        response_mask: `(torch.Tensor)`
            shape is (bs, response_length)
        index: `(np.ndarray)`
            each row's uid, shape (bs,); verl's padding rows (uid ``pad...``) get 0
        config: `(AlgoConfig)`
            ``algorithm``; its ``spo`` settings when the trainer did not hand them over

    Returns:
        advantages: `(torch.Tensor)`
            shape is (bs, response_length); 0 outside ``response_mask``
        returns: `(torch.Tensor)`
            shape is (bs, response_length); the same tensor as ``advantages``
    """
    if (placeholder := _deferred_placeholder(token_level_rewards)) is not None:
        return placeholder
    batch_size, length = response_mask.shape
    rows, context = _rows_for("spo_chain", batch_size, index)
    settings = _settings(config, context)
    starts_of, values_of = [], []
    for b, row in enumerate(rows):
        row_starts = list(row.segment_starts) if row is not None else []
        row_values = list(row.boundary_values) if row is not None else []
        if len(row_values) != len(row_starts):
            raise ValueError(f"spo_chain row {b}: {len(row_starts)} segment starts but {len(row_values)} values")
        starts_of.append(row_starts)
        values_of.append(row_values)
    # One tensor per field for the whole batch (padded), then the checks on tensors.
    counts = torch.tensor([len(row_starts) for row_starts in starts_of], dtype=torch.long)
    width = int(counts.max()) if batch_size else 0
    valid = torch.arange(width)[None, :] < counts[:, None]
    starts = torch.zeros(batch_size, width, dtype=torch.long)
    values = torch.zeros(batch_size, width, dtype=torch.float32)
    starts[valid] = torch.tensor([s for row_starts in starts_of for s in row_starts], dtype=torch.long)
    values[valid] = torch.tensor([v for row_values in values_of for v in row_values], dtype=torch.float32)
    # A segment may start anywhere up to the last trained token: in a multi-turn response the
    # environment's replies between the turns are in the response but out of the mask.
    positions = torch.arange(1, length + 1, device=response_mask.device) * (response_mask > 0)
    room = torch.cat([positions, torch.ones(batch_size, 1, device=positions.device)], dim=1).amax(dim=1).long().cpu()
    increasing = torch.ones_like(valid)
    if width > 1:
        increasing[:, 1:] = starts[:, 1:] > starts[:, :-1]
    bad = valid & ~(increasing & (starts >= 0) & (starts < room[:, None]))
    if bool(bad.any()):
        b = int(bad.any(dim=1).nonzero()[0])
        raise ValueError(f"spo_chain row {b}: segment starts {starts_of[b]} are not increasing offsets in the response")
    rewards = _trajectory_rewards(token_level_rewards, rows, settings)
    device = token_level_rewards.device
    advantages = chain_token_advantages_batched(
        starts.to(device), values.to(device), counts.to(device), rewards.float(), length
    )
    advantages = advantages.to(token_level_rewards.dtype) * response_mask
    return advantages, advantages


def _tree_advantage_metrics(result) -> dict[str, float]:
    metrics = {}
    depths, advantages = result.node_depths, result.node_advantages
    for depth in range(int(depths.max().item()) if depths.numel() else 0):  # leaves' values are rewards
        at_depth = result.node_values[depths == depth].double()
        if at_depth.numel():
            metrics[f"spo/tree/value_mean/depth{depth}"] = at_depth.mean().item()
    for depth in range(1, int(depths.max().item()) + 1 if depths.numel() else 1):
        at_depth = advantages[depths == depth].double()
        if at_depth.numel() == 0:
            continue
        metrics[f"spo/tree/advantage_mean/depth{depth}"] = at_depth.mean().item()
        metrics[f"spo/tree/advantage_abs_mean/depth{depth}"] = at_depth.abs().mean().item()
        metrics[f"spo/tree/advantage_std/depth{depth}"] = at_depth.std(unbiased=False).item()
        metrics[f"spo/tree/zero_advantage_fraction/depth{depth}"] = (at_depth == 0).double().mean().item()
    return metrics


def _check_one_tree_per_uid(index: np.ndarray | None, tree_ids: Sequence) -> None:
    """A prompt's leaves must come from one tree; two trees under one uid (e.g. a prompt's sessions
    split across agent-loop workers) would be mixed into one set of node values."""
    if index is None:
        return
    pairs = set(zip(index, tree_ids))
    uids = [uid for uid, tree_id in pairs if tree_id is not None]
    if len(set(uids)) == len(uids):
        return  # one tree (or none) per uid
    trees_of_uid: dict[Any, set] = {}
    for uid, tree_id in zip(index, tree_ids):
        if tree_id is not None:
            trees_of_uid.setdefault(uid, set()).add(tree_id)
    split = {uid: trees for uid, trees in trees_of_uid.items() if len(trees) > 1}
    if split:
        uid, trees = next(iter(split.items()))
        raise ValueError(
            f"spo_tree: the leaves of prompt uid={uid} come from {len(trees)} different trees; all rollout.n sessions "
            f"of a prompt must run in one agent-loop worker (legacy trainer: data.train_batch_size must be a multiple "
            f"of actor_rollout_ref.rollout.agent.num_workers)"
        )


def _as_list(path: Any) -> list:
    return path if type(path) is list else list(path)


def _tree_fields(rows: Sequence[TreeLeafRow | None], index: np.ndarray | None) -> tuple[list, list, list]:
    """Each row's tree id (its ``tree_id``, else its uid), path (as a list: the row's own list when it
    is one, not a copy) and segment ends; None for skipped rows."""
    tree_ids, paths, ends = [], [], []
    for b, row in enumerate(rows):
        if row is None:
            tree_ids.append(None), paths.append(None), ends.append(None)
            continue
        tree_id = row.tree_id if row.tree_id is not None else (index[b] if index is not None else None)
        if tree_id is None:
            raise ValueError(f"spo_tree row {b}: no tree_id in its metadata and no uid to group by")
        tree_ids.append(tree_id), paths.append(_as_list(row.path)), ends.append(row.segment_ends)
    return tree_ids, paths, ends


@register_adv_est("spo_tree")
def compute_spo_tree_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    index: np.ndarray | None = None,
    config: Any = None,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SPO-tree: leaf rewards -> node values (mean of children) -> ``V(n) - V(parent)``.

    Row metadata (one row per leaf): ``path`` (node ids from the root's child to the leaf) and
    ``segment_ends`` (response offset where each path node's segment ends); a leaf's reward is the row's
    summed token-level reward (0 for a truncated leaf under ``truncated_response_score=zero``); the tree is the row's
    ``tree_id`` if given, else its uid. Each segment is trained by one row only; the mask of trained
    tokens is left on the batch context for the trainer to apply to the loss.

    Args:
        token_level_rewards: `(torch.Tensor)`
            shape is (bs, response_length); bs counts every leaf of every tree
        response_mask: `(torch.Tensor)`
            shape is (bs, response_length)
        index: `(np.ndarray)`
            each row's uid, shape (bs,); a tree's leaves share their prompt's uid, verl's padding rows
            (uid ``pad...``) get 0
        config: `(AlgoConfig)`
            ``algorithm``; its ``spo`` settings when the trainer did not hand them over

    Returns:
        advantages: `(torch.Tensor)`
            shape is (bs, response_length); a segment's advantage on the tokens of the one row that
            trains it, 0 elsewhere
        returns: `(torch.Tensor)`
            shape is (bs, response_length); the same tensor as ``advantages``
    """
    if (placeholder := _deferred_placeholder(token_level_rewards)) is not None:
        return placeholder
    batch_size, _ = response_mask.shape
    rows, context = _rows_for("spo_tree", batch_size, index)
    settings = _settings(config, context)
    tree_ids, paths, ends = _tree_fields(rows, index)
    _check_one_tree_per_uid(index, tree_ids)
    result = tree_token_advantages(
        tree_ids,
        paths,
        ends,
        rewards=_trajectory_rewards(token_level_rewards, rows, settings),
        response_mask=response_mask,
        std_normalize=settings.tree.std_normalize,
        drop_zero_advantage=settings.tree.drop_zero_advantage,
        max_trained_segments_per_tree=settings.tree.max_trained_segments_per_prompt,
        zero_untrained=True,  # untrained tokens get 0 in the same pass
    )
    context.trained_mask = result.trained_mask
    context.metrics.update(_tree_advantage_metrics(result))
    context.tree_nodes = TreeNodes(tree_ids, paths, result.node_values, result.node_advantages)
    advantages = result.token_advantages
    return advantages, advantages
