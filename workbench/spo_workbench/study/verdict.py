"""The study's pre-declared comparisons (docs/STUDY.md): each run's held-out accuracy at exactly the
token budget, and differences between algorithms over paired seeds with their standard error, a
confidence interval, the verdict and the smallest difference the study could detect.

    python -m spo_workbench.study.verdict --output-dir outputs/study --budget 16000 \\
        [--compare spo_tree_cutpoint-grpo_prob_mask,spo_tree_cutpoint-grpo] [--level 0.975] [--csv runs.csv]

**At the budget.** A run stops at the step expected to reach the budget, so its last validation is a
little past it. Its accuracy at the budget is interpolated linearly in cumulative generated tokens
between the two validations around the budget (the base model's, at 0 tokens, counts as one); a run
whose last validation falls short of the budget has no value at it (reported, not extrapolated).

**Paired seeds.** Seed k gives every algorithm the same training data order, so the difference is
taken seed by seed: its mean over the seeds both algorithms finished, the standard error of that mean,
a two-sided Student-t interval at ``--level`` (the declared level: 97.5 % for two primary comparisons,
Bonferroni), and the minimum detectable difference: the true difference the study would find with 80 %
power at that level, ``(t_(level) + t_(0.8)) * se``. The verdict: "better" when the interval lies above
0, "worse" when below, else "not resolved", with the interval as the differences it rules out.

**Secondary, labelled so.** Each arm's mean accuracy at the budget over its seeds, and the same pairs
on the final policy's sampled accuracy (``final_sampled_accuracy`` in a run's ``done.json``, written by
``compare --sampled-validation N``: N answers a problem at the training temperature, after the run's
last step, so a little past the budget), read with the same test.
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
from dataclasses import dataclass
from pathlib import Path

from recipe.spo.metrics_log import read_logged_steps
from spo_workbench.standard_error import mean_and_se
from spo_workbench.study.paired import Paired, paired

CUMULATIVE = "spo/generated_tokens_cumulative"


def accuracy_key(data: dict, samples: int = 1) -> str | None:
    suffix = f"/acc/mean@{samples}"
    return next((key for key in sorted(data) if key.startswith("val-core/") and key.endswith(suffix)), None)


def validations(steps: list[tuple[int, dict]]) -> list[tuple[float, float]]:
    """``(cumulative generated tokens, greedy accuracy)`` at each validation of a run (step 0: 0 tokens)."""
    points = []
    for step, data in steps:
        key = accuracy_key(data)
        if key is None:
            continue
        tokens = 0.0 if step == 0 else data.get(CUMULATIVE)
        if tokens is not None:
            points.append((float(tokens), float(data[key])))
    return points


def at_budget(points: list[tuple[float, float]], budget: float) -> float | None:
    """Linear interpolation of accuracy at ``budget`` tokens between the validations around it; None
    when no validation reaches the budget."""
    points = sorted(points)
    for (t0, a0), (t1, a1) in zip(points, points[1:]):
        if t0 <= budget <= t1:
            return a0 if t1 == t0 else a0 + (a1 - a0) * (budget - t0) / (t1 - t0)
    if points and points[-1][0] == budget:
        return points[-1][1]
    return None


def _finished_runs(output_dir: Path):
    """``((algorithm, seed), run folder)`` of every run with its ``done.json``."""
    for metrics in sorted(output_dir.glob("*/seed*/metrics.jsonl")):
        if (metrics.parent / "done.json").exists():
            yield (metrics.parent.parent.name, int(metrics.parent.name.removeprefix("seed"))), metrics.parent


def runs_past_their_budget(output_dir: Path, training_budget: float) -> list[str]:
    """Finished runs that trained past the step their training token budget chose, over all their attempts
    (a run resumed across sittings must stop where an uninterrupted one would have)."""
    from spo_workbench.study.compare import RunFolder

    past = []
    for (name, seed), folder in _finished_runs(output_dir):
        steps = json.loads((folder / "done.json").read_text()).get("steps")
        chosen = RunFolder.open(folder).chosen_last_step(steps, training_budget) if steps else None
        if chosen is not None and steps > chosen:
            past.append(f"{name}/seed{seed} ({steps} steps, the budget chose {chosen})")
    return past


def study_at_budget(output_dir: Path, budget: float) -> dict[tuple[str, int], float | None]:
    """Every finished run's accuracy at the budget, from its merged metrics (``metrics.jsonl``)."""
    return {run: at_budget(validations(read_logged_steps(folder / "metrics.jsonl")), budget)
            for run, folder in _finished_runs(output_dir)}


def study_final_sampled(output_dir: Path) -> dict[tuple[str, int], float | None]:
    """Every finished run's final sampled accuracy (None where the run had no sampled validation)."""
    return {run: json.loads((folder / "done.json").read_text() or "{}").get("final_sampled_accuracy")
            for run, folder in _finished_runs(output_dir)}


