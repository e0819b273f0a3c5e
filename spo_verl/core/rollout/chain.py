"""SPO-chain rollout logic over verl's ``generate`` interface : segment boundaries
of a sampled response and their Monte Carlo values."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Collection, Sequence
from dataclasses import dataclass

from spo_verl.core.algorithms.segments import (
    cut_by_length_limit,
    delimiter_segment_starts,
    fixed_count_segment_starts,
    length_without_final_eos,
    select_cutpoints,
)
from spo_verl.core.config import ChainSettings
from spo_verl.core.rollout.server_output import check_not_aborted

Generate = Callable[..., Awaitable[object]]
ScoreResponse = Callable[[list[int]], Awaitable[float]]


def low_probability_from_sampler(log_probs: Sequence[float], threshold: float, top_p: float,
                                 top_k: int) -> list[bool | None]:
    """Whether each sampled token has ``p < threshold`` under softmax(logits / T), as far as the
    sampler's own log-probs tell: True or False where they decide it, None where they do not.

    vLLM's log-probs (``logprobs_mode=processed_logprobs``) are those of the distribution a token was
    drawn from: softmax(logits / T) cut by top-k, then top-p, and renormalised, so a token's ``q`` there
    is ``p / Z`` with Z the probability mass kept. Hence ``p <= q`` (a token with ``q < threshold`` is
    a low-probability token); without top-k and top-p, ``p = q``; top-p keeps the most likely tokens
    until their mass reaches ``top_p``, so ``Z >= top_p`` and ``p >= q * top_p`` (a token kept alone,
    ``q = 1``, has ``p >= top_p``). Top-k keeps no known share of the mass, so with top-k on only
    ``q < threshold`` decides.
    """
    top_k_on = top_k is not None and top_k > 0
    decided: list[bool | None] = []
    for log_prob in log_probs:
        q = math.exp(log_prob)
        if q < threshold:
            decided.append(True)
        elif top_k_on:
            decided.append(None)
        elif q * top_p >= threshold:
            decided.append(False)
        else:
            decided.append(None)
    return decided


class _CountedGenerate:
    def __init__(self, generate: Generate):
        self._generate = generate
        self.calls = 0

    async def __call__(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict):
        self.calls += 1
        return await self._generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params)


async def _untempered_log_probs(generate: Generate, request_id: str, token_ids: list[int]) -> list[float]:
    """``log softmax(logits)[token_ids[i + 1]]`` for every i: vLLM's prompt log-probs, which skip the
    sampler (no temperature, top-k or top-p), whatever the request's sampling settings."""
    out = await generate(request_id, prompt_ids=token_ids, sampling_params={"max_tokens": 1, "prompt_logprobs": 0})
    check_not_aborted(out, "prompt scoring")
    scored = (getattr(out, "extra_fields", None) or {}).get("prompt_logprobs")
    if scored is None:
        raise RuntimeError(
            "the rollout server returned no prompt log-probs (TokenOutput.extra_fields['prompt_logprobs']); SPO-chain "
            "cutpoints with top_p < 1 or top_k > 0 need them from verl's vLLM server"
        )
    return [entry[0] for entry in scored[: len(token_ids) - 1]]


async def _policy_log_probs(generate: Generate, request_id: str, prompt_ids: list[int], token_ids: list[int],
                            positions: Sequence[int], temperature: float) -> dict[int, float]:
    """``log softmax(logits / T)`` of ``token_ids[t]`` for each t in ``positions``, exactly.

    At T = 1 these are vLLM's prompt log-probs of the response (one request). Otherwise one token is
    drawn at position t from the untruncated distribution (top_p 1, top_k off, temperature T): if it
    is ``token_ids[t]``, its log-prob is the answer; if it is another token v, ``log p(y) = log p(v) +
    (z_y - z_v) / T`` where ``z_y - z_v`` is the difference of their untempered prompt log-probs.
    """
    if not positions:
        return {}
    full = None

    async def untempered_response() -> list[float]:
        nonlocal full
        if full is None:
            full = asyncio.ensure_future(_untempered_log_probs(generate, request_id, prompt_ids + token_ids))
        scored = await full
        return scored[len(prompt_ids) - 1 :]

    if temperature == 1.0:
        scored = await untempered_response()
        return {t: scored[t] for t in positions}

    draw = {"temperature": temperature, "top_p": 1.0, "top_k": -1, "max_tokens": 1, "logprobs": True}

    async def one(t: int) -> float:
        out = await generate(request_id, prompt_ids=prompt_ids + token_ids[:t], sampling_params=dict(draw))
        check_not_aborted(out, "cutpoint probe")
        drawn, drawn_log_prob = out.token_ids[0], out.log_probs[0]
        if drawn == token_ids[t]:
            return drawn_log_prob
        untempered_y = (await untempered_response())[t]
        untempered_v = (await _untempered_log_probs(generate, request_id, prompt_ids + token_ids[:t] + [drawn]))[-1]
        return drawn_log_prob + (untempered_y - untempered_v) / temperature

    values = await asyncio.gather(*(one(t) for t in positions))
    return dict(zip(positions, values))


