"""The report's four PNG plots: held-out accuracy and training reward against the training step and
against cumulative generated tokens, one line per run (matplotlib, Agg backend)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from spo_verl.report.runs import Run  # noqa: E402

PLOTS = {
    # file name: (y attribute, x attribute, y label, x label)
    "accuracy_vs_step.png": ("heldout_accuracy", "step", "held-out accuracy", "training step"),
    "accuracy_vs_generated_tokens.png": ("heldout_accuracy", "cumulative_generated_tokens", "held-out accuracy",
                                         "cumulative generated tokens"),
    "reward_vs_step.png": ("training_reward", "step", "training reward (mean score)", "training step"),
    "reward_vs_generated_tokens.png": ("training_reward", "cumulative_generated_tokens", "training reward (mean score)",
                                       "cumulative generated tokens"),
}


def series(run: Run, y: str, x: str) -> tuple[list[float], list[float]]:
    points = [(getattr(row, x), getattr(row, y)) for row in run.steps if getattr(row, y) is not None]
    return [p[0] for p in points], [p[1] for p in points]


def plot(runs: Sequence[Run], y: str, x: str, y_label: str, x_label: str, path: Path, title: str) -> Path:
    figure, axes = plt.subplots(figsize=(7, 4.2), dpi=100)
    drawn = 0
    for run in runs:
        xs, ys = series(run, y, x)
        if xs:
            axes.plot(xs, ys, marker="o", markersize=4, linewidth=1.6, label=f"{run.label} ({run.algorithm})")
            drawn += 1
    if drawn:
        axes.legend(fontsize=8)
    else:
        axes.text(0.5, 0.5, "no data logged", ha="center", va="center", transform=axes.transAxes, color="#777")
    axes.set_xlabel(x_label)
    axes.set_ylabel(y_label)
    axes.set_title(title, fontsize=10)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    figure.savefig(path, format="png")
    plt.close(figure)
    return path


def write_plots(runs: Sequence[Run], output: Path) -> dict[str, Path]:
    written = {}
    for name, (y, x, y_label, x_label) in PLOTS.items():
        written[name] = plot(runs, y, x, y_label, x_label, output / name, f"{y_label} vs {x_label}")
    return written