@dataclass(frozen=True)
class Arm:
    algorithm: str
    seeds: int
    mean: float | None
    se: float | None  # over seeds; None below 2


def arms(at: dict[tuple[str, int], float | None]) -> list[Arm]:
    """Each algorithm's mean over the seeds that have a value, with its standard error."""
    result = []
    for name in sorted({name for name, _ in at}):
        values = [v for (n, _), v in sorted(at.items()) if n == name and v is not None]
        mean, se = mean_and_se(values)
        result.append(Arm(name, len(values), mean, se))
    return result


def render_arms(rows: list[Arm]) -> str:
    lines = ["| arm | seeds | mean | se over seeds |", "|---|---|---|---|"]
    lines += [f"| {a.algorithm} | {a.seeds} | {'-' if a.mean is None else f'{a.mean:.3f}'} | "
              f"{'-' if a.se is None else f'{a.se:.3f}'} |" for a in rows]
    return "\n".join(lines)


def render(results: list[Paired]) -> str:
    fmt = lambda v: "-" if v is None else f"{100 * v:+.1f}"  # noqa: E731  (points)
    lines = [f"| comparison (points) | seeds | mean difference | se | {100 * results[0].level:g} % interval | "
             "minimum detectable | verdict |", "|---|---|---|---|---|---|---|"] if results else []
    for r in results:
        lines.append(f"| {r.algorithm} minus {r.reference} | {len(r.seeds)} | {fmt(r.mean)} | "
                     f"{'-' if r.se is None else f'{100 * r.se:.1f}'} | [{fmt(r.low)}, {fmt(r.high)}] | "
                     f"{'-' if r.detectable is None else f'{100 * r.detectable:.1f}'} | {r.verdict} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spo_workbench.study.verdict", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--budget", type=float, required=True, help="the study's token budget")
    parser.add_argument("--compare", default="", help="comma-separated algorithm-reference pairs (none: only each "
                                                      "run's accuracy at the budget, e.g. for a tuning sweep)")
    parser.add_argument("--level", type=float, default=0.975, help="the intervals' level (default 0.975: two "
                                                                    "primary comparisons, Bonferroni)")
    parser.add_argument("--csv", type=Path, help="also write each run's accuracy at the budget here")
    parser.add_argument("--plot", type=Path, help="also draw the declared comparisons' paired differences here (PNG)")
    parser.add_argument("--training-budget", type=float,
                        help="the runs' --token-budget: also name any run that trained past the step it chose")
    args = parser.parse_args(argv)
    pairs = [item.split("-", 1) for item in args.compare.split(",") if item]
    if any(len(pair) != 2 for pair in pairs):
        parser.error(f"--compare takes algorithm-reference pairs, got {args.compare!r}")
    at = study_at_budget(args.output_dir, args.budget)
    finished = sorted({name for name, _ in at})
    unknown = sorted({name for pair in pairs for name in pair} - set(finished))
    if unknown:
        parser.error(f"--compare names {unknown}, which have no finished run in {args.output_dir} "
                     f"(finished: {finished})")
    sampled = study_final_sampled(args.output_dir)
    cell = lambda value: "" if value is None else f"{value:.6f}"  # noqa: E731
    if args.csv:
        with open(args.csv, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["algorithm", "seed", "accuracy_at_budget", "final_sampled_accuracy"])
            writer.writerows([name, seed, cell(value), cell(sampled.get((name, seed)))] for (name, seed), value in sorted(at.items()))
    for (name, seed), value in sorted(at.items()):
        print(f"{name}/seed{seed}: accuracy at {args.budget:,.0f} tokens: {'-' if value is None else f'{value:.4f}'}")
    short = [f"{name}/seed{seed}" for (name, seed), value in sorted(at.items()) if value is None]
    if short:
        print(f"verdict: no validation reaches {args.budget:,.0f} tokens in {', '.join(short)}: left out of "
              "every pair they are in", file=sys.stderr)
    if args.training_budget:
        past = runs_past_their_budget(args.output_dir, args.training_budget)
        print(f"Runs that trained past the step their {args.training_budget:,.0f}-token budget chose: "
              f"{', '.join(past) if past else 'none'}")
    results = [paired(at, algorithm, reference, args.level) for algorithm, reference in pairs]
    print(f"Greedy accuracy at {args.budget:,.0f} tokens, each arm (secondary):")
    print(render_arms(arms(at)))
    if any(value is not None for value in sampled.values()):
        print("The final policy's sampled accuracy, each arm and the same pairs (secondary):")
        print(render_arms(arms(sampled)))
        print(render([paired(sampled, algorithm, reference, args.level) for algorithm, reference in pairs]))
    print(f"The declared comparisons: greedy accuracy at {args.budget:,.0f} tokens, paired seeds:")
    print(render(results))
    if args.plot and results:
        from spo_workbench.study.verdict_plot import plot_paired

        plot_paired(results, args.budget, args.plot)
    print(json.dumps([{**r.__dict__, "verdict": r.verdict} for r in results]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
