"""From per-leaf rows (what the tree rollout returns, one row per leaf) to token advantages.

Each row carries its tree's id, the node ids along its root-to-leaf path (the root itself is not
listed) and the end offset of each node's segment in the row's response. Rows of one tree share the
ids of shared prefix nodes. The rows are turned into one forest and evaluated with the batched
functions, so a whole training batch costs one pass per tree depth.

The forest and the per-row tables are built with a handful of numpy calls over the flattened paths
(no Python work per node); whatever that fast path cannot take (node ids that are not integers) or
finds invalid is handed to the plain per-row builder, which numbers the nodes the same way and
raises the errors with their messages.
"""

from __future__ import annotations

import itertools
import operator
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from spo_verl.core.algorithms.advantages import check_segment_weight
from spo_verl.core.algorithms.batched import node_depths_batched, tree_node_advantages_batched, tree_values_batched

# Tokens per chunk when the (B, T) outputs are written: the chunk's temporaries stay in cache (and
# below the allocator's mmap threshold) instead of costing a fresh (B, T) index tensor per call.
_CHUNK_TOKENS = 1 << 18


@dataclass
class TreeBatchAdvantages:
    token_advantages: torch.Tensor  # (B, T) advantage of the segment each token belongs to, 0 elsewhere
    trained_mask: torch.Tensor  # (B, T) tokens whose segment this row trains
    node_values: torch.Tensor  # (N,) V of every node of the forest, roots included
    node_advantages: torch.Tensor  # (N,)
    node_depths: torch.Tensor  # (N,) roots are depth 0
    node_weights: torch.Tensor  # (N,) float64 times each node's segment counts in the loss (0: root or untrained)
    node_copies: torch.Tensor  # (N,) rows whose loss trains each node's segment (0: root or untrained)


@dataclass
class Forest:
    """A batch's trees as one forest: a parent per node (-1 for a root), each row's path as node indices."""

    parents: list[int]
    row_nodes: list[list[int]]  # global node index of each path node, per row (empty for skipped rows)


@dataclass
class _ForestTables:
    parents: np.ndarray  # (N,) int64, -1 for roots
    nodes: np.ndarray  # (B, W) int64 global node index of each path node, -1 after the path and for skipped rows
    counts: np.ndarray  # (B,) int64 path length of each row, 0 for skipped rows


def build_forest(tree_ids: Sequence[Hashable | None], paths: Sequence[Sequence[int] | None]) -> Forest:
    """The batch's forest: nodes numbered in order of first appearance (each tree's root when the tree
    first appears, then the path nodes row by row), a parent per node and each row's path as node
    indices. Raises on an empty path, a node under two parents, a leaf returned twice, or a row that
    ends at a node with children."""
    tables = _forest_tables(tree_ids, paths)
    if tables is None:
        return build_forest_reference(tree_ids, paths)
    return Forest(tables.parents.tolist(),
                   [nodes[:count] for nodes, count in zip(tables.nodes.tolist(), tables.counts.tolist())])


def build_forest_reference(tree_ids: Sequence[Hashable | None], paths: Sequence[Sequence[int] | None]) -> Forest:
    """Plain per-row version of :func:`build_forest` (any hashable node ids); the source of its errors."""
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
    return Forest(parents, row_nodes)


def _as_int64(flat: np.ndarray, size: int) -> np.ndarray | None:
    """``flat`` as int64 if it is ``size`` integers (no bools, floats, nested or huge values), else None."""
    integer = flat.dtype.kind == "i" or (flat.dtype.kind == "u" and flat.itemsize < 8)
    if flat.ndim != 1 or flat.size != size or not integer:
        return None
    return flat.astype(np.int64, copy=False)


def _flatten_paths(tree_ids, paths, has_tree: list[bool], used: int) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """The rows with a tree as arrays: each row's tree code (trees numbered by first row), path length,
    and every path's node ids end to end (int64); None where a path is empty or not all integers."""
    try:
        used_tree_ids = list(itertools.compress(tree_ids, has_tree))
        codes = {tree_id: code for code, tree_id in enumerate(dict.fromkeys(used_tree_ids))}  # by first row
        tree_codes = np.fromiter(map(codes.__getitem__, used_tree_ids), dtype=np.int64, count=used)
        used_paths = list(itertools.compress(paths, has_tree))
        counts = np.fromiter(map(len, used_paths), dtype=np.int64, count=used)
        flat = np.array(list(itertools.chain.from_iterable(used_paths)))
    except (TypeError, ValueError, OverflowError):
        return None
    flat = _as_int64(flat, int(counts.sum()))
    if flat is None or int(counts.min()) == 0:
        return None
    return tree_codes, counts, flat


