"""The report's numbers as CSV: every step of every run (``results.csv``) and one summary line per run
(``summary.csv``)."""

from __future__ import annotations

import csv
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from spo_verl.report.runs import Run

RESULT_COLUMNS = ["run", "algorithm", "step", "generated_tokens", "cumulative_generated_tokens", "training_reward",
                  "heldout_accuracy", "wall_time_s", "cumulative_wall_time_s"]
SUMMARY_COLUMNS = ["run", "algorithm", "steps", "final_heldout_accuracy", "best_heldout_accuracy",
                   "final_training_reward", "total_generated_tokens", "total_wall_time_s", "accuracy_metric"]


@dataclass
class Summary:
    run: str
    algorithm: str
    steps: int
    final_heldout_accuracy: float | None
    best_heldout_accuracy: float | None
    final_training_reward: float | None
    total_generated_tokens: float
    total_wall_time_s: float
    accuracy_metric: str | None


def summarize(run: Run) -> Summary:
    accuracies = [row.heldout_accuracy for row in run.steps if row.heldout_accuracy is not None]
    rewards = [row.training_reward for row in run.steps if row.training_reward is not None]
    last = run.steps[-1] if run.steps else None
    return Summary(
        run=run.label, algorithm=run.algorithm, steps=len(rewards),
        final_heldout_accuracy=accuracies[-1] if accuracies else None,
        best_heldout_accuracy=max(accuracies) if accuracies else None,
        final_training_reward=rewards[-1] if rewards else None,
        total_generated_tokens=last.cumulative_generated_tokens if last else 0.0,
        total_wall_time_s=last.cumulative_wall_time_s if last else 0.0,
        accuracy_metric=run.accuracy_key,
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
                writer.writerow([run.label, run.algorithm, row.step, *(_cell(getattr(row, c)) for c in RESULT_COLUMNS[3:])])
    return path


def write_summary_csv(summaries: Sequence[Summary], path: Path) -> Path:
    with path.open("w", newline="", encoding="utf-8") as handle:
        writer = csv.writer(handle)
        writer.writerow(SUMMARY_COLUMNS)
        for summary in summaries:
            writer.writerow([_cell(getattr(summary, c)) for c in SUMMARY_COLUMNS])
    return path
