"""SPO-tree over turns: a tree whose segments are the model's turns in a multi-turn episode.

A node at depth d < len(branching) holds one turn of the model and the environment's reply after it;
a node at the last depth holds the rest of the episode, every turn to its end. Each child continues its
parent's dialogue with its own fork of the environment as the parent left it, so siblings answer the
same dialogue. A node whose episode ended (the environment ended it, a limit was reached or the
environment failed) gets no children: it is a leaf, and its reward is the episode's (0 unless the
environment ended it). The tree is a :class:`spo_verl.core.rollout.tree.SampledTree` of
:class:`TurnNode`, which also carry the response mask of their tokens (the replies are 0) and, on leaves,
the episode's outcome, so that the tree's values, advantages, session slots and rows are SPO-tree's own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from spo_verl.core.episodes.environment import Environment, forked
from spo_verl.core.episodes.episode import TURN_LIMIT, Decode, EpisodeRules, Generate, Render, Turn, play
from spo_verl.core.rollout.tree import ROOT, SampledTree, TreeNode


@dataclass
class TurnNode(TreeNode):
    """A node of a tree over turns: which of its tokens are the model's (the environment's replies are 0),
    and on a leaf how its episode ended, with its reward and the environment's error, if any."""

    response_mask: list[int] = field(default_factory=list)
    reward: float | None = None
    ended_by: str | None = None
    error: str | None = None

    def token_mask(self) -> list[int]:
        return self.response_mask


async def sample_turn_tree(generate: Generate, request_id: str, prompt_ids: list[int], sampling_params: dict,
                           environment: Environment, render: Render, decode: Decode, rules: EpisodeRules,
                           branching: Sequence[int]) -> SampledTree:
    """Expand the tree: each live node at depth d gets ``branching[d]`` children, each one more turn
    (the rest of the episode at the last depth) played on a fork of the node's environment;
    ``environment`` is reset with the prompt's row. Node ids are given in request order, as
    :func:`spo_verl.core.rollout.tree.sample_tree` gives them, for verl's session slots."""
    if not branching or any(width < 1 for width in branching):
        raise ValueError(f"branching must be one or more positive widths, got {list(branching)}")
    if len(branching) > rules.max_turns:
        raise ValueError(f"a tree of depth {len(branching)} branches after more turns than an episode has "
                         f"({rules.max_turns})")
    tree = SampledTree(prompt_ids=list(prompt_ids), branching=tuple(branching), nodes=[TreeNode(ROOT, -1, 0)],
                       tree_id=request_id)

    async def grow(node: TurnNode, played: list[Turn], state: Environment, is_last: bool) -> None:
        limit = rules if is_last else replace(rules, max_turns=len(played) + 1)
        episode = await play(generate, request_id, tree.prompt_ids, sampling_params, state, render, decode, limit,
                             played=played)
        turns = episode.turns[len(played):]
        node.token_ids = [t for turn in turns for t in (*turn.token_ids, *turn.reply_ids)]
        node.log_probs = [p for turn in turns for p in (*turn.log_probs, *[0.0] * len(turn.reply_ids))]
        node.response_mask = [m for turn in turns for m in ([1] * len(turn.token_ids) + [0] * len(turn.reply_ids))]
        node.server_fields = turns[-1].server_fields if turns else {}
        ended = is_last or episode.ended_by != TURN_LIMIT or len(episode.turns) >= rules.max_turns
        if ended:
            node.stopped = True
            node.reward, node.ended_by, node.error = episode.reward, episode.ended_by, episode.error
        else:
            await expand(node.node_id, episode.turns, state)

    async def expand(parent: int, played: list[Turn], state: Environment) -> None:
        depth = tree.nodes[parent].depth
        # A fork that raises fails that child's episode.
        children = [(tree.add_child(parent, TurnNode), forked(state)) for _ in range(branching[depth])]
        await asyncio.gather(*(grow(child, list(played), fork, depth == len(branching) - 1)
                               for child, fork in children))

    await expand(ROOT, [], environment)
    return tree
