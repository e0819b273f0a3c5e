"""Sampling an SPO tree that forks at cutpoints, through verl's ``generate`` interface.

Per prompt, a few whole responses are sampled. Each response is cut at its fork points, chosen among
its cutpoints exactly as SPO-chain chooses segment boundaries (``spo_verl.core.rollout.chain``); from the
prefix just before each fork token, new continuations run to the end, so siblings differ from the
fork token on. A continuation may fork again for a set number of rounds. The tree's nodes are the
pieces of each path between consecutive fork points: a fork at token t of a path makes the piece
before t a node whose children are the path's own piece from t on and the new continuations. A fork
at the first token of a path adds the continuations beside the path (under its parent): no node is
empty.

Every request of a tree carries the tree's request id (one server, its prefix cache), and every
continuation is requested as soon as its fork point is known.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection
from dataclasses import dataclass, field

from spo_verl.core.algorithms.segments import length_without_final_eos, select_cutpoints
from spo_verl.core.config import CutpointTreeSettings
from spo_verl.core.rollout.chain import low_probability_tokens
from spo_verl.core.rollout.server_output import generate_segment
from spo_verl.core.rollout.tree import ROOT, Generate, SampledTree, TreeNode


@dataclass
class Fork:
    position: int  # response offset of the fork token (the first token where siblings differ)
    response_tokens: int  # length of the response it was found on


@dataclass
class CutpointTree(SampledTree):
    """A :class:`SampledTree` whose leaves are verl's session slots in node order; slots beyond the
    leaves return nothing (or, on the legacy trainer, a copy that trains nothing)."""

    forks: list[Fork] = field(default_factory=list)
    paths: int = 0  # responses sampled (the first ones and every continuation)
    cutpoint_requests: int = 0  # generate calls spent deciding cutpoints beyond the sampler's log-probs

    def slot_leaf(self, slot: int) -> tuple[int, bool]:
        leaves = sorted(self.leaves())
        if slot < 0:
            raise ValueError(f"slot {slot} is negative")
        return (leaves[slot], True) if slot < len(leaves) else (leaves[0], False)


async def fork_points(generate: Generate, request_id: str, prompt_ids: list[int], token_ids: list[int],
                      log_probs: list[float], sampling_params: dict, settings: CutpointTreeSettings,
                      eos_token_ids: Collection[int]) -> tuple[list[int], int]:
    """Offsets in ``token_ids`` (sampled after ``prompt_ids``) where the path forks: every
    ``interval``-th low-probability token, at most ``max_forks``; a final EOS never forks. Also the
    generate calls spent deciding which tokens have low probability."""
    end = length_without_final_eos(token_ids, eos_token_ids)
    low = await low_probability_tokens(generate, request_id, prompt_ids, token_ids[:end], log_probs[:end],
                                       sampling_params, settings.threshold)
    return select_cutpoints(low.positions, settings.interval)[: settings.max_forks], low.requests


async def sample_cutpoint_tree(
    generate: Generate,
    request_id: str,
    prompt_ids: list[int],
    sampling_params: dict,
    settings: CutpointTreeSettings,
    response_length: int,
    eos_token_ids: Collection[int],
) -> CutpointTree:
    tree = CutpointTree(prompt_ids=list(prompt_ids), branching=(), nodes=[TreeNode(ROOT, -1, 0)], tree_id=request_id)

    def add_node(parent: int, token_ids: list[int], log_probs: list[float], server_fields: dict) -> int:
        return tree.add_child(parent, token_ids=token_ids, log_probs=log_probs, server_fields=server_fields).node_id

    async def grow(parent: int, prefix: list[int], round_: int) -> None:
        """Sample one path from ``prefix`` (the tokens of the nodes down to ``parent``) to the end,
        split it at its forks and grow the continuations of each fork."""
        params = {**sampling_params, "max_tokens": response_length - len(prefix)}
        segment = await generate_segment(generate, request_id, tree.prompt_ids + prefix, params, "tree path")
        token_ids, log_probs, server_fields = segment.token_ids, segment.log_probs, segment.server_fields
        tree.paths += 1
        forks: list[int] = []
        if round_ < settings.rounds and token_ids:
            forks, requests = await fork_points(generate, request_id, tree.prompt_ids + prefix, token_ids, log_probs,
                                                sampling_params, settings, eos_token_ids)
            tree.cutpoint_requests += requests
        continuations, node, start = [], parent, 0
        for fork in forks:
            if fork > start:
                node = add_node(node, token_ids[start:fork], log_probs[start:fork], server_fields)
                start = fork
            tree.forks.append(Fork(len(prefix) + fork, len(prefix) + len(token_ids)))
            continuations += [grow(node, prefix + token_ids[:fork], round_ + 1) for _ in range(settings.width)]
        leaf = add_node(node, token_ids[start:], log_probs[start:], server_fields)
        tree.nodes[leaf].stopped = True
        await asyncio.gather(*continuations)

    await asyncio.gather(*(grow(ROOT, [], 0) for _ in range(settings.responses)))
    return tree
