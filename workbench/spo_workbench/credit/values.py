"""SPO's Monte Carlo values checked against a reference: for prefixes of real SPO-chain responses (its
segment boundaries, and the prefixes just before and just after each wrong answer's first wrong token),
the value as the project estimates it (``monte_carlo_value`` with ``mc_samples`` continuations) against
a reference from many more continuations of the same prefix, sampled independently.

The framework-free part (choosing prefixes, the summary) takes plain numbers; :func:`value_prefixes`
samples through verl's server client.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

KINDS = ("boundary", "before_error", "after_error")


@dataclass(frozen=True)
class Prefix:
    """One prefix of one response: its first ``length`` tokens."""

    response: int  # index into the responses it was chosen from
    length: int
    kind: str  # KINDS


@dataclass(frozen=True)
class ValueRow:
    prompt_uid: str
    response_id: str
    reward: float  # the whole response's
    first_error: int | None
    length: int  # prefix tokens
    kind: str
    estimate: float  # mean of ``estimate_samples`` continuations' rewards
    estimate_samples: int
    reference: float
    reference_samples: int


def choose_prefixes(boundaries: Sequence[Sequence[int]], first_errors: Sequence[int | None], prompts: Sequence[str],
                    at_least: int) -> list[Prefix]:
    """Prefixes of the responses until there are ``at_least``: every segment boundary of a response,
    and for a wrong answer whose first wrong token ``e`` is known, the prefixes of ``e`` and ``e + 1``
    tokens (just before and just after it), each prefix of a response once. Responses are taken round
    robin over prompts (each prompt's first response, then each one's second, ...), so the prefixes come
    from as many prompts as possible."""
    by_prompt: dict[str, list[int]] = {}
    for i, uid in enumerate(prompts):
        by_prompt.setdefault(uid, []).append(i)
    order = [group[r] for r in range(max(map(len, by_prompt.values()), default=0)) for group in by_prompt.values()
             if r < len(group)]
    chosen: list[Prefix] = []
    for i in order:
        if len(chosen) >= at_least:
            break
        kinds = {length: "boundary" for length in boundaries[i]}
        if first_errors[i] is not None:
            kinds[first_errors[i]] = "before_error"
            kinds[first_errors[i] + 1] = "after_error"
        chosen += [Prefix(i, length, kind) for length, kind in sorted(kinds.items())]
    return chosen


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _sd(values: Sequence[float]) -> float | None:
    if len(values) < 2:
        return None
    mean = sum(values) / len(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def steps(rows: Sequence[ValueRow]) -> dict[str, list[float]]:
    """The reference value's change across consecutive prefixes of one response, by what the span
    holds: ``wrong_token`` (from just before the first wrong token to just after it), ``wrong_segment``
    (the boundary-to-boundary span that holds it), ``right_segment`` (a boundary-to-boundary span of
    right tokens: before the first wrong token, or in a right answer)."""
    by_response: dict[str, list[ValueRow]] = {}
    for row in rows:
        by_response.setdefault(row.response_id, []).append(row)
    out: dict[str, list[float]] = {"wrong_token": [], "wrong_segment": [], "right_segment": []}
    for response in by_response.values():
        at = {row.length: row for row in response}
        error = response[0].first_error
        right_answer = response[0].reward >= 1
        if error is not None and error in at and error + 1 in at:
            out["wrong_token"].append(at[error + 1].reference - at[error].reference)
        bounds = sorted(row.length for row in response if row.kind == "boundary")
        for before, after in zip(bounds, bounds[1:]):
            change = at[after].reference - at[before].reference
            if error is not None and before <= error < after:
                out["wrong_segment"].append(change)
            elif right_answer or (error is not None and after <= error):
                out["right_segment"].append(change)
    return out


def summary(rows: Sequence[ValueRow]) -> dict[str, float | int | None]:
    """Bias and spread of the estimate against the reference, the spread a binomial estimate of that
    many samples would have at the reference value, and the reference's mean change across the first
    wrong token, across the segment holding it, and across right segments."""
    errors = [row.estimate - row.reference for row in rows]
    expected = [math.sqrt(max(row.reference * (1 - row.reference), 0.0) / row.estimate_samples) for row in rows]
    changes = steps(rows)
    out: dict[str, float | int | None] = {
        "prefixes": len(rows), "responses": len({row.response_id for row in rows}),
        "prompts": len({row.prompt_uid for row in rows}),
        "bias": _mean(errors), "spread": _sd(errors),
        "binomial_spread": math.sqrt(_mean([e * e for e in expected])) if expected else None,
        "rmse": math.sqrt(_mean([e * e for e in errors])) if errors else None,
    }
    for name, values in changes.items():
        out[f"{name}_change"] = _mean(values)
        out[f"{name}_count"] = len(values)
    return out


async def value_prefixes(client, responses, chosen: Sequence[Prefix], score, *, estimate_samples: int,
                         reference_samples: int, response_length: int, eos_token_ids, first_errors,
                         concurrent: int = 8) -> list[ValueRow]:
    """The estimate and the reference of each chosen prefix, by the project's ``monte_carlo_value``.
    ``responses`` are verl ``AgentLoopOutput`` s with ``uid`` and ``score`` (``Leaf``);
    ``score(token ids, uid)`` scores a whole response, awaitable."""
    import asyncio
    from uuid import uuid4

    from spo_workbench.credit.rollouts import SAMPLING
    from spo_verl.core.rollout.chain import monte_carlo_value

    async def one(prefix: Prefix) -> ValueRow:
        leaf = responses[prefix.response]
        prompt_ids, ids = list(leaf.output.prompt_ids), list(leaf.output.response_ids)[: prefix.length]

        async def scored(token_ids):
            return await score(token_ids, leaf.uid)

        values = []
        for samples in (estimate_samples, reference_samples):
            value = await monte_carlo_value(client.generate, uuid4().hex, prompt_ids, ids, SAMPLING, samples,
                                            response_length, scored, eos_token_ids, False)
            values.append(value.value)
        return ValueRow(leaf.uid, f"{leaf.uid}-{prefix.response}", leaf.score, first_errors[prefix.response],
                        prefix.length, prefix.kind, values[0], estimate_samples, values[1], reference_samples)

    rows: list[ValueRow] = []
    for start in range(0, len(chosen), concurrent):
        rows += await asyncio.gather(*(one(prefix) for prefix in chosen[start : start + concurrent]))
        print(f"credit: {len(rows)} of {len(chosen)} prefixes valued", flush=True)
    return rows


COLUMNS = ("task", "prompt_uid", "response_id", "reward", "first_error", "length", "kind", "estimate",
           "estimate_samples", "reference", "reference_samples")


def write_values(path, rows: Sequence[tuple[str, ValueRow]]) -> None:
    """``values.csv``: one row per (task, prefix)."""
    import csv
    from dataclasses import astuple

    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(COLUMNS)
        for task, row in rows:
            writer.writerow([task, *("" if v is None else v for v in astuple(row))])


def read_values(path) -> list[tuple[str, ValueRow]]:
    import csv

    with open(path, newline="") as handle:
        return [(r["task"], ValueRow(r["prompt_uid"], r["response_id"], float(r["reward"]),
                                     int(r["first_error"]) if r["first_error"] else None, int(r["length"]), r["kind"],
                                     float(r["estimate"]), int(r["estimate_samples"]), float(r["reference"]),
                                     int(r["reference_samples"])))
                for r in csv.DictReader(handle)]


def write_value_table(rows: Sequence[tuple[str, ValueRow]], path) -> str:
    """``values.md``: :func:`summary` per task."""
    by_task: dict[str, list[ValueRow]] = {}
    for task, row in rows:
        by_task.setdefault(task, []).append(row)
    fmt = lambda v: "-" if v is None else (f"{v:+.3f}" if isinstance(v, float) else str(v))  # noqa: E731
    lines = ["| task | prefixes (responses, prompts) | estimate minus reference: bias | spread | binomial spread | "
             "reference change across the first wrong token | across the segment holding it | across a right segment |",
             "|---|---|---|---|---|---|---|---|"]
    for task, task_rows in by_task.items():
        s = summary(task_rows)
        lines.append(f"| {task} | {s['prefixes']} ({s['responses']}, {s['prompts']}) | {fmt(s['bias'])} | "
                     f"{fmt(s['spread'])} | {fmt(s['binomial_spread'])} | {fmt(s['wrong_token_change'])} "
                     f"(n={s['wrong_token_count']}) | {fmt(s['wrong_segment_change'])} (n={s['wrong_segment_count']}) | "
                     f"{fmt(s['right_segment_change'])} (n={s['right_segment_count']}) |")
    text = "\n".join(lines) + "\n"
    with open(path, "w") as handle:
        handle.write(text)
    return text
