"""The ``spo_chain`` agent loop: a sampled response, its segment boundaries and their MC values.

Each of the ``rollout.n`` sessions of a prompt samples one response, partitions it
(``algorithm.spo.chain.partition``) and estimates the value of every boundary prefix with
``mc_samples`` continuations scored by the reward function verl uses for the row (a custom
``reward.custom_reward_function`` or verl's ``default_compute_score`` for its ``data_source``). The
sessions of a prompt share one estimate per distinct prefix. Cutpoints are the tokens with
``p < cutpoint_threshold`` under the policy's softmax(logits / T) without top-k/top-p, as in the SPO
reference: read from the rollout's log-probs (vLLM's temperature-scaled ones with
``rollout.logprobs_mode=processed_logprobs``, verl's default; checked at start-up) where they decide
it, asked of the engine where top-k/top-p leave it open (``spo_verl.core.rollout.chain.low_probability_tokens``).
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any, ClassVar
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register
from verl.utils.profiler import simple_timer

from spo_verl.adapters.agent_loops.episode_agent_loop import EpisodePlayer
from spo_verl.adapters.agent_loops.sessions import Dialogue, PromptJobs, session_output
from spo_verl.adapters.reward_function import RowScorer
from spo_verl.core.algorithms.segments import cut_by_length_limit
from spo_verl.adapters.settings import spo_settings
from spo_verl.core.episodes.episode import ENDED_BY_ENVIRONMENT, turn_value
from spo_verl.core.metadata import ChainRow, ChainStatistics
from spo_verl.core.rollout.chain import BoundaryValueCache, cap_boundaries, monte_carlo_value, segment_starts
from spo_verl.core.rollout.server_output import check_not_aborted

PROCESSED_LOGPROBS = "processed_logprobs"


@functools.lru_cache(maxsize=8)
def _delimiter_token_ids(tokenizer, delimiter: str) -> frozenset[int]:
    """Vocabulary entries whose text ends with the delimiter (e.g. "\\n\\n", ".\\n\\n")."""
    return frozenset(i for i in range(len(tokenizer)) if tokenizer.decode([i]).endswith(delimiter))


@register("spo_chain")
class SPOChainAgentLoop(AgentLoopBase):
    # The sessions of a prompt share one Monte Carlo estimate per distinct prefix.
    _jobs: ClassVar[PromptJobs[BoundaryValueCache]] = PromptJobs()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        settings = spo_settings(self.config.algorithm)
        self.settings = settings.chain
        self.score_truncated = settings.truncated_response_score == "reward_function"
        self.response_length = self.rollout_config.response_length
        self.eos_token_ids = {self.tokenizer.eos_token_id}
        logprobs_mode = self.rollout_config.get("logprobs_mode", PROCESSED_LOGPROBS)
        if self.settings.partition == "cutpoint" and logprobs_mode != PROCESSED_LOGPROBS:
            raise ValueError(
                f"algorithm.spo.chain.partition=cutpoint needs the sampling temperature's probabilities: set "
                f"actor_rollout_ref.rollout.logprobs_mode={PROCESSED_LOGPROBS} (got {logprobs_mode})"
            )
        self.score_text = RowScorer(self.config)
        if self.settings.partition == "turn":
            self.player = EpisodePlayer(self.config, self.tokenizer, kwargs.get("tools"))

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        run = self._run_episode if self.settings.partition == "turn" else self._run
        with self._jobs.session(str(kwargs["uid"]), self.rollout_config.n, BoundaryValueCache) as values:
            return await run(values, sampling_params, kwargs)

    async def _run_episode(self, shared_values: BoundaryValueCache, sampling_params: dict[str, Any],
                           kwargs: dict[str, Any]) -> AgentLoopOutput:
        """A multi-turn episode against the environment, each of the model's turns a segment; the caps
        (``max_boundaries``, ``max_mc_tokens_per_response``) keep the first turn starts that fit them, the
        turns after the last one kept joining its segment."""
        prompt_ids = await self.player.prompt_ids(self, kwargs["raw_prompt"])
        # The episode and all its continuations: one request id, one server, warm prefix cache.
        game = (self.server_manager.generate, uuid4().hex, prompt_ids, sampling_params)
        rules = (self.player.render, self.player.decode, self.player.rules)
        metrics: dict[str, float] = {}
        with simple_timer("generate_sequences", metrics):
            episode = await self.player.play(game, kwargs, keep_boundaries=True)
            # Turn starts whose environment could be forked (all, unless a fork raised), within the caps.
            valued = episode.turn_starts[: len(episode.boundary_environments)]
            starts, capped = cap_boundaries(self.settings, valued, self.response_length)
            estimates = [
                shared_values.value(episode.response_ids[:start], functools.partial(
                    turn_value, *game, episode.boundary_environments[k], *rules, episode.turns[:k],
                    self.settings.mc_samples))
                for k, start in enumerate(starts)
            ]
            values = await asyncio.gather(*(task for task, _ in estimates))
        spo = chain_row(starts, values, [created for _, created in estimates], capped,
                        truncated=episode.ended_by != ENDED_BY_ENVIRONMENT)  # scores 0 (the episode's reward is 0 too)
        return session_output(prompt_ids, episode.response_ids, episode.response_log_probs, spo, metrics,
                              [turn.server_fields for turn in episode.turns], dialogue=Dialogue.of(episode, kwargs))

    async def _run(self, shared_values: BoundaryValueCache, sampling_params: dict[str, Any],
                   kwargs: dict[str, Any]) -> AgentLoopOutput:
        prompt_ids = await self.ct_build_initial_tokens(list(kwargs["raw_prompt"]))
        request_id = uuid4().hex  # the response and all its continuations: one server, warm prefix cache
        metrics: dict[str, float] = {}
        with simple_timer("generate_sequences", metrics):
            response_params = {**sampling_params, "max_tokens": self.response_length}
            output = await self.server_manager.generate(request_id, prompt_ids=prompt_ids, sampling_params=response_params)
            check_not_aborted(output, "response")
            token_ids = list(output.token_ids)[: self.response_length]
            log_probs = list(output.log_probs or [])[: self.response_length]
            delimiters = (
                _delimiter_token_ids(self.tokenizer, self.settings.delimiter) if self.settings.partition == "delimiter" else ()
            )
            found, cutpoint_requests = await segment_starts(
                self.settings, token_ids, log_probs, generate=self.server_manager.generate, request_id=request_id,
                prompt_ids=prompt_ids, sampling_params=sampling_params, eos_token_ids=self.eos_token_ids,
                delimiter_token_ids=delimiters,
            )
            starts, capped = cap_boundaries(self.settings, found, self.response_length)
            score = functools.partial(self._score_response, kwargs)
            estimates = [
                shared_values.value(
                    token_ids[:start],
                    functools.partial(
                        monte_carlo_value, self.server_manager.generate, request_id, prompt_ids, token_ids[:start],
                        sampling_params, self.settings.mc_samples, self.response_length, score, self.eos_token_ids,
                        self.score_truncated,
                    ),
                )
                for start in starts
            ]
            values = await asyncio.gather(*(task for task, _ in estimates))
        # The estimators score a truncated response by algorithm.spo.truncated_response_score.
        spo = chain_row(starts, values, [created for _, created in estimates], capped,
                        truncated=cut_by_length_limit(token_ids, self.response_length, self.eos_token_ids),
                        cutpoint_requests=cutpoint_requests,
                        no_cutpoint=self.settings.partition == "cutpoint" and not found)
        return session_output(prompt_ids, token_ids, log_probs or None, spo, metrics, [output.extra_fields or {}])

    async def _score_response(self, row: dict[str, Any], response_ids: list[int]) -> float:
        """A whole response decoded as verl's reward manager decodes it (without special tokens), scored."""
        return await self.score_text(row, self.tokenizer.decode(response_ids, skip_special_tokens=True))


def chain_row(starts: list[int], values: list, created: list[bool], capped: bool, truncated: bool,
              cutpoint_requests: int = 0, no_cutpoint: bool = False) -> ChainRow:
    """A chain's row for the estimator: each boundary's Monte Carlo value, and the cost of the estimates
    this session started (``created``; an estimate of a prefix another session shares counts there)."""
    started_here = [value for value, mine in zip(values, created) if mine]
    return ChainRow(
        segment_starts=starts,
        boundary_values=[value.value for value in values],
        truncated=truncated,
        chain=ChainStatistics(
            boundaries=len(starts),
            mc_continuations=sum(v.continuations for v in started_here),
            mc_tokens=sum(v.continuation_tokens for v in started_here),
            mc_truncated=sum(v.truncated for v in started_here),
            cutpoint_requests=cutpoint_requests,
            no_cutpoint=no_cutpoint,
            capped=capped,
        ),
    )
