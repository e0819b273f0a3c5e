"""The ``spo_tree`` agent loop: one SPO tree per prompt, one verl session per leaf slot.

verl runs ``rollout.n`` sessions of a prompt, each a fresh agent-loop object in the same worker
process. ``rollout.n`` must equal the number of leaf slots ``prod(branching)``: the first session
of a prompt starts the tree, every session awaits it and returns its own leaf. A slot whose leaf
stopped early (EOS above the last depth) shares that leaf with its sibling slots; only the first
of them returns it, the others return nothing (default trainer) or a copy that trains nothing
(legacy trainer, which needs exactly one output per session). Each returned leaf is an ordinary
response, so verl's reward code scores it; its tree metadata travels in ``extra_fields["spo"]``.

With ``algorithm.spo.tree.branch_at=cutpoint`` the tree forks at cutpoints
(``spo_verl.core.rollout.cutpoint_tree``): its leaves take the first slots in node order, and
``rollout.n`` must be at least the most leaves its settings allow; the slots beyond the leaves a tree
produced return nothing (or a copy that trains nothing).

With ``algorithm.spo.tree.branch_at=turn`` the tree forks a multi-turn episode between the model's turns
(``spo_verl.core.rollout.turn_tree``): a leaf's response is its dialogue, the environment's replies out
of the mask, and its score is its episode's reward (handed to verl, which does not score it again).
"""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any, ClassVar
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register
from verl.utils.profiler import simple_timer

from spo_verl.adapters.agent_loops.episode_agent_loop import EpisodePlayer, log_environment_error
from spo_verl.adapters.agent_loops.sessions import Dialogue, PromptJobs, row_problem, session_output
from spo_verl.core.algorithms.segments import cut_by_length_limit
from spo_verl.adapters.settings import spo_settings
from spo_verl.core.rollout.tree_shape import check_cutpoint_tree_fits, check_tree_fits, tree_segment_budgets
from spo_verl.core.episodes.episode import ENDED_BY_ENVIRONMENT
from spo_verl.core.rollout.turn_tree import sample_turn_tree
from spo_verl.core.metadata import EpisodeStatistics, TreeLeafRow
from spo_verl.core.rollout.cutpoint_tree import sample_cutpoint_tree
from spo_verl.core.rollout.tree import SampledTree, sample_tree
from spo_verl.core.rollout.tree_statistics import tree_statistics


@dataclass
class _TreeJob:
    task: asyncio.Task
    next_slot: itertools.count = field(default_factory=itertools.count)


class _FixedTree:
    """``branch_at=fixed``: every node forks into ``branching`` children after ``segment_tokens``."""

    def __init__(self, loop: SPOTreeAgentLoop, kwargs: dict[str, Any]):
        self.loop, self.settings = loop, loop.settings
        check_tree_fits(self.settings.branching, tree_segment_budgets(self.settings), loop.response_length,
                        loop.rollout_config.n, self.settings.align_to_block)

    async def prompt_ids(self, row: dict[str, Any]) -> list[int]:
        return await self.loop.ct_build_initial_tokens(list(row["raw_prompt"]))

    async def sample(self, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any],
                     row: dict[str, Any]) -> SampledTree:
        return await sample_tree(self.loop.server_manager.generate, request_id=request_id, prompt_ids=prompt_ids,
                                 sampling_params=sampling_params, branching=self.settings.branching,
                                 segment_budgets=tree_segment_budgets(self.settings),
                                 response_length=self.loop.response_length, eos_token_ids=self.loop.eos_token_ids,
                                 align_to_block=self.settings.align_to_block)

    def leaf(self, tree: SampledTree, leaf: int, token_ids: list[int], row: dict[str, Any]) -> tuple[bool, Dialogue | None]:
        """Whether the leaf was cut by the length limit (the estimator scores it by
        ``algorithm.spo.truncated_response_score``), and its dialogue (none: one response)."""
        return cut_by_length_limit(token_ids, self.loop.response_length, self.loop.eos_token_ids), None


class _CutpointTree(_FixedTree):
    """``branch_at=cutpoint``: whole responses fork at their low-probability tokens."""

    def __init__(self, loop: SPOTreeAgentLoop, kwargs: dict[str, Any]):
        self.loop, self.settings = loop, loop.settings
        check_cutpoint_tree_fits(self.settings.cutpoint, loop.rollout_config.n)

    async def sample(self, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any],
                     row: dict[str, Any]) -> SampledTree:
        return await sample_cutpoint_tree(self.loop.server_manager.generate, request_id, prompt_ids, sampling_params,
                                          self.settings.cutpoint, self.loop.response_length, self.loop.eos_token_ids)


