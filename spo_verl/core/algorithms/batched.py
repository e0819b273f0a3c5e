"""Tensor versions of the SPO maths for the hot path: whole batches of responses or forests of trees
at once, with Python loops over tree depth at most (never per token or per node).

The plain functions in ``segments`` and ``advantages`` are the reference these must agree with.
"""

from __future__ import annotations

import torch

from spo_verl.core.algorithms.advantages import STD_EPS


def chain_token_advantages_batched(
    segment_starts: torch.Tensor,
    boundary_values: torch.Tensor,
    num_segments: torch.Tensor,
    rewards: torch.Tensor,
    response_length: int,
) -> torch.Tensor:
    """(B, T) token advantages of a batch of chains before the probability mask.

    ``segment_starts``/``boundary_values`` are (B, S); only the first ``num_segments[b]`` entries of
    row b are read, and they must be increasing offsets below T (the estimator checks this). Head
    tokens before a row's first start, and rows with no segment, get 0.

    A token's segment is the number of starts at or before it (0 in the head): one scatter of the
    starts, one integer cumulative sum along the row, one gather of the segment advantages, so the
    values are copied exactly and nothing searches per token.
    """
    batch_size, width = segment_starts.shape
    device = boundary_values.device
    if width == 0 or batch_size == 0 or response_length == 0:
        return torch.zeros(batch_size, response_length, dtype=boundary_values.dtype, device=device)
    column = torch.arange(width, device=device)
    counts = num_segments.to(device)[:, None]
    valid = column < counts
    values = torch.where(valid, boundary_values, torch.zeros_like(boundary_values))
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], dim=-1)
    next_values = torch.where(column == counts - 1, rewards[:, None].to(values.dtype).expand_as(values), next_values)
    # Column 0 is the head (advantage 0); column j + 1 is segment j.
    pieces = torch.cat([values.new_zeros(batch_size, 1), torch.where(valid, next_values - values, 0.0)], dim=1)
    # Unused columns add 0.
    starts = segment_starts.to(device).clamp(0, response_length - 1)
    marks = torch.zeros(batch_size, response_length, dtype=torch.int64, device=device)
    marks.scatter_add_(1, starts, valid.long())
    return torch.gather(pieces, 1, torch.cumsum(marks, dim=1, out=marks))


def node_depths_batched(parents: torch.Tensor) -> torch.Tensor:
    """Depth of every node of a forest given as one parent array (roots have parent -1)."""
    depths = torch.zeros_like(parents)
    ancestor = parents.clone()
    for _ in range(parents.numel() + 1):
        has_ancestor = ancestor >= 0
        if not bool(has_ancestor.any()):
            return depths
        depths += has_ancestor.long()
        ancestor = torch.where(has_ancestor, parents[ancestor.clamp(min=0)], ancestor)
    raise ValueError("parents contain a cycle")


def tree_values_batched(parents: torch.Tensor, leaf_rewards: torch.Tensor) -> torch.Tensor:
    """Node values of a forest: leaves take ``leaf_rewards`` (entries of internal nodes are
    ignored), an internal node the mean of its children's values. One pass per depth level."""
    num_nodes = parents.numel()
    has_parent = parents >= 0
    child_count = torch.zeros(num_nodes, dtype=leaf_rewards.dtype, device=parents.device)
    child_count.index_add_(0, parents[has_parent], torch.ones_like(leaf_rewards[has_parent]))
    is_leaf = child_count == 0
    values = torch.where(is_leaf, leaf_rewards, torch.zeros_like(leaf_rewards))
    if num_nodes == 0:
        return values
    depths = node_depths_batched(parents)
    for depth in range(int(depths.max().item()), 0, -1):
        level = depths == depth
        sums = torch.zeros_like(values).index_add_(0, parents[level], values[level])
        parents_of_level = (depths == depth - 1) & ~is_leaf
        values = torch.where(parents_of_level, sums / child_count.clamp(min=1), values)
    return values


def tree_node_advantages_batched(parents: torch.Tensor, values: torch.Tensor,
                                 std_normalize: bool = False) -> torch.Tensor:
    """``V(n) - V(parent)`` for every node of a forest, 0 for roots; optionally divided by the population
    std of the siblings' values plus 1e-8."""
    has_parent = parents >= 0
    parent_index = parents.clamp(min=0)
    advantages = torch.where(has_parent, values - values[parent_index], torch.zeros_like(values))
    if not std_normalize or values.numel() == 0:
        return advantages
    counts = torch.zeros_like(values).index_add_(0, parents[has_parent], torch.ones_like(values[has_parent]))
    sums = torch.zeros_like(values).index_add_(0, parents[has_parent], values[has_parent])
    sibling_mean = sums / counts.clamp(min=1)
    deviation = torch.where(has_parent, values - sibling_mean[parent_index], torch.zeros_like(values))
    squares = torch.zeros_like(values).index_add_(0, parents[has_parent], deviation[has_parent] ** 2)
    sibling_std = torch.sqrt(squares / counts.clamp(min=1))
    return torch.where(has_parent, advantages / (sibling_std[parent_index] + STD_EPS), advantages)