def _forest_tables(tree_ids: Sequence[Hashable | None], paths: Sequence[Sequence[int] | None]) -> _ForestTables | None:
    """:func:`build_forest` as arrays, from the flattened paths; None when the paths are not all
    non-empty sequences of integers or the forest is invalid (the reference builder then decides).

    Every row is the run ``root, path...``; a node's key is (tree, id) packed into one integer, its
    index the rank of its key's first occurrence in that sequence (the reference's numbering), its
    parent the entry before its first occurrence, and every other occurrence must agree."""
    batch = len(tree_ids)
    if len(paths) != batch:
        return None
    # C-level loops over the rows (map, compress, chain): no Python bytecode per row.
    has_tree = list(map(operator.is_not, tree_ids, itertools.repeat(None)))
    used = np.flatnonzero(np.array(has_tree, dtype=bool))
    if not used.size:
        return _ForestTables(np.zeros(0, dtype=np.int64), np.zeros((batch, 0), dtype=np.int64),
                             np.zeros(batch, dtype=np.int64))
    flattened = _flatten_paths(tree_ids, paths, has_tree, used.size)
    if flattened is None:
        return None
    tree_codes, counts, flat = flattened
    low, high = int(flat.min()), int(flat.max())
    span = high - low + 2  # key tree * span + 0 is the tree's root, tree * span + id - low + 1 its node id
    if (int(tree_codes.max()) + 1) * span >= 1 << 62:
        return None
    runs = counts + 1
    total = int(runs.sum())
    starts = np.cumsum(runs) - runs  # where each row's run (its root) begins
    is_path = np.ones(total, dtype=bool)
    is_path[starts] = False
    keys = np.empty(total, dtype=np.int64)
    keys[starts] = tree_codes * span
    keys[is_path] = np.repeat(tree_codes * span, counts) + (flat - low + 1)
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    rank = np.empty(first.size, dtype=np.int64)
    rank[np.argsort(first, kind="stable")] = np.arange(first.size, dtype=np.int64)
    node = rank[inverse.reshape(-1)]
    previous = np.empty(total, dtype=np.int64)
    previous[1:] = node[:-1]
    previous[starts] = -1
    parents = np.empty(first.size, dtype=np.int64)
    parents[rank] = previous[first]
    if not np.array_equal(parents[node], previous):
        return None  # a node under two parents
    leaves = node[starts + counts]
    if np.unique(leaves).size != leaves.size:
        return None  # a leaf returned by two rows
    has_children = np.zeros(first.size, dtype=bool)
    has_children[parents[parents >= 0]] = True
    if has_children[leaves].any():
        return None  # a row ends at an inner node
    width = int(counts.max())
    nodes = np.full((batch, width), -1, dtype=np.int64)
    path_starts = np.cumsum(counts) - counts
    columns = np.arange(total - used.size, dtype=np.int64) - np.repeat(path_starts, counts)
    nodes[np.repeat(used, counts), columns] = node[is_path]
    row_counts = np.zeros(batch, dtype=np.int64)
    row_counts[used] = counts
    return _ForestTables(parents, nodes, row_counts)


def _tables_from_forest(forest: Forest, batch: int) -> _ForestTables:
    counts = [len(nodes) for nodes in forest.row_nodes]
    width = max(counts, default=0)
    nodes = np.full((batch, width), -1, dtype=np.int64)
    for row, row_nodes in enumerate(forest.row_nodes):
        nodes[row, : len(row_nodes)] = row_nodes
    return _ForestTables(np.array(forest.parents, dtype=np.int64), nodes, np.array(counts, dtype=np.int64))


def _segment_end_table(tables: _ForestTables, segment_ends: Sequence[Sequence[int] | None], length: int) -> np.ndarray:
    """(B, W) int64 end offset of each path node's segment, ``length`` after the path (and for skipped
    rows). Rows must give as many increasing positive offsets as they have path nodes, the last at most
    ``length``."""
    batch, width = tables.nodes.shape
    used = np.flatnonzero(tables.counts)
    counts = tables.counts[used]
    try:
        used_ends = list(itertools.compress(segment_ends, tables.counts.astype(bool).tolist()))
        end_counts = np.fromiter(map(len, used_ends), dtype=np.int64, count=len(used_ends))
        flat = np.array(list(itertools.chain.from_iterable(used_ends)))
    except (TypeError, ValueError, OverflowError):
        flat = None
    flat = _as_int64(flat, int(counts.sum())) if flat is not None and np.array_equal(end_counts, counts) else None
    if flat is not None:
        path_starts = np.cumsum(counts) - counts
        previous = np.empty_like(flat)
        previous[1:] = flat[:-1]
        previous[path_starts] = 0
        if bool((flat > previous).all()) and (flat.size == 0 or int(flat.max()) <= length):
            table = np.full((batch, width), length, dtype=np.int64)
            columns = np.arange(flat.size, dtype=np.int64) - np.repeat(path_starts, counts)
            table[np.repeat(used, counts), columns] = flat
            return table
    # Something to report (or offsets that are not plain integers): the row by row checks.
    table = np.full((batch, width), length, dtype=np.int64)
    for row, count in zip(used.tolist(), counts.tolist()):
        ends = list(segment_ends[row])
        if len(ends) != count or any(b <= a for a, b in zip([0] + ends, ends)) or ends[-1] > length:
            raise ValueError(
                f"row {row}: segment_ends must be {count} increasing offsets ending at most at the response "
                f"length {length}, got {ends}"
            )
        table[row, :count] = torch.tensor(ends, dtype=torch.long).numpy()
    return table


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


