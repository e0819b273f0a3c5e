"""Pack rows that share prefixes into one sequence of unique tokens.

verl trains every response as its own row: prompt + response. A prefix shared by ``k`` rows -- the
prompt of a GRPO group, the common segments of an SPO tree, a few-shot preamble common to every
prompt -- is therefore forwarded and back-propagated ``k`` times. Here the rows are folded back into
a forest: each shared run of tokens once, parents before children (depth-first, children in order of
first appearance in the rows). Each packed token keeps as position id its position on its own
root-to-token path, so with attention restricted to ancestors
(:mod:`spo_verl.core.packing.cascade_attention`) every packed token sees exactly the context it has in any
row that contains it, and its hidden state equals that row's hidden state.

:func:`pack_sequences` finds the shared prefixes in the tokens themselves (a radix trie over the rows),
so it needs no SPO metadata and serves every algorithm alike; verl's engine packs each micro-batch
with it (:mod:`spo_verl.core.packing.verl_rows`).

What a :class:`PackedTree` holds, besides the packed tokens and position ids:

* per node (roots are the depth-0 nodes, one per tree): its span in the packed sequence, parent,
  depth, tree and its root-to-node ancestor chain (:attr:`PackedTree.node_ancestors`);
* per packed token: the packed position of the token before it on its path
  (:attr:`PackedTree.previous_position`), which is where its log-prob is predicted from -- the last
  token of a node is followed by a different token in each child, so "next token" is not a property
  of a packed position, while "previous token" is;
* per row: the packed position of each of its (prompt + response) positions
  (:attr:`PackedTree.row_index`) and of each response token (:attr:`PackedTree.response_index`), so
  anything computed per packed token (log-probs, hidden states) is gathered back into the per-row
  layout exactly.

Rows without tokens own none; a row that is a prefix of another ends at a node that has
children. Pure Python + numpy + torch; no verl import.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["PackedTree", "pack_sequences"]


@dataclass(frozen=True)
class PackedTree:
    """One packed sequence of unique tokens for one tree or a forest (trees one after the other;
    a tree's nodes never attend to another tree's, so each tree is its own unit within it).

    Node ``k`` covers packed positions ``node_starts[k] : node_starts[k] + node_lengths[k]``. Row
    tensors are ``-1`` where the row has no token (padding rows, past the row's length)."""

    input_ids: torch.Tensor  # (N,) int64 unique tokens
    position_ids: torch.Tensor  # (N,) int64 position on the token's own root-to-token path
    previous_position: torch.Tensor  # (N,) int64 packed position of the previous token on the path (-1: none)
    node_of_token: torch.Tensor  # (N,) int64 node holding each packed token
    node_starts: torch.Tensor  # (K,) int64
    node_lengths: torch.Tensor  # (K,) int64, all >= 1
    node_parents: torch.Tensor  # (K,) int64, -1 for the prompts (roots)
    node_depths: torch.Tensor  # (K,) int64, prompts are depth 0
    node_tree: torch.Tensor  # (K,) int64 index of the node's tree (order of first appearance in the rows)
    node_ancestors: torch.Tensor  # (K, D + 1) int64 root .. node itself, then -1
    row_tree: torch.Tensor  # (B,) int64 tree index of each row, -1 for padding rows
    row_prompt_lengths: torch.Tensor  # (B,) int64, 0 for padding rows
    row_response_lengths: torch.Tensor  # (B,) int64, 0 for padding rows
    row_index: torch.Tensor  # (B, W) int64 packed position of row position t (prompt then response)
    response_index: torch.Tensor  # (B, T) int64 packed position of response token t
    tree_token_spans: torch.Tensor  # (num_trees, 2) int64 [start, stop) of each tree in the packed sequence

    @property
    def num_packed_tokens(self) -> int:
        return int(self.input_ids.numel())

    @property
    def num_row_tokens(self) -> int:
        """Tokens the per-leaf rows put through the model (prompt + response of every real row)."""
        return int((self.row_prompt_lengths + self.row_response_lengths).sum())

    @property
    def num_nodes(self) -> int:
        return int(self.node_starts.numel())

    @property
    def num_trees(self) -> int:
        return int(self.tree_token_spans.shape[0])

    @property
    def response_width(self) -> int:
        return int(self.response_index.shape[1])

    def node_path_lengths(self) -> torch.Tensor:
        """(K,) tokens on each node's root-to-node path, the node's own tokens included (its key length)."""
        return self.position_ids[self.node_starts] + self.node_lengths

    def ancestors(self, node: int) -> list[int]:
        """Node indices from the tree's prompt down to ``node`` (inclusive)."""
        chain = self.node_ancestors[node].tolist()
        return [a for a in chain if a >= 0]

    def gather_rows(
        self, packed_values: torch.Tensor, index: torch.Tensor | None = None, fill: float = 0.0
    ) -> torch.Tensor:
        """Per-row layout of per-packed-token values (first dim N): ``out[b, t] = packed_values[index[b, t]]``,
        ``fill`` where ``index`` is -1. ``index`` defaults to :attr:`response_index`. Differentiable."""
        index = self.response_index if index is None else index
        index = index.to(packed_values.device)
        filler = torch.full((1, *packed_values.shape[1:]), fill, dtype=packed_values.dtype, device=packed_values.device)
        table = torch.cat([filler, packed_values], 0)
        return table[index + 1]

    def to(self, device) -> "PackedTree":
        fields = {name: (value.to(device) if isinstance(value, torch.Tensor) else value)
                  for name, value in self.__dict__.items()}
        return PackedTree(**fields)


def _as_list(values) -> list[int]:
    if isinstance(values, torch.Tensor):
        return values.reshape(-1).tolist()
    return [int(v) for v in values]


def _radix_trie(rows: list[np.ndarray], lengths: list[int]):
    """The rows' radix trie: each node's parent (-1 for a tree's first node), tokens and tree, each node's
    children, each row's chain of nodes, and the number of trees (rows that share a first token)."""
    node_parent: list[int] = []
    node_tokens: list[list[int]] = []
    node_tree: list[int] = []
    children: list[list[int]] = []
    chains: list[list[int]] = [[] for _ in rows]
    trees = 0
    # (parent node, position where the members' paths part, member rows): members agree before it.
    work = [(-1, 0, [row for row, length in enumerate(lengths) if length > 0])]
    while work:
        parent, start, members = work.pop()
        groups: dict[int, list[int]] = {}
        for row in members:
            groups.setdefault(int(rows[row][start]), []).append(row)
        for group in groups.values():
            first = rows[group[0]]
            shared = min(lengths[row] for row in group) - start
            for row in group[1:]:
                differ = np.flatnonzero(first[start:start + shared] != rows[row][start:start + shared])
                if differ.size:
                    shared = int(differ[0])
            node = len(node_parent)
            node_parent.append(parent)
            node_tokens.append(first[start:start + shared].tolist())
            if parent < 0:
                node_tree.append(trees)
                trees += 1
            else:
                node_tree.append(node_tree[parent])
                children[parent].append(node)
            children.append([])
            for row in group:
                chains[row].append(node)
            going_on = [row for row in group if lengths[row] > start + shared]
            if going_on:
                work.append((node, start + shared, going_on))
    return node_parent, node_tokens, node_tree, children, chains, trees


def pack_sequences(
    sequences: Sequence[Sequence[int] | torch.Tensor],
    prompt_lengths: Sequence[int],
    response_width: int | None = None,
) -> PackedTree:
    """Pack rows given only as token sequences (prompt then response): every prefix that several rows
    share is one run of packed tokens (a radix trie over the rows), whatever made them share it -- an
    SPO tree's segments, the ``rollout.n`` responses of one prompt, a few-shot preamble common to all
    prompts, verl's identical padding rows. Exact for a causal LM: a token's hidden state depends only
    on the tokens before it and their positions, which are the same in every row holding that prefix.

    A "tree" here is a set of rows that share at least their first token; ``prompt_lengths[b]`` says
    where row ``b``'s response starts (for :attr:`PackedTree.response_index`). Rows of length 0 own
    no tokens."""
    if len(sequences) != len(prompt_lengths):
        raise ValueError("pack_sequences needs one prompt length per sequence")
    rows = [np.asarray(_as_list(sequence), dtype=np.int64) for sequence in sequences]
    lengths = [int(row.size) for row in rows]
    response_lengths = []
    for row, (length, prompt_length) in enumerate(zip(lengths, prompt_lengths)):
        if not 0 <= int(prompt_length) <= length:
            raise ValueError(f"row {row}: prompt length {prompt_length} outside its {length} tokens")
        response_lengths.append(length - int(prompt_length))

    node_parent, node_tokens, node_tree, children, chains, trees = _radix_trie(rows, lengths)
    return _assemble(node_parent, node_tokens, node_tree, children, chains, [int(p) for p in prompt_lengths],
                     response_lengths, response_width, trees)


def _assemble(
    node_parent: list[int],
    node_tokens: list[list[int]],
    node_tree: list[int],
    children: list[list[int]],
    chains: list[list[int]],
    prompt_lengths: list[int],
    response_lengths: list[int],
    response_width: int | None,
    num_trees: int,
) -> PackedTree:
    """The :class:`PackedTree` of a node graph: nodes (parent, tokens, tree, children in order), and
    per row its chain of nodes from its tree's root down (empty for a row that owns no token), whose
    tokens are exactly the row's prompt and response."""
    width = max(response_lengths, default=0) if response_width is None else int(response_width)
    if max(response_lengths, default=0) > width:
        raise ValueError(f"a row has {max(response_lengths)} response tokens, more than response_width={width}")
    order = _depth_first_order(node_parent, children)
    new_of = [0] * len(order)
    for new, old in enumerate(order):
        new_of[old] = new
    parents = [-1 if node_parent[old] < 0 else new_of[node_parent[old]] for old in order]
    tokens = [node_tokens[old] for old in order]
    trees = [node_tree[old] for old in order]
    layout = _NodeLayout.of(parents, [len(t) for t in tokens])
    long = dict(dtype=torch.long)
    node_parents = torch.tensor(parents, **long)
    node_depths = torch.tensor(layout.depths, **long)
    rows = [[new_of[node] for node in chain] for chain in chains]
    return PackedTree(
        # per packed token
        **_token_tables(tokens, layout, node_parents),
        # per node
        node_starts=torch.tensor(layout.starts, **long), node_lengths=torch.tensor(layout.lengths, **long),
        node_parents=node_parents, node_depths=node_depths, node_tree=torch.tensor(trees, **long),
        node_ancestors=_ancestor_table(node_parents, node_depths),
        # per row, per tree
        **_row_tables(rows, trees, layout, prompt_lengths, response_lengths, width),
        tree_token_spans=_tree_spans(parents, trees, layout, num_trees),
    )


def _depth_first_order(node_parent: list[int], children: list[list[int]]) -> list[int]:
    """Node ids in depth-first order: parents before children, each parent's children in order, tree
    after tree."""
    order: list[int] = []
    for root in [k for k in range(len(node_parent)) if node_parent[k] == -1]:
        stack = [root]
        while stack:
            node = stack.pop()
            order.append(node)
            stack.extend(reversed(children[node]))
    return order


@dataclass(frozen=True)
class _NodeLayout:
    """Where each node (in packed order) sits: its first packed token, its length, its depth, and the
    path position of its first token (its ancestors' tokens before it)."""

    starts: list[int]
    lengths: list[int]
    depths: list[int]
    offsets: list[int]

    @property
    def total(self) -> int:
        return self.starts[-1] + self.lengths[-1] if self.starts else 0

    @classmethod
    def of(cls, parents: list[int], lengths: list[int]) -> _NodeLayout:
        starts, depths, offsets = [], [], []
        cursor = 0
        for k, parent in enumerate(parents):
            starts.append(cursor)
            cursor += lengths[k]
            depths.append(0 if parent < 0 else depths[parent] + 1)
            offsets.append(0 if parent < 0 else offsets[parent] + lengths[parent])
        return cls(starts, lengths, depths, offsets)


def _token_tables(tokens: list[list[int]], layout: _NodeLayout, node_parents: torch.Tensor) -> dict[str, torch.Tensor]:
    """Per packed token: its id, its position on its path, the packed index of the token before it on
    its path (-1 for a root's first) and its node."""
    long = dict(dtype=torch.long)
    total = layout.total
    node_starts = torch.tensor(layout.starts, **long)
    node_lengths = torch.tensor(layout.lengths, **long)
    node_of_token = torch.repeat_interleave(torch.arange(len(tokens)), node_lengths, output_size=total)
    within = torch.arange(total) - node_starts[node_of_token]
    position_ids = torch.tensor(layout.offsets, **long)[node_of_token] + within
    # Previous token on the path: the one before in the same node, or the parent's last token.
    previous_position = torch.arange(total) - 1
    safe_parents = node_parents.clamp(min=0)
    parent_last = node_starts[safe_parents] + node_lengths[safe_parents] - 1
    previous_position[node_starts] = torch.where(node_parents >= 0, parent_last, torch.full_like(node_parents, -1))
    return dict(input_ids=torch.tensor([t for node in tokens for t in node], **long), position_ids=position_ids,
                previous_position=previous_position, node_of_token=node_of_token)


def _ancestor_table(node_parents: torch.Tensor, node_depths: torch.Tensor) -> torch.Tensor:
    """(nodes, max depth + 1): each node's ancestor at each depth, itself at its own, -1 below it."""
    num_nodes = node_parents.numel()
    max_depth = int(node_depths.max()) if num_nodes else 0
    ancestors = torch.full((num_nodes, max_depth + 1), -1, dtype=torch.long)
    current = torch.arange(num_nodes)
    level = node_depths.clone()
    for _ in range(max_depth + 1):
        alive = level >= 0
        ancestors[alive.nonzero().squeeze(1), level[alive]] = current[alive]
        current = torch.where(node_parents[current] >= 0, node_parents[current], current)
        level = level - 1
    return ancestors


def _tree_spans(parents: list[int], trees: list[int], layout: _NodeLayout, num_trees: int) -> torch.Tensor:
    """(trees, 2): each tree's first packed token and one past its last."""
    spans = torch.zeros(num_trees, 2, dtype=torch.long)
    for k, parent in enumerate(parents):
        if parent < 0:
            spans[trees[k], 0] = layout.starts[k]
        spans[trees[k], 1] = max(int(spans[trees[k], 1]), layout.starts[k] + layout.lengths[k])
    return spans


def _row_tables(rows: list[list[int]], trees: list[int], layout: _NodeLayout, prompt_lengths: list[int],
                response_lengths: list[int], width: int) -> dict[str, torch.Tensor]:
    """Per row (its chain of packed nodes; empty for a row that owns no token): its tree, lengths and the
    packed index of each of its tokens, and of each response token (-1 past its end)."""
    long = dict(dtype=torch.long)
    batch = len(rows)
    row_tree = torch.full((batch,), -1, **long)
    row_prompt_lengths = torch.zeros(batch, **long)
    row_response_lengths = torch.zeros(batch, **long)
    row_width = max((prompt_lengths[b] + response_lengths[b] for b in range(batch) if rows[b]), default=0)
    row_index = torch.full((batch, row_width), -1, **long)
    response_index = torch.full((batch, width), -1, **long)
    for row, chain in enumerate(rows):
        if not chain:
            continue
        row_tree[row] = trees[chain[0]]
        row_prompt_lengths[row] = prompt_lengths[row]
        row_response_lengths[row] = response_lengths[row]
        flat = torch.cat([torch.arange(layout.starts[k], layout.starts[k] + layout.lengths[k]) for k in chain])
        if flat.numel() != prompt_lengths[row] + response_lengths[row]:
            raise AssertionError(f"row {row}: its nodes hold {flat.numel()} tokens, the row has "
                                 f"{prompt_lengths[row] + response_lengths[row]}")
        row_index[row, : flat.numel()] = flat
        response_index[row, : response_lengths[row]] = flat[prompt_lengths[row]:]
    return dict(row_tree=row_tree, row_prompt_lengths=row_prompt_lengths, row_response_lengths=row_response_lengths,
                row_index=row_index, response_index=response_index)
