"""Checks of an SPO tree's shape against verl's rollout settings (``actor_rollout_ref.rollout.n`` and
``response_length``), at configuration time and again where an agent loop reads them: a tree that cannot
fit its sessions or its response length is refused, naming the verl keys to change, before a GPU is used.
"""

from __future__ import annotations

import math

from spo_verl.core.config import CutpointTreeSettings, SPOConfigError
from spo_verl.core.rollout.tree_shape import cutpoint_tree_max_leaves


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
