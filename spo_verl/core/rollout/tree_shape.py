"""The arithmetic of an SPO tree's shape: each depth's token budget and how many leaves a tree can have,
which the recipe needs for ``rollout.n`` before any tree is sampled and the samplers need to cut segments;
and the checks of a tree's shape against verl's ``actor_rollout_ref.rollout.n`` and ``response_length``,
run before Ray and again where an agent loop reads them, naming the keys to change.

No verl import: it reads the settings of ``spo_verl.core.config``.
"""

from __future__ import annotations

import math

from collections.abc import Mapping, Sequence

from spo_verl.core.config import NAMESPACE, CutpointTreeSettings, SPOConfigError, TreeSettings, parse_section


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


def check_cutpoint_tree_fits(cutpoint: CutpointTreeSettings, rollout_n: int) -> None:
    leaves = cutpoint_tree_max_leaves(cutpoint)
    if rollout_n < leaves:
        raise SPOConfigError(
            f"algorithm.spo.tree.branch_at=cutpoint with responses={cutpoint.responses}, max_forks={cutpoint.max_forks}, "
            f"width={cutpoint.width}, rounds={cutpoint.rounds} can sample up to {leaves} leaves a prompt, more than "
            f"actor_rollout_ref.rollout.n={rollout_n} sessions can return: set rollout.n to {leaves} or lower those settings"
        )


def check_tree_fits(branching, segment_budgets, response_length: int, rollout_n: int,
                    align_to_block: int | None = None) -> None:
    """Config-time checks of the tree shape against verl's rollout settings."""
    leaves = math.prod(branching)
    if rollout_n != leaves:
        raise SPOConfigError(
            f"actor_rollout_ref.rollout.n must equal the number of leaf slots of algorithm.spo.tree.branching "
            f"{list(branching)} ({leaves}), got {rollout_n}"
        )
    if sum(segment_budgets) >= response_length:
        raise SPOConfigError(
            f"algorithm.spo.tree.segment_tokens {list(segment_budgets)} use {sum(segment_budgets)} tokens before the "
            f"last depth, which leaves nothing of actor_rollout_ref.rollout.response_length={response_length}"
        )
    if align_to_block and segment_budgets:
        # The first depth grows by up to a block less one token; later depths by what rounds them to a block.
        longest = sum(segment_budgets) + align_to_block - 1 + sum(-b % align_to_block for b in segment_budgets[1:])
        if longest >= response_length:
            raise SPOConfigError(
                f"algorithm.spo.tree.segment_tokens {list(segment_budgets)} aligned to algorithm.spo.tree.align_to_block="
                f"{align_to_block} can use {longest} tokens before the last depth, which leaves nothing of "
                f"actor_rollout_ref.rollout.response_length={response_length}"
            )
