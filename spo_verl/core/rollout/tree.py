"""Sampling one SPO tree per prompt through verl's ``generate`` interface.

``generate(request_id, *, prompt_ids, sampling_params) -> TokenOutput`` is verl's server-manager
call: token ids in, token ids and log-probs out. A child segment continues its parent's prefix by
token ids (never re-tokenised text); every call of a tree uses the tree's request id so the subtree
stays on one server and its prefix cache; each child's subtree starts when that child's segment ends.
"""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from spo_verl.core.algorithms.segments import cut_by_length_limit
from spo_verl.core.rollout.server_output import generate_segment

Generate = Callable[..., Awaitable[Any]]
ROOT = 0


@dataclass
class TreeNode:
    node_id: int
    parent: int
    depth: int  # the root is depth 0; its children hold the first segment
    token_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    children: list[int] = field(default_factory=list)
    stopped: bool = False  # ended with EOS or at the response-length limit
    server_fields: dict = field(default_factory=dict)  # TokenOutput.extra_fields (weight versions)

    def token_mask(self) -> list[int]:
        """Which of the node's tokens the model generated (1): all of them in a tree of segments."""
        return [1] * len(self.token_ids)


@dataclass
class SampledTree:
    prompt_ids: list[int]
    branching: tuple[int, ...]
    nodes: list[TreeNode]
    tree_id: str = ""

    def add_child(self, parent: int, node_type: type[TreeNode] = TreeNode, **fields: Any) -> TreeNode:
        """A new node under ``parent``, numbered in the order nodes are added (the order verl's session
        slots count a parent's children in); ``fields``: the node's own, beyond its place in the tree."""
        node = node_type(len(self.nodes), parent, self.nodes[parent].depth + 1, **fields)
        self.nodes.append(node)
        self.nodes[parent].children.append(node.node_id)
        return node

    def path(self, node_id: int) -> list[int]:
        """Node ids from the root's child down to ``node_id``."""
        path = []
        while node_id != ROOT:
            path.append(node_id)
            node_id = self.nodes[node_id].parent
        return path[::-1]

    def prefix(self, node_id: int) -> tuple[list[int], list[float]]:
        token_ids, log_probs = [], []
        for step in self.path(node_id):
            token_ids += self.nodes[step].token_ids
            log_probs += self.nodes[step].log_probs
        return token_ids, log_probs

    def response_mask(self, node_id: int) -> list[int]:
        return [m for step in self.path(node_id) for m in self.nodes[step].token_mask()]

    def server_fields(self, node_id: int) -> list[dict]:
        return [self.nodes[step].server_fields for step in self.path(node_id)]

    def segment_ends(self, node_id: int) -> list[int]:
        ends, position = [], 0
        for step in self.path(node_id):
            position += len(self.nodes[step].token_ids)
            ends.append(position)
        return ends

    def leaves(self) -> list[int]:
        return [node.node_id for node in self.nodes if node.node_id != ROOT and not node.children]

    def slot_leaf(self, slot: int) -> tuple[int, bool]:
        """The leaf that verl session ``slot`` (0 .. prod(branching) - 1) lands on, and whether the
        slot is the first of those landing there.

        Slot digits in base ``branching`` pick a child per depth. A leaf above the last depth (an
        early stop) covers all slots below it; only the first of them should return it, so that no
        leaf is lost or returned twice.
        """
        if not 0 <= slot < math.prod(self.branching):
            raise ValueError(f"slot {slot} is outside 0..{math.prod(self.branching) - 1}")
        node = ROOT
        for depth, width in enumerate(self.branching):
            below = math.prod(self.branching[depth + 1 :])
            node = self.nodes[node].children[(slot // below) % width]
            if not self.nodes[node].children:
                return node, slot % below == 0
        return node, True


def _is_stop(token_ids: Sequence[int], max_tokens: int, eos_token_ids: Collection[int]) -> bool:
    """A segment that ended before its budget (an EOS, or the server's own stop): its node gets no children."""
    return bool(token_ids) and not cut_by_length_limit(token_ids, max_tokens, eos_token_ids)


def block_aligned_budget(prefix_length: int, budget: int, block: int) -> int:
    """The smallest budget of at least ``budget`` tokens after which a prefix of ``prefix_length``
    tokens ends one token past a KV-cache block boundary. vLLM serves only whole blocks from its prefix
    cache and always recomputes a prompt's last token, so a child whose prompt is that prefix
    recomputes exactly one token."""
    return budget + (1 - prefix_length - budget) % block


def aligned_budgets(prompt_length: int, budgets: Sequence[int], block: int | None) -> tuple[int, ...]:
    """The budget of every depth but the last for a prompt of ``prompt_length`` tokens: ``budgets``,
    or with ``block`` each grown by :func:`block_aligned_budget` (every live node of a depth has the
    same prefix length, its depth's budgets above it)."""
    result, prefix = [], prompt_length
    for budget in budgets:
        budget = block_aligned_budget(prefix, budget, block) if block else budget
        result.append(budget)
        prefix += budget
    return tuple(result)


async def sample_tree(
    generate: Generate,
    request_id: str,
    prompt_ids: list[int],
    sampling_params: dict,
    branching: Sequence[int],
    segment_budgets: Sequence[int],
    response_length: int,
    eos_token_ids: Collection[int],
    align_to_block: int | None = None,
) -> SampledTree:
    """Expand the tree: each live node at depth d gets ``branching[d]`` children of at most
    ``segment_budgets[d]`` tokens (with ``align_to_block``, :func:`aligned_budgets`); the last depth
    runs to EOS or the response-length limit.

    One task per child: a child's own children are requested as soon as its segment is done, so a
    slow sibling holds up nobody's subtree but its own. Node ids are given when a node is requested
    (a parent's children in request order, which is the order verl's session slots count them in).
    """
    if len(segment_budgets) != len(branching) - 1:
        raise ValueError(f"need {len(branching) - 1} segment budgets for branching {list(branching)}, got {list(segment_budgets)}")
    tree = SampledTree(
        prompt_ids=list(prompt_ids), branching=tuple(branching), nodes=[TreeNode(ROOT, -1, 0)], tree_id=request_id
    )
    budgets = aligned_budgets(len(tree.prompt_ids), segment_budgets, align_to_block)

    async def grow(node: TreeNode, prefix: list[int], params: dict, is_last: bool) -> None:
        segment = await generate_segment(generate, request_id, tree.prompt_ids + prefix, params, "tree segment")
        node.token_ids, node.log_probs, node.server_fields = segment.token_ids, segment.log_probs, segment.server_fields
        node.stopped = (is_last or len(prefix) + len(node.token_ids) >= response_length
                        or _is_stop(node.token_ids, params["max_tokens"], eos_token_ids))
        if not node.stopped:
            await expand(node.node_id, prefix + node.token_ids)

    async def expand(parent: int, prefix: list[int]) -> None:
        depth = tree.nodes[parent].depth
        is_last = depth == len(branching) - 1
        remaining = response_length - len(prefix)
        params = {**sampling_params, "max_tokens": remaining if is_last else min(budgets[depth], remaining)}
        children = [tree.add_child(parent) for _ in range(branching[depth])]
        await asyncio.gather(*(grow(child, prefix, params, is_last) for child in children))

    await expand(ROOT, [])
    return tree
