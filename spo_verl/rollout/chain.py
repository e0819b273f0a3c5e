"""SPO-chain rollout logic over verl's ``generate`` interface (SPO.md 2a, 2c, 3a): segment boundaries
of a sampled response and their Monte Carlo values."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass

from spo_verl.algorithms.segments import (
    cutpoint_segment_starts,
    delimiter_segment_starts,
    fixed_count_segment_starts,
)
from spo_verl.config import ChainSettings
from spo_verl.rollout.server_output import check_not_aborted

Generate = Callable[..., Awaitable[object]]
ScoreResponse = Callable[[list[int]], Awaitable[float]]


def segment_starts(settings: ChainSettings, token_ids: Sequence[int], log_probs: Sequence[float],
                   delimiter_token_ids: Collection[int] = ()) -> list[int]:
    """Segment starts of one response by the configured partition."""
    if settings.partition == "cutpoint":
        probs = [math.exp(lp) for lp in log_probs]
        return cutpoint_segment_starts(probs, settings.cutpoint_threshold, settings.cutpoint_interval)
    if settings.partition == "fixed_count":
        return fixed_count_segment_starts(len(token_ids), settings.num_segments)
    return delimiter_segment_starts(token_ids, delimiter_token_ids)


def cap_boundaries(settings: ChainSettings, starts: list[int], response_length: int) -> tuple[list[int], bool]:
    """The boundaries that fit the per-response caps, in order, and whether any was dropped."""
    kept = starts[: settings.max_boundaries] if settings.max_boundaries is not None else list(starts)
    if settings.max_mc_tokens_per_response is not None:
        budget, fitting = settings.max_mc_tokens_per_response, []
        for start in kept:
            worst_case = settings.mc_samples * max(response_length - start, 1)
            if worst_case > budget:
                break
            budget -= worst_case
            fitting.append(start)
        kept = fitting
    return kept, len(kept) < len(starts)


@dataclass
class BoundaryValue:
    value: float
    continuations: int
    continuation_tokens: int


class BoundaryValueCache:
    """MC values of boundary prefixes, shared by the sessions of one prompt: identical token
    prefixes (the same state) are estimated once."""

    def __init__(self):
        self._tasks: dict[tuple[int, ...], asyncio.Task] = {}

    def value(self, prefix: Sequence[int], estimate: Callable[[], Awaitable[BoundaryValue]]) -> tuple[asyncio.Task, bool]:
        """The estimate of ``prefix`` and whether this call started it (so costs are counted once)."""
        key = tuple(prefix)
        created = key not in self._tasks
        if created:
            self._tasks[key] = asyncio.ensure_future(estimate())
        return self._tasks[key], created


async def monte_carlo_value(
    generate: Generate,
    request_id: str,
    prompt_ids: list[int],
    prefix: list[int],
    sampling_params: dict,
    samples: int,
    response_length: int,
    score_response: ScoreResponse,
) -> BoundaryValue:
    """Mean reward of ``samples`` continuations of ``prompt + prefix``, each scored as a whole response
    (prefix + continuation), all issued at once under one request id (one server, warm prefix cache)."""
    params = {**sampling_params, "max_tokens": max(response_length - len(prefix), 1)}
    outputs = await asyncio.gather(
        *(generate(request_id, prompt_ids=prompt_ids + prefix, sampling_params=params) for _ in range(samples))
    )
    for out in outputs:
        check_not_aborted(out, "Monte Carlo continuation")
    scores = await asyncio.gather(*(score_response(prefix + list(out.token_ids)) for out in outputs))
    return BoundaryValue(
        value=sum(scores) / samples,
        continuations=samples,
        continuation_tokens=sum(len(out.token_ids) for out in outputs),
    )
