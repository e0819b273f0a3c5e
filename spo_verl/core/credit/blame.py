"""The credit measures, on plain per-token numbers (no verl, no torch).

A response is what one estimator hands the loss for one sampled answer: an advantage per response
token, which tokens are in the loss (the probability mask), and which tokens this row trains (an SPO
tree trains each segment once: a segment shared by several leaves is trained by one of their rows).
For a wrong answer whose first wrong token ``e`` is known (``spo_verl.core.credit.answer_errors``):

* **blame on the error**: the share of the response's negative advantage mass on tokens ``>= e``
  (GRPO's advantage is one number a response, so for GRPO this is the share of tokens there);
* **blame on the right steps**: the mean advantage of the tokens before ``e``, and whether their
  sum is negative;

the same over the tokens in the loss only; and for right answers, whether any token gets a negative
advantage and where (the mean position of the negative mass, as a share of the response). The **net**
view adds the advantages of every trained instance of the same token in the same context (identical
prefixes of one prompt's responses: sibling nodes with the same text, identical GRPO answers), which is
what a packed update applies, and reads each response's tokens at those sums.
"""

from __future__ import annotations

import math
import random
from collections import defaultdict
from dataclasses import dataclass, field

VIEWS = ("all tokens", "in loss", "net")


@dataclass(frozen=True)
class Response:
    prompt_uid: str
    response_id: str
    reward: float
    tokens: tuple[int, ...]
    advantages: tuple[float, ...]  # per token, before the probability mask
    in_loss: tuple[bool, ...]  # the probability mask (and the response mask)
    trained: tuple[bool, ...] = ()  # the row trains this token (default: every token)
    first_error: int | None = None  # the first wrong token of a wrong answer; None: right or not placed
    # Tokens SPO-chain's continuations generated for the boundaries this response asked for first: a
    # prefix its prompt's chains share is valued once, so a group's sum is what its values cost.
    mc_tokens: int = 0

    def __post_init__(self):
        if not self.trained:
            object.__setattr__(self, "trained", (True,) * len(self.tokens))
        lengths = {len(self.tokens), len(self.advantages), len(self.in_loss), len(self.trained)}
        if len(lengths) != 1:
            raise ValueError(f"response {self.response_id}: tokens, advantages, in_loss and trained differ in length")
        if self.first_error is not None and not 0 <= self.first_error < len(self.tokens):
            raise ValueError(f"response {self.response_id}: first_error {self.first_error} is not a token index")

    @property
    def right(self) -> bool:
        return self.reward >= 1


@dataclass(frozen=True)
class Blame:
    """One response's measures in one view; ``None`` where the view has nothing to measure."""

    on_error: float | None  # share of the negative mass at or after the first wrong token (None: no negative mass)
    right_steps_mean: float | None  # mean advantage before the first wrong token (None: error at token 0)
    right_steps_negative: bool | None  # their sum is below zero


def blame(advantages: list[float], first_error: int, counted: list[bool] | None = None) -> Blame:
    """The measures of one wrong response whose first wrong token is ``first_error``, over the tokens
    ``counted`` (default: all)."""
    counted = counted if counted is not None else [True] * len(advantages)
    negative = [min(a, 0.0) for a, c in zip(advantages, counted) if c]
    after = [min(a, 0.0) for t, (a, c) in enumerate(zip(advantages, counted)) if c and t >= first_error]
    before = [a for t, (a, c) in enumerate(zip(advantages, counted)) if c and t < first_error]
    return Blame(sum(after) / sum(negative) if sum(negative) < 0 else None,
                 sum(before) / len(before) if before else None,
                 sum(before) < 0 if before else None)


def net_advantages(group: list[Response]) -> dict[str, list[float]]:
    """For each response of one prompt's group, the summed advantage of every trained instance of
    each of its tokens in the same context (the same token prefix), by response id."""
    totals: dict[tuple[int, ...], float] = defaultdict(float)
    for response in group:
        for t, (advantage, trains) in enumerate(zip(response.advantages, response.trained)):
            if trains:
                totals[response.tokens[: t + 1]] += advantage
    return {r.response_id: [totals.get(r.tokens[: t + 1], 0.0) for t in range(len(r.tokens))] for r in group}


def view_of(response: Response, view: str, net: dict[str, list[float]]) -> tuple[list[float], list[bool]]:
    """A response's advantages and counted tokens in ``view``."""
    if view == "all tokens":
        return list(response.advantages), [True] * len(response.tokens)
    if view == "in loss":
        return list(response.advantages), list(response.in_loss)
    if view == "net":
        return net[response.response_id], [True] * len(response.tokens)
    raise ValueError(f"view must be one of {VIEWS}, got {view!r}")


def negative_position(advantages: list[float]) -> float | None:
    """Where a response's negative mass sits: its mean token position as a share of the response
    (0: the first token, 1: the last); None without negative mass."""
    mass = [(t, -a) for t, a in enumerate(advantages) if a < 0]
    if not mass:
        return None
    total = sum(m for _, m in mass)
    return sum(t * m for t, m in mass) / total / max(len(advantages) - 1, 1)


