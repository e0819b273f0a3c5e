"""From per-leaf rows (what the tree rollout returns, one row per leaf) to token advantages.

Each row carries its tree's id, the node ids along its root-to-leaf path (the root itself is not
listed) and the end offset of each node's segment in the row's response. Rows of one tree share the
ids of shared prefix nodes. The rows are turned into one forest and evaluated with the batched
functions, so a whole training batch costs one pass per tree depth.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import torch

from spo_verl.algorithms.batched import node_depths_batched, tree_advantages_batched, tree_values_batched


@dataclass
class TreeBatchAdvantages:
    token_advantages: torch.Tensor  # (B, T) advantage of the segment each token belongs to, 0 elsewhere
    trained_mask: torch.Tensor  # (B, T) tokens whose segment this row trains (once per segment)
    node_values: torch.Tensor  # (N,) V of every node of the forest, roots included
    node_advantages: torch.Tensor  # (N,)
    node_depths: torch.Tensor  # (N,) roots are depth 0


@dataclass
class _Forest:
    parents: list[int]
    row_nodes: list[list[int]]  # global node index of each path node, per row (empty for skipped rows)


def _build_forest(tree_ids: Sequence[Hashable | None], paths: Sequence[Sequence[int] | None]) -> _Forest:
    index: dict[tuple, int] = {}
    parents: list[int] = []
    leaf_rows: dict[int, int] = {}
    row_nodes: list[list[int]] = []

    def node_index(key: tuple, parent: int) -> int:
        if key not in index:
            index[key] = len(parents)
            parents.append(parent)
        elif parents[index[key]] != parent:
            raise ValueError(f"tree {key[0]!r}: node {key[1]!r} appears under two different parents")
        return index[key]

    for row, (tree_id, path) in enumerate(zip(tree_ids, paths)):
        if tree_id is None:
            row_nodes.append([])
            continue
        if not path:
            raise ValueError(f"row {row} of tree {tree_id!r} has an empty path")
        current = node_index((tree_id, "root"), -1)
        nodes = []
        for node in path:
            current = node_index((tree_id, node), current)
            nodes.append(current)
        if current in leaf_rows:
            raise ValueError(f"tree {tree_id!r}: leaf {path[-1]!r} is returned by rows {leaf_rows[current]} and {row}")
        leaf_rows[current] = row
        row_nodes.append(nodes)
    has_children = {p for p in parents if p >= 0}
    for leaf, row in leaf_rows.items():
        if leaf in has_children:
            raise ValueError(f"row {row} ends at a node that has children in other rows")
    return _Forest(parents, row_nodes)


def _sample_per_tree(parents: torch.Tensor, eligible: torch.Tensor, budget: int, generator) -> torch.Tensor:
    """At most ``budget`` eligible nodes per tree, uniformly at random; one sort, no loop over trees."""
    tree_of = _tree_index(parents)
    scores = torch.rand(parents.numel(), generator=generator, device=parents.device)
    scores = torch.where(eligible, scores, torch.full_like(scores, 2.0))  # ineligible nodes sort last
    order = torch.argsort(tree_of.double() * 4 + scores)
    sorted_trees = tree_of[order]
    first_of_tree = torch.searchsorted(sorted_trees, sorted_trees)  # sorted_trees is ascending
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=parents.device) - first_of_tree
    return eligible & (rank < budget)


def _tree_index(parents: torch.Tensor) -> torch.Tensor:
    """Index of each node's root (the tree it belongs to), by pointer jumping."""
    root = torch.where(parents >= 0, parents, torch.arange(parents.numel(), device=parents.device))
    while True:
        jumped = root[root]
        if torch.equal(jumped, root):
            return root
        root = jumped


