"""verl adapters: the ``spo_chain`` and ``spo_tree`` advantage estimators.

Each registered estimator takes verl's estimator arguments, asks the advantage channel
(``spo_verl.adapters.advantage_channel``) for the batch's SPO rows (the segment/tree metadata of each
row, as ``spo_verl.core.metadata`` rows) and the run's settings, computes with the maths of
``spo_verl.core.algorithms`` and records on the channel what the trainer reads besides the advantages.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from verl.trainer.ppo.core_algos import register_adv_est

from spo_verl.core.algorithms.batched import chain_token_advantages_batched
from spo_verl.core.algorithms.tree_rows import tree_token_advantages
from spo_verl.core.config import SPOSettings
from spo_verl.core.metadata import ChainRow, SPOMetadataMissingError, TreeLeafRow
from spo_verl.adapters.advantage_channel import EstimatorResult, TreeNodes, estimator_call, record_result

__all__ = ["SPOMetadataMissingError", "compute_spo_chain_advantage", "compute_spo_tree_advantage"]


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
    call = estimator_call("spo_chain", ChainRow, response_mask.shape[0], index, config)
    if call is None:
        return _deferred(token_level_rewards)
    result = chain_estimate(call.rows, call.settings, token_level_rewards, response_mask)
    record_result(result)
    return result.advantages, result.advantages


def _deferred(token_level_rewards: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """verl's (advantages, returns) while the legacy trainer defers the step: zeros, replaced at its
    actor update."""
    zeros = torch.zeros_like(token_level_rewards)
    return zeros, zeros


def chain_estimate(rows: Sequence[ChainRow | None], settings: SPOSettings, token_level_rewards: torch.Tensor,
                   response_mask: torch.Tensor) -> EstimatorResult:
    """SPO-chain on the batch's rows: every response token's segment advantage (rows without metadata
    get 0)."""
    batch_size, length = response_mask.shape
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
    return EstimatorResult(advantages.to(token_level_rewards.dtype) * response_mask)


def _tree_advantage_metrics(result) -> dict[str, float]:
    metrics = {}
    trained = result.node_copies > 0
    if bool(trained.any()):  # 1 under segment_weight=segment; a shared segment trained in several rows raises it
        metrics["spo/tree/rows_per_trained_segment"] = result.node_copies[trained].double().mean().item()
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
    ``tree_id`` if given, else its uid. With ``algorithm.spo.tree.segment_weight=segment`` (the paper's)
    each segment is trained by one row only; with ``paths`` or ``sqrt_paths`` every row trains its whole
    path. The mask of trained tokens goes back through the advantage channel for the trainer to apply to
    the loss.

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
            shape is (bs, response_length); a segment's advantage (per copy, under ``sqrt_paths``) on the
            tokens of the rows that train it, 0 elsewhere
        returns: `(torch.Tensor)`
            shape is (bs, response_length); the same tensor as ``advantages``
    """
    call = estimator_call("spo_tree", TreeLeafRow, response_mask.shape[0], index, config)
    if call is None:
        return _deferred(token_level_rewards)
    result = tree_estimate(call.rows, call.settings, token_level_rewards, response_mask, index)
    record_result(result)
    return result.advantages, result.advantages


def tree_estimate(rows: Sequence[TreeLeafRow | None], settings: SPOSettings, token_level_rewards: torch.Tensor,
                  response_mask: torch.Tensor, index: np.ndarray | None) -> EstimatorResult:
    """SPO-tree on the batch's leaves: node values and advantages, each segment's advantage on the tokens
    of the rows that train it, the mask of those tokens, and the per-depth metrics."""
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
        segment_weight=settings.tree.segment_weight,
    )
    return EstimatorResult(result.token_advantages, trained_mask=result.trained_mask,
                           metrics=_tree_advantage_metrics(result),
                           tree_nodes=TreeNodes(tree_ids, paths, result.node_values, result.node_advantages))
