"""Segment values and advantages (docs/FIDELITY.md). Plain Python, the readable reference."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

STD_EPS = 1e-8
SEGMENT_WEIGHTS = ("segment", "paths", "sqrt_paths")


def check_segment_starts(num_tokens: int, segment_starts: Sequence[int]) -> None:
    previous = -1
    for start in segment_starts:
        if not previous < start < num_tokens:
            raise ValueError(
                f"segment_starts must be strictly increasing indices in [0, {num_tokens}), got {list(segment_starts)}"
            )
        previous = start


def chain_segment_advantages(boundary_values: Sequence[float], reward: float) -> list[float]:
    """``A_j = V_{j+1} - V_j`` with ``V_{last+1} = reward``."""
    values_after = list(boundary_values[1:]) + [reward]
    return [after - before for before, after in zip(boundary_values, values_after)]


def chain_token_advantages(
    num_tokens: int, segment_starts: Sequence[int], boundary_values: Sequence[float], reward: float
) -> list[float]:
    """Per-token advantages of one SPO-chain response, before the probability mask.

    ``boundary_values[j]`` is V of the prefix just before token ``segment_starts[j]``; every token of
    segment j carries ``A_j``; tokens before the first start (a head with no cutpoint) carry 0.
    """
    if len(segment_starts) != len(boundary_values):
        raise ValueError(
            f"need one boundary value per segment: {len(segment_starts)} starts, {len(boundary_values)} values"
        )
    check_segment_starts(num_tokens, segment_starts)
    advantages = [0.0] * num_tokens
    ends = list(segment_starts[1:]) + [num_tokens]
    for start, end, advantage in zip(segment_starts, ends, chain_segment_advantages(boundary_values, reward)):
        advantages[start:end] = [advantage] * (end - start)
    return advantages


def check_parents(parents: Sequence[int]) -> None:
    if not parents or parents[0] != -1:
        raise ValueError("parents[0] must be -1: node 0 is the root")
    for node, parent in enumerate(parents[1:], start=1):
        if not 0 <= parent < len(parents) or parent == node:
            raise ValueError(f"node {node} has invalid parent {parent}")
    for node in range(len(parents)):  # every chain of parents must reach the root
        seen, current = set(), node
        while current != 0:
            if current in seen:
                raise ValueError(f"parents contain a cycle through node {current}")
            seen.add(current)
            current = parents[current]


def children_lists(parents: Sequence[int]) -> list[list[int]]:
    children: list[list[int]] = [[] for _ in parents]
    for node, parent in enumerate(parents):
        if parent >= 0:
            children[parent].append(node)
    return children


def node_depths(parents: Sequence[int]) -> list[int]:
    depths = [0] * len(parents)
    for node in range(len(parents)):
        current = node
        while parents[current] >= 0:
            depths[node] += 1
            current = parents[current]
    return depths


def tree_values(parents: Sequence[int], leaf_rewards: Mapping[int, float]) -> list[float]:
    """V of every node: a leaf's reward; an internal node's value is the mean of its children's
    values (a mean of means, the paper)."""
    check_parents(parents)
    children = children_lists(parents)
    leaves = {node for node, kids in enumerate(children) if not kids}
    if set(leaf_rewards) != leaves:
        raise ValueError(f"leaf_rewards must give exactly the leaves {sorted(leaves)}, got {sorted(leaf_rewards)}")
    values = [0.0] * len(parents)
    depths = node_depths(parents)
    for node in sorted(range(len(parents)), key=lambda n: -depths[n]):  # children before parents
        kids = children[node]
        values[node] = float(leaf_rewards[node]) if not kids else sum(values[k] for k in kids) / len(kids)
    return values


def tree_node_advantages(parents: Sequence[int], values: Sequence[float], std_normalize: bool = False) -> list[float]:
    """``A(n) = V(n) - V(parent(n))``, 0 for the root; with ``std_normalize`` divided by the
    population std of n's siblings' values (n included) plus 1e-8."""
    check_parents(parents)
    if len(values) != len(parents):
        raise ValueError(f"need one value per node: {len(parents)} nodes, {len(values)} values")
    children = children_lists(parents)
    advantages = [0.0] * len(parents)
    for node, parent in enumerate(parents):
        if parent < 0:
            continue
        advantages[node] = values[node] - values[parent]
        if std_normalize:
            siblings = [values[k] for k in children[parent]]
            mean = sum(siblings) / len(siblings)
            std = math.sqrt(sum((v - mean) ** 2 for v in siblings) / len(siblings))
            advantages[node] /= std + STD_EPS
    return advantages


def leaf_path_counts(parents: Sequence[int]) -> list[int]:
    """How many root-to-leaf paths run through each node: its subtree's leaves (1 for a leaf)."""
    check_parents(parents)
    children = children_lists(parents)
    depths = node_depths(parents)
    counts = [0] * len(parents)
    for node in sorted(range(len(parents)), key=lambda n: -depths[n]):  # children before parents
        counts[node] = sum(counts[k] for k in children[node]) if children[node] else 1
    return counts


def check_segment_weight(segment_weight: str) -> None:
    if segment_weight not in SEGMENT_WEIGHTS:
        raise ValueError(f"segment_weight must be one of {list(SEGMENT_WEIGHTS)}, got {segment_weight!r}")


def segment_weights(parents: Sequence[int], segment_weight: str = "segment") -> list[float]:
    """How many times each node's segment counts in the loss (0 for the root, which has none):
    ``segment`` once (the paper's), ``paths`` once per leaf path through it (every leaf path trained
    whole), ``sqrt_paths`` the square root of that (TreeRL's reweighting)."""
    check_segment_weight(segment_weight)
    counts = leaf_path_counts(parents)
    weight = {"segment": lambda c: 1.0, "paths": float, "sqrt_paths": math.sqrt}[segment_weight]
    return [0.0 if parent < 0 else weight(count) for parent, count in zip(parents, counts)]