@dataclass
class Summary:
    """The measures of one estimator in one view, over a set of prompt groups (means over responses)."""

    wrong_placed: int = 0
    wrong_not_placed: int = 0
    right: int = 0
    blamed: int = 0  # placed wrong responses with some negative advantage (where blame on the error is defined)
    on_error: float | None = None
    right_steps_mean: float | None = None
    right_steps_negative_share: float | None = None
    right_with_negative_share: float | None = None
    right_negative_position: float | None = None
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)


MEASURES = ("on_error", "right_steps_mean", "right_steps_negative_share", "right_with_negative_share",
            "right_negative_position")


def _mean(values: list) -> float | None:
    values = [float(v) for v in values if v is not None]
    return sum(values) / len(values) if values else None


@dataclass
class _GroupMeasures:
    """One prompt group's counts and per-response measures in one view (summed over groups)."""

    counts: dict[str, int]
    measured: dict[str, list]


def _group_measures(group: list[Response], view: str) -> _GroupMeasures:
    counts = {"wrong_placed": 0, "wrong_not_placed": 0, "right": 0}
    measured: dict[str, list] = defaultdict(list)
    net = net_advantages(group) if view == "net" else {}
    for response in group:
        advantages, counted = view_of(response, view, net)
        if response.right:
            counts["right"] += 1
            shown = [a for a, c in zip(advantages, counted) if c]
            measured["right_with_negative_share"].append(any(a < 0 for a in shown))
            measured["right_negative_position"].append(negative_position(shown))
        elif response.first_error is None:
            counts["wrong_not_placed"] += 1
        else:
            counts["wrong_placed"] += 1
            measures = blame(advantages, response.first_error, counted)
            measured["on_error"].append(measures.on_error)
            measured["right_steps_mean"].append(measures.right_steps_mean)
            measured["right_steps_negative_share"].append(measures.right_steps_negative)
    return _GroupMeasures(counts, measured)


def _combine(parts: list[_GroupMeasures]) -> Summary:
    summary = Summary(**{name: sum(part.counts[name] for part in parts) for name in ("wrong_placed", "wrong_not_placed", "right")})
    for name in MEASURES:
        setattr(summary, name, _mean([value for part in parts for value in part.measured[name]]))
    summary.blamed = sum(share is not None for part in parts for share in part.measured["on_error"])
    return summary


def summarise(groups: list[list[Response]], view: str) -> Summary:
    """Means over the responses of ``groups`` (each a prompt's responses under one estimator)."""
    return _combine([_group_measures(group, view) for group in groups])


def bootstrap(groups: list[list[Response]], view: str, resamples: int = 1000, seed: int = 0,
              level: float = 0.95) -> dict[str, tuple[float, float]]:
    """Percentile intervals of each measure over prompts: the prompt groups resampled with replacement."""
    parts = [_group_measures(group, view) for group in groups]  # each group measured once
    rng = random.Random(seed)
    draws: dict[str, list[float]] = defaultdict(list)
    for _ in range(resamples):
        sample = _combine([parts[rng.randrange(len(parts))] for _ in parts])
        for name in MEASURES:
            value = getattr(sample, name)
            if value is not None:
                draws[name].append(value)
    tail = (1 - level) / 2
    intervals = {}
    for name, values in draws.items():
        values.sort()
        low = values[max(0, math.floor(tail * len(values)))]
        high = values[min(len(values) - 1, math.ceil((1 - tail) * len(values)) - 1)]
        intervals[name] = (low, high)
    return intervals


def blame_on_error_of(group: list[Response], view: str) -> dict[str, float]:
    """Each placed wrong response's blame on the error in ``view``, by response id (where defined)."""
    net = net_advantages(group) if view == "net" else {}
    shares = {}
    for response in group:
        if not response.right and response.first_error is not None:
            advantages, counted = view_of(response, view, net)
            share = blame(advantages, response.first_error, counted).on_error
            if share is not None:
                shares[response.response_id] = share
    return shares


def paired_difference(groups: list[list[Response]], baseline: list[list[Response]], view: str, resamples: int = 1000,
                      seed: int = 0, level: float = 0.95) -> tuple[float | None, tuple[float, float] | None]:
    """The mean over responses of (blame on the error under one estimator) minus (under ``baseline``)
    on the same responses, with a percentile interval over prompts. ``groups`` and ``baseline`` hold
    the same prompts' responses, in the same order."""
    per_prompt = []
    for group, base in zip(groups, baseline):
        ours, theirs = blame_on_error_of(group, view), blame_on_error_of(base, view)
        per_prompt.append([ours[rid] - theirs[rid] for rid in ours if rid in theirs])

    def mean(prompts):
        values = [d for prompt in prompts for d in prompt]
        return sum(values) / len(values) if values else None

    point = mean(per_prompt)
    if point is None:
        return None, None
    rng = random.Random(seed)
    draws = sorted(d for d in (mean([per_prompt[rng.randrange(len(per_prompt))] for _ in per_prompt])
                               for _ in range(resamples)) if d is not None)
    tail = (1 - level) / 2
    return point, (draws[max(0, math.floor(tail * len(draws)))], draws[min(len(draws) - 1, math.ceil((1 - tail) * len(draws)) - 1)])


def groups_of(responses: list[Response]) -> list[list[Response]]:
    """Responses grouped by prompt, in first-seen order."""
    groups: dict[str, list[Response]] = {}
    for response in responses:
        groups.setdefault(response.prompt_uid, []).append(response)
    return list(groups.values())
