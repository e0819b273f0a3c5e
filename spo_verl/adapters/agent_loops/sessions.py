"""What the SPO agent loops share: one job per prompt that the prompt's ``rollout.n`` sessions await
together, and the output verl's trainer reads from a session.

verl runs each session of a prompt as a fresh agent-loop object in the same worker process, so what the
sessions share lives in a class-level ``PromptJobs``, keyed by the prompt's uid and dropped when the last
of its sessions has finished."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from verl.experimental.agent_loop.agent_loop import AgentLoopMetrics, AgentLoopOutput

from spo_verl.core.episodes.episode import Episode
from spo_verl.core.metadata import EPISODE_FIELD, SPO_FIELD, EpisodeStatistics, SPORow, episode_to_extra_field, to_extra_field
from spo_verl.core.rollout.server_output import merged_weight_versions

Job = TypeVar("Job")

# verl counts a prompt and its response as two turns (its single-turn agent loop reports 2).
SINGLE_TURN = 2


class PromptJobs(Generic[Job]):
    def __init__(self):
        self._jobs: dict[str, list] = {}  # uid -> [job, sessions finished]

    def __len__(self) -> int:
        """Prompts with a session still running."""
        return len(self._jobs)

    @contextlib.contextmanager
    def session(self, uid: str, sessions: int, start: Callable[[], Job]) -> Iterator[Job]:
        """The prompt's job, started by its first session; counts this session finished on leaving."""
        entry = self._jobs.get(uid)
        if entry is None:
            entry = self._jobs[uid] = [start(), 0]
        try:
            yield entry[0]
        finally:
            entry[1] += 1
            if entry[1] == sessions:
                self._jobs.pop(uid, None)


def row_problem(row: Mapping[str, Any]) -> str:
    """What tells a multi-turn episode's problem apart in verl's validation dumps, beside its prompt: the
    row's ``extra_info`` (what the environment is reset with) as sorted JSON, "" when the row has none.
    Episodes whose prompts open alike and go on differently (the environment says the rest) share a
    prompt, so the prompt alone would pair one problem's answers with another's."""
    extra_info = row.get("extra_info") or {}
    return json.dumps(extra_info, sort_keys=True, default=_plain) if extra_info else ""


def _plain(value: Any) -> Any:
    """A value that JSON has no form for, as one it has: numpy's arrays and scalars (parquet rows hold
    them) as lists and numbers, anything else as its text."""
    return value.tolist() if hasattr(value, "tolist") else str(value)


@dataclass(frozen=True)
class Dialogue:
    """What verl needs of a multi-turn response beyond its tokens: which tokens are the model's (the
    environment's replies are 0), how many messages verl's tool agent loop would count (the prompt, each
    turn, each reply) and the episode's reward, so that verl's reward step does not score it again; the
    episode's statistics for the ``spo/turns/*`` metrics; and its ``problem`` (:func:`row_problem`)."""

    response_mask: list[int]
    messages: int
    reward: float
    statistics: EpisodeStatistics
    problem: str

    @classmethod
    def of(cls, episode: Episode, row: Mapping[str, Any]) -> "Dialogue":
        return cls(episode.response_mask, episode.messages, episode.reward, episode.statistics, row_problem(row))


def session_output(prompt_ids: list[int], response_ids: list[int], response_logprobs: list[float] | None,
                   spo: SPORow | None, metrics: dict[str, float], server_fields: list[dict[str, Any]],
                   trains: bool = True, dialogue: Dialogue | None = None) -> AgentLoopOutput:
    """A session's response as verl's single-turn agent loop returns one, its SPO metadata (if any: an
    episode played for verl's own estimators has none) in ``extra_fields["spo"]``; a response that
    ``trains`` nothing has an all-zero response mask; a ``dialogue``'s keeps the environment's replies
    out of the mask and carries the episode's reward, also as ``acc`` in ``reward_extra_info``, where
    verl's reward manager puts a score (its validation metrics read ``acc`` from there; they pass over
    text such as the ``problem`` beside it, which verl's validation dumps keep), and its statistics in
    ``extra_fields[EPISODE_FIELD]`` (none for a copy that trains nothing)."""
    mask = dialogue.response_mask if dialogue is not None else [1] * len(response_ids)
    return AgentLoopOutput(
        prompt_ids=prompt_ids,
        response_ids=response_ids,
        response_mask=[m if trains else 0 for m in mask],
        response_logprobs=response_logprobs,
        num_turns=SINGLE_TURN if dialogue is None else dialogue.messages,
        reward_score=None if dialogue is None else dialogue.reward,
        metrics=AgentLoopMetrics(**metrics),
        extra_fields={**merged_weight_versions(server_fields), **({} if spo is None else {SPO_FIELD: to_extra_field(spo)}),
                      **({} if dialogue is None else {"reward_extra_info": {"acc": dialogue.reward,
                                                                            "problem": dialogue.problem},
                                                      EPISODE_FIELD: episode_to_extra_field(dialogue.statistics) if trains else None}),
                      "turn_scores": [], "tool_rewards": []},
    )
