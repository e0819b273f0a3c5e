"""The ``spo_episode`` agent loop: one multi-turn episode a session against
``algorithm.spo.turns.environment``, without values.

It is how verl's own estimators (GRPO, PPO) train on the same episodes that SPO-chain over turns plays,
and how every algorithm validates a multi-turn task (the trainers name it for validation when
``chain.partition=turn``). The episode is played as ``spo_verl.core.episodes.episode.play`` plays it:
the environment's replies rendered by the chat template and kept out of the mask, the episode's reward
handed to verl as the row's score. :class:`EpisodePlayer` is what both loops share; :func:`plays_episodes`
says from a run's configuration whether its rollout plays episodes (and so validates with this loop).
"""

from __future__ import annotations

import logging
from typing import Any
from uuid import uuid4

from verl.experimental.agent_loop.agent_loop import AgentLoopBase, AgentLoopOutput, register
from verl.utils.profiler import simple_timer

from spo_verl.adapters.agent_loops.sessions import Dialogue, session_output
from spo_verl.adapters.agent_loops.tool_environment import VERL_TOOLS, ToolEnvironment
from spo_verl.adapters.reward_function import RowScorer
from spo_verl.adapters.settings import spo_settings
from spo_verl.core.episodes.environment import Environment, EnvironmentReply, environment_factory, reset_environment
from spo_verl.core.episodes.episode import Episode, EpisodeRules, play

EPISODE_AGENT_LOOP = "spo_episode"
logger = logging.getLogger(__name__)


def plays_episodes(config: Any) -> bool:
    """The rollout of verl's ``config`` plays multi-turn episodes: SPO-chain or SPO-tree over turns, or
    verl's estimators on ``spo_episode``."""
    loop = config.actor_rollout_ref.rollout.agent.default_agent_loop
    spo = (config.get("algorithm") or {}).get("spo") or {}
    return (loop == EPISODE_AGENT_LOOP or (loop == "spo_chain" and (spo.get("chain") or {}).get("partition") == "turn")
            or (loop == "spo_tree" and (spo.get("tree") or {}).get("branch_at") == "turn"))


def chat_reply_tokens(tokenizer, message: str, role: str = "user") -> list[int]:
    """The tokens that follow a model turn ended by its EOS when ``message`` is the next turn of ``role``
    (a user's, or a tool's result): the chat template's turn and the assistant's header, as the template
    renders them after an assistant turn (the same after any turn for chat templates such as ChatML,
    Llama 3's and Qwen's)."""
    marker = "\u2063spo-turn\u2063"
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "."}, {"role": "assistant", "content": marker},
         {"role": role, "content": message}], add_generation_prompt=True, tokenize=False)
    after_turn = text.split(marker, 1)[1]
    if tokenizer.eos_token not in after_turn:
        raise ValueError(f"the chat template does not end an assistant turn with the EOS token "
                         f"{tokenizer.eos_token!r}: multi-turn episodes need one that does")
    return tokenizer.encode(after_turn.split(tokenizer.eos_token, 1)[1], add_special_tokens=False)


class EpisodePlayer:
    """Plays a prompt's episode in an agent loop: a fresh environment reset with the row, the rules of
    ``algorithm.spo.turns``, replies rendered by the tokenizer's chat template. ``tools``: what verl's
    worker hands every agent loop (the tools of ``rollout.multi_turn``), for ``verl_tools``."""

    def __init__(self, config: Any, tokenizer, tools: Any = None):
        settings = spo_settings(config.algorithm)
        rollout = config.actor_rollout_ref.rollout
        if settings.turns.environment is None:
            raise ValueError("multi-turn episodes need algorithm.spo.turns.environment: a registered environment "
                             "(e.g. arithmetic_dialogue), verl_tools or module:attribute")
        self.prompt_tools = None  # the tool schemas the chat template shows the model, if any
        if settings.turns.environment == VERL_TOOLS:
            tool_environment = ToolEnvironment(tools.tools if tools else [], rollout.multi_turn, tokenizer,
                                               RowScorer(config))
            self.environment_factory, self.prompt_tools = tool_environment.fork, tool_environment.prompt_tools()
        else:
            self.environment_factory = environment_factory(settings.turns.environment)
        self.rules = EpisodeRules(settings.turns.max_turns, rollout.response_length, {tokenizer.eos_token_id},
                                  settings.turns.max_turn_tokens)
        self.tokenizer = tokenizer

    async def prompt_ids(self, agent_loop: AgentLoopBase, raw_prompt: Any) -> list[int]:
        return await agent_loop.ct_build_initial_tokens(list(raw_prompt), tools=self.prompt_tools)

    def render(self, reply: EnvironmentReply) -> list[int]:
        return chat_reply_tokens(self.tokenizer, reply.message, reply.role)

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def start(self, row: dict[str, Any]) -> Environment:
        """A fresh environment reset with the prompt's row (one that fails at its first step if the reset
        raised)."""
        return reset_environment(self.environment_factory, row)

    async def play(self, game: tuple, row: dict[str, Any], keep_boundaries: bool = False) -> Episode:
        """``game``: (generate, request id, prompt ids, sampling params). An environment that fails ends
        its episode with reward 0, logged with the prompt's uid; the batch goes on."""
        episode = await play(*game, self.start(row), self.render, self.decode, self.rules, keep_boundaries=keep_boundaries)
        log_environment_error(row, episode.error)
        if episode.boundary_error is not None:
            logger.warning("the environment could not be forked at a turn boundary of prompt %s (%s); the turns "
                           "from there on share the last valued turn's segment", row.get("uid"), episode.boundary_error)
        return episode


def log_environment_error(row: dict[str, Any], error: str | None) -> None:
    if error is not None:
        logger.warning("the environment failed in an episode of prompt %s (%s); it scores 0", row.get("uid"), error)


@register(EPISODE_AGENT_LOOP)
class SPOEpisodeAgentLoop(AgentLoopBase):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.player = EpisodePlayer(self.config, self.tokenizer, kwargs.get("tools"))

    async def run(self, sampling_params: dict[str, Any], **kwargs) -> AgentLoopOutput:
        prompt_ids = await self.player.prompt_ids(self, kwargs["raw_prompt"])
        metrics: dict[str, float] = {}
        with simple_timer("generate_sequences", metrics):
            episode = await self.player.play((self.server_manager.generate, uuid4().hex, prompt_ids, sampling_params), kwargs)
        return session_output(prompt_ids, episode.response_ids, episode.response_log_probs, None, metrics,
                              [turn.server_fields for turn in episode.turns], dialogue=Dialogue.of(episode, kwargs))