_SAME_SIZE_INTEGER = {2: torch.int16, 4: torch.int32, 8: torch.int64}


def _zero_outside_(values: torch.Tensor, keep: torch.Tensor) -> None:
    """``values.masked_fill_(~keep, 0)``, done as an integer multiply of the bits (exact: a kept
    value's bits times 1, +0.0 elsewhere), which vectorises where masked_fill_ does not."""
    integer = _SAME_SIZE_INTEGER.get(values.element_size())
    if values.is_floating_point() and integer is not None:
        values.view(integer).mul_(keep)
    else:
        values.masked_fill_(~keep, 0)


def _leaf_rewards(tables: _ForestTables, rewards: torch.Tensor) -> torch.Tensor:
    """Each node's reward in float64 (exact sibling centring): its row's where it is a leaf, else 0."""
    leaf_rewards = torch.zeros(tables.parents.size, dtype=torch.float64, device=rewards.device)
    used = np.flatnonzero(tables.counts)
    if used.size:
        leaves = tables.nodes[used, tables.counts[used] - 1]
        leaf_rewards[torch.from_numpy(leaves).to(rewards.device)] = rewards[torch.from_numpy(used).to(rewards.device)].double()
    return leaf_rewards


def _first_row_of_each_node(node_table: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """(num_nodes,) the first row whose path holds each node, the row that trains it (B where none does)."""
    batch_size = node_table.shape[0]
    rows = torch.arange(batch_size, device=node_table.device)[:, None].expand_as(node_table)
    present = node_table >= 0
    owner = torch.full((num_nodes,), batch_size, dtype=torch.long, device=node_table.device)
    owner.scatter_reduce_(0, node_table[present], rows[present], reduce="amin")
    return owner


def _rows_through_each_node(node_table: torch.Tensor, num_nodes: int) -> torch.Tensor:
    """(num_nodes,) how many rows' paths hold each node: the leaf paths through it (0 for roots, which
    no path lists)."""
    present = node_table >= 0
    counts = torch.zeros(num_nodes, dtype=torch.long, device=node_table.device)
    counts.scatter_add_(0, node_table[present], torch.ones_like(node_table[present]))
    return counts


def _spread_over_tokens(piece_advantages: torch.Tensor, piece_trained: torch.Tensor, end_table: torch.Tensor,
                        response_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's pieces (B, W + 1; the last the rest after its path) repeated over their tokens, ending at
    ``end_table``'s offsets, values copied exactly, a chunk of rows at a time; tokens outside
    ``response_mask`` cleared. Returns the token advantages and the trained mask."""
    batch_size, length = response_mask.shape
    device, dtype = piece_advantages.device, piece_advantages.dtype
    if not (end_table.shape[1] and length and batch_size):
        return (torch.zeros(batch_size, length, dtype=dtype, device=device),
                torch.zeros(batch_size, length, dtype=torch.bool, device=device))
    token_advantages = torch.empty(batch_size, length, dtype=dtype, device=device)
    trained = torch.empty(batch_size, length, dtype=torch.bool, device=device)
    bounds = torch.cat([end_table.new_zeros(batch_size, 1), end_table, end_table.new_full((batch_size, 1), length)], dim=1)
    piece_lengths = torch.diff(bounds, dim=1).int()  # (B, W + 1), each row sums to the length
    step = max(1, _CHUNK_TOKENS // length)
    for start in range(0, batch_size, step):
        stop = min(batch_size, start + step)
        take = torch.repeat_interleave(piece_lengths[start:stop].reshape(-1), output_size=(stop - start) * length)
        chunk_advantages, chunk_trained = token_advantages[start:stop], trained[start:stop]
        torch.index_select(piece_advantages[start:stop].reshape(-1), 0, take, out=chunk_advantages.view(-1))
        torch.index_select(piece_trained[start:stop].reshape(-1), 0, take, out=chunk_trained.view(-1))
        in_response = response_mask[start:stop].bool()
        chunk_trained.logical_and_(in_response)
        _zero_outside_(chunk_advantages, in_response)
    return token_advantages, trained


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
    zero_untrained: bool = False,
    segment_weight: str = "segment",
) -> TreeBatchAdvantages:
    """Token advantages for a batch of leaf rows.

    Rows whose ``tree_id`` is None (e.g. verl's padding rows) get advantage 0 and train nothing.
    ``segment_weight`` (:func:`spo_verl.core.algorithms.advantages.segment_weights`) says how often a
    segment counts in the loss. ``segment``: ``trained_mask`` gives each segment to exactly one row (the
    first that contains it), so a segment shared by many leaves is trained once, as in the reference.
    ``paths`` and ``sqrt_paths``: every row trains its whole path, so a segment counts once per leaf path
    through it, as if each leaf were an independent response; ``sqrt_paths`` divides each copy's
    advantage by the square root of the paths, so the segment counts ``sqrt(paths)`` times in all.
    With ``drop_zero_advantage`` segments whose advantage is exactly 0 (e.g. all siblings equal) are not
    trained at all. With ``max_trained_segments_per_tree`` at most that many of a tree's trainable
    segments, drawn uniformly at random, are trained (the reference's per-prompt budget). With
    ``zero_untrained`` the token advantages are also 0 outside ``trained_mask`` (what the estimator
    hands to the loss).
    """
    check_segment_weight(segment_weight)
    batch_size, length = response_mask.shape
    device = rewards.device
    tables = _forest_tables(tree_ids, paths)
    if tables is None:
        tables = _tables_from_forest(build_forest_reference(tree_ids, paths), batch_size)
    end_table = torch.from_numpy(_segment_end_table(tables, segment_ends, length)).to(device)
    parents = torch.from_numpy(tables.parents).to(device)
    node_table = torch.from_numpy(tables.nodes).to(device)
    values = tree_values_batched(parents, _leaf_rewards(tables, rewards))
    node_advantages = tree_node_advantages_batched(parents, values, std_normalize=std_normalize)

    trainable = parents >= 0  # roots carry no segment
    if drop_zero_advantage:
        trainable &= node_advantages != 0
    if max_trained_segments_per_tree is not None:
        trainable &= _sample_per_tree(parents, trainable, max_trained_segments_per_tree, generator)

    # Per row, the response is a run of pieces: the path's segments in order, then the rest (after the
    # last segment end, or a row with no path), which has advantage 0 and trains nothing.
    width = tables.nodes.shape[1]
    present = node_table >= 0
    safe_node = node_table.clamp(min=0)
    paths_through = _rows_through_each_node(node_table, parents.numel()).double()
    piece_trained = torch.zeros(batch_size, width + 1, dtype=torch.bool, device=device)
    piece_trained[:, :width] = present & trainable[safe_node]
    if segment_weight == "segment":
        owner = _first_row_of_each_node(node_table, parents.numel())
        rows = torch.arange(batch_size, device=device)[:, None]
        piece_trained[:, :width] &= owner[safe_node] == rows
        copy_advantages, node_weights = node_advantages, trainable.double()
    elif segment_weight == "paths":
        copy_advantages, node_weights = node_advantages, torch.where(trainable, paths_through, 0.0)
    else:  # sqrt_paths: each of a segment's copies carries 1 / sqrt(paths) of its advantage
        scale = torch.where(paths_through > 0, paths_through.clamp(min=1).rsqrt(), 0.0)
        copy_advantages = node_advantages * scale
        node_weights = torch.where(trainable, paths_through.sqrt(), 0.0)
    piece_advantages = torch.zeros(batch_size, width + 1, dtype=rewards.dtype, device=device)
    piece_advantages[:, :width] = torch.where(
        piece_trained[:, :width] if zero_untrained else present, copy_advantages[safe_node], 0.0
    ).to(rewards.dtype)
    token_advantages, trained = _spread_over_tokens(piece_advantages, piece_trained, end_table, response_mask)
    node_copies = torch.zeros(parents.numel(), dtype=torch.long, device=device)
    node_copies.scatter_add_(0, safe_node[piece_trained[:, :width]], torch.ones_like(safe_node[piece_trained[:, :width]]))
    return TreeBatchAdvantages(
        token_advantages=token_advantages,
        trained_mask=trained,
        node_values=values,
        node_advantages=node_advantages,
        node_depths=node_depths_batched(parents),
        node_weights=node_weights,
        node_copies=node_copies,
    )