@dataclass
class LowProbabilityTokens:
    positions: list[int]  # t with p_t < threshold under softmax(logits / T), in order
    requests: int  # generate calls spent deciding them (0 when the sampler's log-probs decide all)


async def low_probability_tokens(generate: Generate, request_id: str, prompt_ids: list[int], token_ids: list[int],
                                 log_probs: Sequence[float], sampling_params: dict,
                                 threshold: float) -> LowProbabilityTokens:
    """The response tokens with ``p < threshold`` under the policy's temperature-scaled distribution
    softmax(logits / T), without top-k or top-p, as the SPO reference finds cutpoints from
    the sampled tokens' log-probs where they decide it and from the engine where they do not."""
    decided = low_probability_from_sampler(
        log_probs, threshold, sampling_params.get("top_p", 1.0), sampling_params.get("top_k", -1)
    )
    undecided = [t for t, low in enumerate(decided) if low is None]
    counted = _CountedGenerate(generate)
    exact = await _policy_log_probs(
        counted, request_id, prompt_ids, list(token_ids), undecided, sampling_params.get("temperature", 1.0)
    )
    positions = [t for t, low in enumerate(decided) if low or (low is None and math.exp(exact[t]) < threshold)]
    return LowProbabilityTokens(positions, counted.calls)


async def segment_starts(settings: ChainSettings, token_ids: Sequence[int], log_probs: Sequence[float], *,
                         generate: Generate, request_id: str, prompt_ids: list[int], sampling_params: dict,
                         eos_token_ids: Collection[int],
                         delimiter_token_ids: Collection[int] = ()) -> tuple[list[int], int]:
    """Segment starts of one response by the configured partition, and the generate calls spent on them."""
    if settings.partition == "fixed_count":
        return fixed_count_segment_starts(len(token_ids), settings.num_segments), 0
    if settings.partition == "delimiter":
        return delimiter_segment_starts(token_ids, delimiter_token_ids), 0
    end = length_without_final_eos(token_ids, eos_token_ids)
    low = await low_probability_tokens(
        generate, request_id, prompt_ids, list(token_ids[:end]), log_probs[:end], sampling_params,
        settings.cutpoint_threshold,
    )
    return select_cutpoints(low.positions, settings.cutpoint_interval), low.requests


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
    truncated: int  # continuations cut by the length limit


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
    eos_token_ids: Collection[int],
    score_truncated: bool,
) -> BoundaryValue:
    """Mean reward of ``samples`` continuations of ``prompt + prefix``, each scored as a whole response
    (prefix + continuation), all issued at once under one request id (one server, warm prefix cache).

    A continuation may use what is left of ``response_length`` after the prefix, so it is scored under
    the same length limit as the sampled response. One cut by that limit scores 0 unless
    ``score_truncated`` (``algorithm.spo.truncated_response_score=reward_function``).
    """
    budget = max(response_length - len(prefix), 1)
    params = {**sampling_params, "max_tokens": budget}
    outputs = await asyncio.gather(
        *(generate(request_id, prompt_ids=prompt_ids + prefix, sampling_params=params) for _ in range(samples))
    )
    for out in outputs:
        check_not_aborted(out, "Monte Carlo continuation")
    cut = [cut_by_length_limit(list(out.token_ids), budget, eos_token_ids) for out in outputs]

    async def score(out, was_cut: bool) -> float:
        if was_cut and not score_truncated:
            return 0.0
        return await score_response(prefix + list(out.token_ids))

    scores = await asyncio.gather(*(score(out, was_cut) for out, was_cut in zip(outputs, cut)))
    return BoundaryValue(
        value=sum(scores) / samples,
        continuations=samples,
        continuation_tokens=sum(len(out.token_ids) for out in outputs),
        truncated=sum(cut),
    )
