"""The report's PNG plots: held-out accuracy and training reward against the training step, against
cumulative generated tokens and against training wall time, and where each step's advantages put a wrong
answer's blame against cumulative generated tokens (matplotlib, Agg backend). One line per run; runs that are seeds of
one group (labels ``NAME/seed<k>``) are drawn faint, with the group's mean over seeds and a band of one
standard error on a common x grid (each seed interpolated linearly, within the x range all seeds
reach). The accuracy plots also draw the base model's held-out accuracy (the validations at step 0) as a
dashed line."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib
import numpy as np

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from spo_workbench.report.runs import Run  # noqa: E402

PLOTS = {
    # file name: (y attribute, x attribute, y label, x label)
    "accuracy_vs_step.png": ("heldout_accuracy", "step", "held-out accuracy", "training step"),
    "accuracy_vs_generated_tokens.png": ("heldout_accuracy", "cumulative_generated_tokens", "held-out accuracy",
                                         "cumulative generated tokens"),
    "reward_vs_step.png": ("training_reward", "step", "training reward (mean score)", "training step"),
    "reward_vs_generated_tokens.png": ("training_reward", "cumulative_generated_tokens", "training reward (mean score)",
                                       "cumulative generated tokens"),
    "accuracy_vs_wall_time.png": ("heldout_accuracy", "cumulative_wall_time_s", "held-out accuracy",
                                  "training wall time, s (verl's step timer; validation excluded)"),
    "reward_vs_wall_time.png": ("training_reward", "cumulative_wall_time_s", "training reward (mean score)",
                                "training wall time, s (verl's step timer; validation excluded)"),
    # Where each step's advantages put a wrong answer's blame (spo/credit/*): every token, and the
    # probability mask's tokens (what SPO's masked loss trains).
    "blame_on_error_vs_generated_tokens.png": ("blame_on_error", "cumulative_generated_tokens",
                                               "blame on the first wrong step (every token)", "cumulative generated tokens"),
    "blame_on_error_masked_vs_generated_tokens.png": ("blame_on_error_masked", "cumulative_generated_tokens",
                                                      "blame on the first wrong step (masked tokens)",
                                                      "cumulative generated tokens"),
}


def series(run: Run, y: str, x: str) -> tuple[list[float], list[float]]:
    points = [(getattr(row, x), getattr(row, y)) for row in run.steps if getattr(row, y) is not None]
    return [p[0] for p in points], [p[1] for p in points]


GRID_POINTS = 25


def _group_band(curves: list[tuple[list[float], list[float]]]):
    """(grid, mean, standard error) of several seeds' curves, or None when they share no x range."""
    low, high = max(xs[0] for xs, _ in curves), min(xs[-1] for xs, _ in curves)
    if high <= low:
        return None
    grid = np.linspace(low, high, GRID_POINTS)
    values = np.stack([np.interp(grid, xs, ys) for xs, ys in curves])
    return grid, values.mean(0), values.std(0, ddof=1) / np.sqrt(len(curves))


def _base_accuracy(runs: Sequence[Run]) -> float | None:
    values = [row.heldout_accuracy for run in runs for row in run.steps if row.step == 0 and row.heldout_accuracy is not None]
    return sum(values) / len(values) if values else None


def plot(runs: Sequence[Run], y: str, x: str, y_label: str, x_label: str, path: Path, title: str) -> Path:
    figure, axes = plt.subplots(figsize=(7, 4.2), dpi=100)
    groups: dict[str, list[Run]] = {}
    for run in runs:
        groups.setdefault(run.group, []).append(run)
    drawn = 0
    for index, (group, members) in enumerate(groups.items()):
        colour = f"C{index % 10}"
        curves = [curve for curve in (series(run, y, x) for run in members) if curve[0]]
        if not curves:
            continue
        drawn += 1
        label = group if group == members[0].algorithm else f"{group} ({members[0].algorithm})"
        if len(curves) == 1:
            axes.plot(*curves[0], marker="o", markersize=4, linewidth=1.6, color=colour, label=label)
            continue
        for xs, ys in curves:
            axes.plot(xs, ys, linewidth=0.8, alpha=0.3, color=colour)
        band = _group_band(curves)
        if band is not None:
            grid, mean, error = band
            axes.plot(grid, mean, linewidth=2.0, color=colour, label=f"{label}, mean of {len(curves)} seeds")
            axes.fill_between(grid, mean - error, mean + error, color=colour, alpha=0.2, linewidth=0)
    base = _base_accuracy(runs) if y == "heldout_accuracy" else None
    if base is not None:
        axes.axhline(base, color="#555", linestyle="--", linewidth=1.2, label=f"base model ({base:.3f})")
        drawn += 1
    if drawn:
        # Outside the axes: a legend inside would hide data points.
        axes.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0), borderaxespad=0)
    else:
        axes.text(0.5, 0.5, "no data logged", ha="center", va="center", transform=axes.transAxes, color="#777")
    axes.set_xlabel(x_label)
    axes.set_ylabel(y_label)
    axes.set_title(title, fontsize=10)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, format="png", bbox_inches="tight")
    plt.close(figure)
    return path


def write_plots(runs: Sequence[Run], output: Path) -> dict[str, Path]:
    written = {}
    for name, (y, x, y_label, x_label) in PLOTS.items():
        written[name] = plot(runs, y, x, y_label, x_label, output / name, f"{y_label} vs {x_label}")
    return written
