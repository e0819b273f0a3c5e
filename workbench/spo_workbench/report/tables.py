"""The report's numbers as CSV: every step of every run (``results.csv``), one summary line per run
(``summary.csv``), per group of seeds (``groups.csv``) and, for multi-turn runs, every step's
``spo/turns/*`` metrics in long form (``turns.csv``: run, algorithm, seed, step, metric, value)."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from spo_workbench.report.runs import CREDIT_KEYS, PHASES, Run
from spo_workbench.standard_error import mean_and_se

PHASE_COLUMNS = [f"{phase}_s" for phase in PHASES]  # verl's timing_s/<phase> of a step
RESULT_COLUMNS = ["run", "algorithm", "seed", "step", "generated_tokens", "cumulative_generated_tokens", "training_reward",
                  "heldout_accuracy", "trained_tokens", "actor_tokens_per_update", "wall_time_s", "cumulative_wall_time_s",
                  "monte_carlo_tokens", *CREDIT_KEYS, *PHASE_COLUMNS]
SUMMARY_COLUMNS = ["run", "algorithm", "steps", "base_heldout_accuracy", "final_heldout_accuracy", "best_heldout_accuracy",
                   "final_training_reward", "total_generated_tokens", "total_trained_tokens", "actor_tokens_per_update",
                   "total_wall_time_s", "accuracy_metric"]


@dataclass
class Summary:
    run: str
    algorithm: str
    steps: int
    base_heldout_accuracy: float | None  # step 0: the validation before training
    final_heldout_accuracy: float | None
    best_heldout_accuracy: float | None
    final_training_reward: float | None
    total_generated_tokens: float
    total_trained_tokens: float | None  # None where no step logged spo/trained_tokens (verl's baselines)
    actor_tokens_per_update: float | None  # mean over the steps; None without packed training
    total_wall_time_s: float
    accuracy_metric: str | None
    phase_s: dict[str, float]  # seconds per phase over all steps (summary.csv: <phase>_s)


def summarize(run: Run) -> Summary:
    """Final and best held-out accuracy are over the validations after training began (step > 0)."""
    accuracies = [row.heldout_accuracy for row in run.steps if row.heldout_accuracy is not None and row.step > 0]
    base = next((row.heldout_accuracy for row in run.steps if row.step == 0), None)
    rewards = [row.training_reward for row in run.steps if row.training_reward is not None]
    last = run.steps[-1] if run.steps else None
    trained = [row.trained_tokens for row in run.steps if row.trained_tokens is not None]
    actor = [row.actor_tokens_per_update for row in run.steps if row.actor_tokens_per_update is not None]
    return Summary(
        run=run.label, algorithm=run.algorithm, steps=len(rewards), base_heldout_accuracy=base,
        final_heldout_accuracy=accuracies[-1] if accuracies else None,
        best_heldout_accuracy=max(accuracies) if accuracies else None,
        final_training_reward=rewards[-1] if rewards else None,
        total_generated_tokens=last.cumulative_generated_tokens if last else 0.0,
        total_trained_tokens=sum(trained) if trained else None,
        actor_tokens_per_update=sum(actor) / len(actor) if actor else None,
        total_wall_time_s=last.cumulative_wall_time_s if last else 0.0,
        accuracy_metric=run.accuracy_key,
        phase_s={phase: sum(row.phase_s.get(phase, 0.0) for row in run.steps) for phase in PHASES},
    )


def _cell(value) -> str:
    if value is None:
        return ""
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


def write_results_csv(runs: Sequence[Run], path: Path) -> Path:
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(RESULT_COLUMNS)
        for run in runs:
            for row in run.steps:
                writer.writerow([run.label, run.algorithm, _cell(run.seed), row.step,
                                 *(_cell(getattr(row, c)) for c in RESULT_COLUMNS[4:-len(PHASES)]),
                                 *(_cell(row.phase_s.get(phase)) for phase in PHASES)])
    return path


def write_turns_csv(runs: Sequence[Run], path: Path) -> Path | None:
    """None (and no file) when no run logged a turn metric."""
    rows = [[run.label, run.algorithm, _cell(run.seed), row.step, name, _cell(value)]
            for run in runs for row in run.steps for name, value in sorted(row.turns.items())]
    if not rows:
        return None
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(["run", "algorithm", "seed", "step", "metric", "value"])
        writer.writerows(rows)
    return path


def _write_records(records: Sequence, columns: list[str], path: Path, phases: str, suffix: str) -> Path:
    """One CSV line per record (a dataclass): the named attributes, then the dict attribute ``phases``
    as one column per phase (``<phase><suffix>``)."""
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(columns + [phase + suffix for phase in PHASES])
        for record in records:
            writer.writerow([_cell(getattr(record, c)) for c in columns]
                            + [_cell(getattr(record, phases).get(phase)) for phase in PHASES])
    return path


def write_summary_csv(summaries: Sequence[Summary], path: Path) -> Path:
    return _write_records(summaries, SUMMARY_COLUMNS, path, "phase_s", "_s")


GROUP_COLUMNS = ["group", "algorithm", "seeds", "base_heldout_accuracy", "final_heldout_accuracy_mean",
                 "final_heldout_accuracy_se", "best_heldout_accuracy_mean", "best_heldout_accuracy_se",
                 "generated_tokens_mean", "trained_tokens_mean", "actor_tokens_per_update_mean", "steps_mean",
                 "wall_time_s_mean"]


@dataclass
class GroupSummary:
    """One algorithm over its seeds: means with their standard error (sample std / sqrt(seeds); None
    for a single seed)."""

    group: str
    algorithm: str
    seeds: int
    base_heldout_accuracy: float | None
    final_heldout_accuracy_mean: float | None
    final_heldout_accuracy_se: float | None
    best_heldout_accuracy_mean: float | None
    best_heldout_accuracy_se: float | None
    generated_tokens_mean: float
    trained_tokens_mean: float | None  # over the seeds that logged them
    actor_tokens_per_update_mean: float | None  # over the seeds that logged them
    steps_mean: float
    wall_time_s_mean: float
    phase_s_mean: dict[str, float]  # groups.csv: <phase>_s_mean


def summarize_groups(runs: Sequence[Run], summaries: Sequence[Summary]) -> list[GroupSummary]:
    groups: dict[str, list[tuple[Run, Summary]]] = {}
    for run, summary in zip(runs, summaries):
        groups.setdefault(run.group, []).append((run, summary))
    result = []
    for group, members in groups.items():
        picked = lambda attribute: [getattr(s, attribute) for _, s in members if getattr(s, attribute) is not None]  # noqa: E731
        base = picked("base_heldout_accuracy")
        final, best = mean_and_se(picked("final_heldout_accuracy")), mean_and_se(picked("best_heldout_accuracy"))
        result.append(GroupSummary(
            group=group, algorithm=members[0][0].algorithm, seeds=len(members),
            base_heldout_accuracy=sum(base) / len(base) if base else None,
            final_heldout_accuracy_mean=final[0], final_heldout_accuracy_se=final[1],
            best_heldout_accuracy_mean=best[0], best_heldout_accuracy_se=best[1],
            generated_tokens_mean=mean_and_se(picked("total_generated_tokens"))[0] or 0.0,
            trained_tokens_mean=mean_and_se(picked("total_trained_tokens"))[0],
            actor_tokens_per_update_mean=mean_and_se(picked("actor_tokens_per_update"))[0],
            steps_mean=mean_and_se(picked("steps"))[0] or 0.0,
            wall_time_s_mean=mean_and_se(picked("total_wall_time_s"))[0] or 0.0,
            phase_s_mean={phase: mean_and_se([s.phase_s.get(phase, 0.0) for _, s in members])[0] for phase in PHASES},
        ))
    return result


def write_group_csv(groups: Sequence[GroupSummary], path: Path) -> Path:
    return _write_records(groups, GROUP_COLUMNS, path, "phase_s_mean", "_s_mean")
