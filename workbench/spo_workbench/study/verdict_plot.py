"""The verdict as a picture: for each declared comparison, every seed's paired difference (points), their
mean with its interval, zero, and the minimum detectable difference on either side (matplotlib, Agg)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from spo_workbench.study.paired import Paired  # noqa: E402


def plot_paired(results: Sequence[Paired], budget: float, path: Path) -> Path:
    """One row per comparison, differences in points of accuracy at ``budget`` tokens."""
    figure, axis = plt.subplots(figsize=(7.5, 1.5 + 0.9 * len(results)))
    for row, result in enumerate(results):
        y = len(results) - 1 - row
        points = [100 * d for d in result.differences]
        axis.scatter(points, [y] * len(points), s=22, color="tab:blue", alpha=0.7, zorder=3,
                     label="a seed's difference" if row == 0 else None)
        for seed, point in zip(result.seeds, points):
            axis.annotate(str(seed), (point, y), textcoords="offset points", xytext=(0, 6), ha="center", fontsize=7)
        if result.low is not None:
            axis.errorbar([100 * result.mean], [y - 0.25], xerr=[[100 * (result.mean - result.low)],
                                                                [100 * (result.high - result.mean)]],
                          fmt="D", color="black", capsize=4, zorder=3,
                          label=f"mean, {100 * result.level:g} % interval" if row == 0 else None)
            for side in (-1, 1):
                axis.plot([side * 100 * result.detectable] * 2, [y - 0.4, y + 0.4], color="tab:gray", linestyle=":",
                          label="minimum detectable" if row == 0 and side == 1 else None)
        elif result.mean is not None:
            axis.scatter([100 * result.mean], [y - 0.25], marker="D", color="black", zorder=3)
    axis.axvline(0.0, color="tab:red", linewidth=1)
    axis.set_yticks(range(len(results)))
    axis.set_yticklabels([f"{r.algorithm}\nminus {r.reference}\n({r.verdict})" for r in reversed(results)], fontsize=8)
    axis.set_ylim(-0.8, len(results) - 0.4)
    axis.set_xlabel(f"difference in greedy held-out accuracy (points)\nat {budget:,.0f} generated tokens, paired by seed")
    # Above the axes: inside, it would cover a comparison's points or interval.
    axis.legend(fontsize=7, loc="lower center", bbox_to_anchor=(0.5, 1.0), ncol=3, frameon=False)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