class _TurnTree:
    """``branch_at=turn``: a multi-turn episode forks between the model's turns."""

    def __init__(self, loop: SPOTreeAgentLoop, kwargs: dict[str, Any]):
        self.loop, self.settings = loop, loop.settings
        check_tree_fits(self.settings.branching, (), loop.response_length, loop.rollout_config.n)  # a turn is as long as it is
        self.player = EpisodePlayer(loop.config, loop.tokenizer, kwargs.get("tools"))

    async def prompt_ids(self, row: dict[str, Any]) -> list[int]:
        return await self.player.prompt_ids(self.loop, row["raw_prompt"])

    async def sample(self, request_id: str, prompt_ids: list[int], sampling_params: dict[str, Any],
                     row: dict[str, Any]) -> SampledTree:
        player = self.player
        tree = await sample_turn_tree(self.loop.server_manager.generate, request_id, prompt_ids, sampling_params,
                                      player.start(row), player.render, player.decode, player.rules,
                                      self.settings.branching)
        for leaf in tree.leaves():
            log_environment_error(row, tree.nodes[leaf].error)
        return tree

    def leaf(self, tree: SampledTree, leaf: int, token_ids: list[int], row: dict[str, Any]) -> tuple[bool, Dialogue | None]:
        """A leaf that its environment did not end scores 0, as its episode does; its dialogue: the
        model's turns in the mask, the environment's replies out."""
        node, mask = tree.nodes[leaf], tree.response_mask(leaf)
        turns, replies = _runs(mask, 1), _runs(mask, 0)
        dialogue = Dialogue(mask, 1 + turns + replies, node.reward,
                            EpisodeStatistics(turns, mask.count(0), node.ended_by, node.error), row_problem(row))
        return node.ended_by != ENDED_BY_ENVIRONMENT, dialogue


TREE_SAMPLERS = {"fixed": _FixedTree, "cutpoint": _CutpointTree, "turn": _TurnTree}


@register("spo_tree")
class SPOTreeAgentLoop(AgentLoopBase):
    _jobs: ClassVar[PromptJobs[_TreeJob]] = PromptJobs()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.settings = spo_settings(self.config.algorithm).tree
        self.response_length = self.rollout_config.response_length
        self.eos_token_ids = {self.tokenizer.eos_token_id}
        self.legacy_trainer = not self.config.trainer.get("use_v1", True)
        self.sampler = TREE_SAMPLERS[self.settings.branch_at](self, kwargs)

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput | list[AgentLoopOutput]:
        def start() -> _TreeJob:
            return _TreeJob(asyncio.create_task(self._sample(sampling_params, kwargs)))

        with self._jobs.session(str(kwargs["uid"]), self.rollout_config.n, start) as job:
            # The legacy trainer does not number sessions; they start in row order, before any await.
            slot = int(kwargs["session_id"]) if "session_id" in kwargs else next(job.next_slot)
            tree, metrics = await job.task
        leaf, first = tree.slot_leaf(slot)
        if first:
            return self._leaf_output(tree, leaf, metrics, kwargs, trains=True)
        if not self.legacy_trainer:
            return []
        return self._leaf_output(tree, leaf, metrics, kwargs, trains=False)

    async def _sample(self, sampling_params: dict[str, Any], kwargs: dict[str, Any]) -> tuple[SampledTree, dict]:
        prompt_ids = await self.sampler.prompt_ids(kwargs)
        metrics: dict[str, float] = {}
        request_id = uuid4().hex  # one id per tree: the whole subtree stays on one server's prefix cache
        with simple_timer("generate_sequences", metrics):
            tree = await self.sampler.sample(request_id, prompt_ids, sampling_params, kwargs)
        return tree, metrics

    def _leaf_output(self, tree: SampledTree, leaf: int, metrics: dict, row: dict[str, Any],
                     trains: bool) -> AgentLoopOutput:
        token_ids, log_probs = tree.prefix(leaf)
        truncated, dialogue = self.sampler.leaf(tree, leaf, token_ids, row)
        spo = TreeLeafRow(
            tree_id=tree.tree_id,  # unique per sampled tree; the estimator checks one tree per uid
            path=tree.path(leaf),
            segment_ends=tree.segment_ends(leaf),
            trains=trains,
            truncated=truncated,
            tree=tree_statistics(tree),
        )
        return session_output(tree.prompt_ids, token_ids, log_probs, spo, metrics, tree.server_fields(leaf), trains,
                              dialogue)


def _runs(mask: list[int], value: int) -> int:
    """Maximal runs of ``value`` in ``mask``: a dialogue's turns (1) or replies (0)."""
    return sum(1 for i, m in enumerate(mask) if m == value and (i == 0 or mask[i - 1] != value))