def tree_token_advantages(
    tree_ids: Sequence[Hashable | None],
    paths: Sequence[Sequence[int] | None],
    segment_ends: Sequence[Sequence[int] | None],
    rewards: torch.Tensor,
    response_mask: torch.Tensor,
    std_normalize: bool = False,
    drop_zero_advantage: bool = True,
    max_trained_segments_per_tree: int | None = None,
    generator: torch.Generator | None = None,
) -> TreeBatchAdvantages:
    """Token advantages for a batch of leaf rows (SPO.md 3b).

    Rows whose ``tree_id`` is None (e.g. verl's padding rows) get advantage 0 and train nothing.
    ``trained_mask`` gives each segment to exactly one row (the first that contains it), so a segment
    shared by many leaves is trained once, as in the reference; with ``drop_zero_advantage`` segments
    whose advantage is exactly 0 (e.g. all siblings equal) are not trained at all. With
    ``max_trained_segments_per_tree`` at most that many of a tree's trainable segments, drawn
    uniformly at random, are trained (the reference's per-prompt budget).
    """
    batch_size, length = response_mask.shape
    device = rewards.device
    forest = _build_forest(tree_ids, paths)
    parents = torch.tensor(forest.parents, dtype=torch.long, device=device)
    width = max((len(nodes) for nodes in forest.row_nodes), default=0)
    node_rows, end_rows, leaf_rows = [], [], []
    for row, nodes in enumerate(forest.row_nodes):
        if not nodes:
            node_rows.append([-1] * width)
            end_rows.append([length + 1] * width)
            continue
        ends = list(segment_ends[row])
        if len(ends) != len(nodes) or any(b <= a for a, b in zip([0] + ends, ends)) or ends[-1] > length:
            raise ValueError(
                f"row {row}: segment_ends must be {len(nodes)} increasing offsets ending at most at the response "
                f"length {length}, got {ends}"
            )
        padding = width - len(nodes)
        node_rows.append(nodes + [-1] * padding)
        end_rows.append(ends + [length + 1] * padding)
        leaf_rows.append((nodes[-1], row))
    node_table = torch.tensor(node_rows, dtype=torch.long, device=device).reshape(batch_size, width)
    end_table = torch.tensor(end_rows, dtype=torch.long, device=device).reshape(batch_size, width)
    leaf_rewards = torch.zeros(len(forest.parents), dtype=torch.float64, device=device)  # exact sibling centring
    if leaf_rows:
        leaves, rows_of_leaves = zip(*leaf_rows)
        leaf_rewards[list(leaves)] = rewards[list(rows_of_leaves)].double()

    values = tree_values_batched(parents, leaf_rewards)
    node_advantages = tree_advantages_batched(parents, values, std_normalize=std_normalize)

    rows = torch.arange(batch_size, device=device)[:, None].expand_as(node_table)
    present = node_table >= 0
    owner = torch.full((len(forest.parents),), batch_size, dtype=torch.long, device=device)
    owner.scatter_reduce_(0, node_table[present], rows[present], reduce="amin")
    trainable = torch.ones(len(forest.parents), dtype=torch.bool, device=device)
    trainable &= parents >= 0  # roots carry no segment
    if drop_zero_advantage:
        trainable &= node_advantages != 0
    if max_trained_segments_per_tree is not None:
        trainable &= _sample_per_tree(parents, trainable, max_trained_segments_per_tree, generator)

    # Per row, the response is a run of pieces: the path's segments in order, then the rest (after the
    # last segment end, or a row with no path), which has advantage 0 and trains nothing. A token's
    # piece is the number of segment ends at or before it: one scatter, one cumulative sum along the
    # row, then a gather of each piece's advantage and trained flag (values copied exactly).
    safe_node = node_table.clamp(min=0)
    piece_advantages = torch.zeros(batch_size, width + 1, dtype=rewards.dtype, device=device)
    piece_advantages[:, :width] = torch.where(present, node_advantages[safe_node], 0.0).to(rewards.dtype)
    piece_trained = torch.zeros(batch_size, width + 1, dtype=torch.bool, device=device)
    piece_trained[:, :width] = present & (owner[safe_node] == rows) & trainable[safe_node]
    token_advantages = torch.zeros(batch_size, length, dtype=rewards.dtype, device=device)
    trained = torch.zeros(batch_size, length, dtype=torch.bool, device=device)
    if width and length:
        marks = torch.zeros(batch_size, length, dtype=torch.long, device=device)
        marks.scatter_add_(1, end_table.clamp(max=length - 1), (present & (end_table < length)).long())
        piece = torch.cumsum(marks, dim=1, out=marks)
        in_response = response_mask.bool()
        token_advantages = torch.gather(piece_advantages, 1, piece).masked_fill_(~in_response, 0)
        trained = torch.gather(piece_trained, 1, piece) & in_response
    return TreeBatchAdvantages(
        token_advantages=token_advantages,
        trained_mask=trained,
        node_values=values,
        node_advantages=node_advantages,
        node_depths=node_depths_batched(parents),
    )
