"""Leaf slots: every leaf of a sampled tree is returned by exactly one verl session."""

import math

import pytest

from spo_verl.core.rollout.tree import ROOT, SampledTree, TreeNode


def build_tree(branching, stop_at):
    """A tree of the given shape where the nodes in ``stop_at`` (as child-index paths) stop early."""
    tree = SampledTree(prompt_ids=[1], branching=tuple(branching), nodes=[TreeNode(ROOT, -1, 0)])
    frontier = [(ROOT, ())]
    for depth, width in enumerate(branching):
        next_frontier = []
        for parent, digits in frontier:
            for k in range(width):
                node = TreeNode(len(tree.nodes), parent, depth + 1, [depth, k], [-0.5, -0.5])
                tree.nodes.append(node)
                tree.nodes[parent].children.append(node.node_id)
                if digits + (k,) not in stop_at and depth + 1 < len(branching):
                    next_frontier.append((node.node_id, digits + (k,)))
        frontier = next_frontier
    return tree


@pytest.mark.parametrize(
    ("branching", "stop_at"),
    [((2, 2, 2), set()), ((3, 2), {(1,)}), ((2, 3, 2), {(0,), (1, 2)}), ((4,), set()), ((2, 2), {(0,), (1,)})],
)
def test_each_leaf_is_returned_by_exactly_one_slot(branching, stop_at):
    tree = build_tree(branching, stop_at)
    returned = [tree.slot_leaf(slot) for slot in range(math.prod(branching))]
    leaves = [leaf for leaf, first in returned if first]
    assert sorted(leaves) == sorted(tree.leaves())
    assert len(set(leaves)) == len(leaves)


def test_paths_prefixes_and_segment_ends():
    tree = build_tree((2, 2), set())
    leaf, first = tree.slot_leaf(3)
    assert first
    assert tree.path(leaf) == [2, 6]
    assert tree.prefix(leaf) == ([0, 1, 1, 1], [-0.5] * 4)
    assert tree.segment_ends(leaf) == [2, 4]
    with pytest.raises(ValueError, match="outside"):
        tree.slot_leaf(4)
