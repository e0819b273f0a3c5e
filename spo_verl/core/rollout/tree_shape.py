"""The arithmetic of an SPO tree's shape: each depth's token budget and how many leaves a tree can have,
which the recipe needs for ``rollout.n`` before any tree is sampled and the samplers need to cut segments.

No verl import: it reads the settings of ``spo_verl.core.config``.
"""

from __future__ import annotations

import math

from collections.abc import Mapping, Sequence

from spo_verl.core.config import NAMESPACE, CutpointTreeSettings, TreeSettings, parse_section


def tree_segment_budgets(tree: TreeSettings) -> tuple[int, ...]:
    """Token budget of every depth but the last, one entry per depth."""
    inner_depths = len(tree.branching) - 1
    if len(tree.segment_tokens) == 1:
        return tree.segment_tokens * inner_depths
    return tree.segment_tokens


def leaf_slots(tree: Sequence[int] | Mapping) -> int:
    """Number of leaf slots of an SPO tree, ``rollout.n`` of an SPO-tree run: ``prod(branching)`` of a
    fixed tree, :func:`cutpoint_tree_max_leaves` of a cutpoint tree. ``tree``: the ``algorithm.spo.tree``
    section, or a fixed tree's branching."""
    section = tree if isinstance(tree, Mapping) else {"branching": tree}
    settings = parse_section(TreeSettings, section, f"{NAMESPACE}.tree")
    if settings.branch_at == "cutpoint":
        return cutpoint_tree_max_leaves(settings.cutpoint)
    return math.prod(settings.branching)


def cutpoint_tree_max_leaves(cutpoint: CutpointTreeSettings) -> int:
    """The most leaves a cutpoint tree can have: every path forks ``max_forks`` times into ``width``
    new paths, for ``rounds`` rounds."""
    per_path = cutpoint.max_forks * cutpoint.width
    return cutpoint.responses * sum(per_path**r for r in range(cutpoint.rounds + 1))
