"""Episodes played turn by turn over verl's ``generate`` interface.

The model's turn is sampled to its end-of-turn token (EOS), to ``max_turn_tokens`` or to what is left
of the response length; the environment answers it; its reply, rendered as the tokens that follow the
model's turn (the chat template's turn of the reply's role, user or tool, and the assistant's header:
``render``), is appended (after an EOS of its own where the turn was cut short), and the next turn is
sampled after it. The response verl trains on is every turn and every reply in order; the replies are
masked out of the loss (``response_mask`` 0) and carry no log-probs.

A turn boundary is the start of a model turn: the prompt before the first, the dialogue after each
reply before the others. Its value is the mean reward of ``samples`` continuations of the episode from
there, each with a fork of the environment as it was at the boundary (:func:`turn_value`).

An episode that the environment did not end (the response length or ``max_turns`` ran out) scores 0,
as a truncated response does under ``truncated_response_score=zero``; one whose environment raised
(in its step or rendering its reply, or in the reset or fork it was given:
``spo_verl.core.episodes.environment.FailedEnvironment``) scores 0 and keeps the error's text, so that a
failing environment costs one episode, not the batch. A turn boundary whose fork raised is not kept,
nor any after it: the episode plays on, and only the boundaries before it can be valued.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass, field

from spo_verl.core.episodes.environment import Environment, EnvironmentReply, FailedEnvironment, forked
from spo_verl.core.metadata import EpisodeStatistics
from spo_verl.core.rollout.chain import BoundaryValue
from spo_verl.core.rollout.server_output import generate_segment

Generate = Callable[..., Awaitable[object]]
Render = Callable[[EnvironmentReply], list[int]]  # the environment's reply as the tokens that follow the model's turn
Decode = Callable[[list[int]], str]  # a model turn as the text the environment reads

ENDED_BY_ENVIRONMENT, TURN_LIMIT, LENGTH_LIMIT, ENVIRONMENT_ERROR = "environment", "turns", "length", "error"


@dataclass
class Turn:
    token_ids: list[int]  # the model's turn
    log_probs: list[float]
    reply_ids: list[int] = field(default_factory=list)  # the environment's reply after it (not trained)
    server_fields: dict = field(default_factory=dict)


@dataclass
class Episode:
    turns: list[Turn]
    reward: float = 0.0
    ended_by: str = TURN_LIMIT
    error: str | None = None
    boundary_environments: list[Environment] = field(default_factory=list)  # the environment at each turn start
    boundary_error: str | None = None  # a fork at a turn boundary raised: no boundary from there on is kept

    @property
    def response_ids(self) -> list[int]:
        return [t for turn in self.turns for t in (*turn.token_ids, *turn.reply_ids)]

    @property
    def response_mask(self) -> list[int]:
        return [m for turn in self.turns for m in ([1] * len(turn.token_ids) + [0] * len(turn.reply_ids))]

    @property
    def response_log_probs(self) -> list[float]:
        return [p for turn in self.turns for p in (*turn.log_probs, *[0.0] * len(turn.reply_ids))]

    @property
    def turn_starts(self) -> list[int]:
        """Offset of each model turn in the response: the segment starts of SPO over turns."""
        starts, offset = [], 0
        for turn in self.turns:
            starts.append(offset)
            offset += len(turn.token_ids) + len(turn.reply_ids)
        return starts

    @property
    def messages(self) -> int:
        """The prompt, each turn and each reply: what verl's tool agent loop counts as turns."""
        return 1 + len(self.turns) + sum(bool(turn.reply_ids) for turn in self.turns)

    @property
    def model_tokens(self) -> int:
        return sum(len(turn.token_ids) for turn in self.turns)

    @property
    def statistics(self) -> EpisodeStatistics:
        return EpisodeStatistics(len(self.turns), len(self.response_ids) - self.model_tokens, self.ended_by, self.error)


@dataclass(frozen=True)
class EpisodeRules:
    max_turns: int
    response_length: int  # the whole response: every turn and every reply
    eos_token_ids: Collection[int]
    max_turn_tokens: int | None = None  # a turn that reaches it ends there; None: the rest of the response


async def play(generate: Generate, request_id: str, prompt_ids: list[int], sampling_params: dict,
               environment: Environment, render: Render, decode: Decode, rules: EpisodeRules,
               played: Sequence[Turn] = (), keep_boundaries: bool = False) -> Episode:
    """Play the episode on from ``played`` (turns already in the dialogue; ``environment`` in the state
    they left it in) until the environment ends it or a limit does."""
    episode = Episode(turns=list(played))
    while len(episode.turns) < rules.max_turns:
        room = rules.response_length - len(episode.response_ids)
        if room <= 0:
            episode.ended_by = LENGTH_LIMIT
            return episode
        if keep_boundaries and episode.boundary_error is None:
            boundary = forked(environment)
            if isinstance(boundary, FailedEnvironment):
                episode.boundary_error = boundary.reason
            else:
                episode.boundary_environments.append(boundary)
        budget = min(room, rules.max_turn_tokens or room)
        segment = await generate_segment(generate, request_id, prompt_ids + episode.response_ids,
                                         {**sampling_params, "max_tokens": budget}, "episode turn")
        turn = Turn(segment.token_ids, segment.log_probs, server_fields=segment.server_fields)
        episode.turns.append(turn)
        ended_turn = bool(turn.token_ids) and turn.token_ids[-1] in rules.eos_token_ids
        if not ended_turn and len(turn.token_ids) >= room:  # cut by the response length inside the turn
            episode.ended_by = LENGTH_LIMIT
            return episode
        try:
            reply = await environment.step(decode(turn.token_ids))
            rendered = [] if reply.done else list(render(reply))
        except Exception as error:  # an environment's failure costs its episode, not the batch
            episode.ended_by, episode.error = ENVIRONMENT_ERROR, f"{type(error).__name__}: {error}"
            return episode
        if reply.done:
            episode.ended_by, episode.reward = ENDED_BY_ENVIRONMENT, float(reply.reward or 0.0)
            return episode
        reply_ids = ([] if ended_turn else [min(rules.eos_token_ids)]) + rendered
        if len(episode.response_ids) + len(reply_ids) >= rules.response_length:  # no room for the next turn
            episode.ended_by = LENGTH_LIMIT
            return episode
        turn.reply_ids = reply_ids
    episode.ended_by = TURN_LIMIT
    return episode


async def turn_value(generate: Generate, request_id: str, prompt_ids: list[int], sampling_params: dict,
                     environment: Environment, render: Render, decode: Decode, rules: EpisodeRules,
                     played: Sequence[Turn], samples: int) -> BoundaryValue:
    """Mean reward of ``samples`` continuations of the dialogue ``played``, each with its own fork of
    ``environment`` (the environment at that boundary), all under one request id. Its cost counts the
    model's tokens only, and as truncated the continuations the environment did not end (scored 0)."""
    episodes = await asyncio.gather(*(
        play(generate, request_id, prompt_ids, sampling_params, forked(environment), render, decode, rules, played)
        for _ in range(samples)))
    already = sum(len(turn.token_ids) for turn in played)
    return BoundaryValue(
        value=sum(episode.reward for episode in episodes) / samples,
        continuations=samples,
        continuation_tokens=sum(episode.model_tokens - already for episode in episodes),
        truncated=sum(episode.ended_by != ENDED_BY_ENVIRONMENT for episode in episodes),
    )
