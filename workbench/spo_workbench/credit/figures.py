"""What a person would rather look at than read: the value check's calibration plot, V along one wrong
response, the gradient measurement's cosine against generated tokens (one draw, and the mean of several),
and an HTML page with one wrong response per task and setup, its tokens coloured by each estimator's
advantage side by side, the first wrong token marked."""

from __future__ import annotations

import html
import statistics
from collections.abc import Sequence
from pathlib import Path

from spo_verl.core.credit.blame import Response, blame
from spo_workbench.student_t import paired_interval
from spo_workbench.credit.values import ValueRow
from spo_workbench.report.response_view import advantage_colour


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def calibration_plot(rows: Sequence[tuple[str, ValueRow]], path: Path) -> Path:
    """Each prefix's estimate against its reference (jittered a little: both are means of 0/1 rewards),
    one colour per task, the diagonal for a perfect estimate."""
    import random

    plt = _pyplot()
    rng = random.Random(0)
    figure, axes = plt.subplots(figsize=(5, 5))
    for task in dict.fromkeys(task for task, _ in rows):
        points = [row for t, row in rows if t == task]
        axes.scatter([p.reference + rng.uniform(-0.01, 0.01) for p in points],
                     [p.estimate + rng.uniform(-0.02, 0.02) for p in points], s=10, alpha=0.5, label=task)
    axes.plot([0, 1], [0, 1], color="black", linewidth=0.8)
    samples = sorted({(row.estimate_samples, row.reference_samples) for _, row in rows})
    axes.set_xlabel(f"reference value ({', '.join(str(r) for _, r in samples)} continuations)")
    axes.set_ylabel(f"estimated value ({', '.join(str(e) for e, _ in samples)} continuations, as SPO-chain)")
    axes.set_title("Monte Carlo values against a reference")
    axes.legend(loc="upper left")
    return _save(plt, figure, path)


def gradient_plot(prompt_draws: dict[tuple, dict[str, list]], path: Path) -> Path:
    """Corrected cosine with the true gradient against generated tokens, one panel a policy (all prompt
    sets together): each prompt's mean over its draws as a small point, the mean over prompts as a large
    one with its 95 % Student-t interval over prompts, one colour an estimator, its budgets joined.
    ``prompt_draws``: the gradient command's ``prompt_draws``, each draw's ``tokens`` and ``alignment``."""
    plt = _pyplot()
    policies = sorted({key[0] for key in prompt_draws if key[1] == "all"})
    figure, panels = plt.subplots(1, max(1, len(policies)), figsize=(6 * max(1, len(policies)), 4.2), squeeze=False)
    colours = {}
    for panel, policy in zip(panels[0], policies):
        keys = sorted(key for key in prompt_draws if key[:2] == (policy, "all"))
        for estimator in dict.fromkeys(key[3] for key in keys):
            colour = colours.setdefault(estimator, f"C{len(colours) % 10}")
            points = []
            for key in (k for k in keys if k[3] == estimator):
                prompt_means = [(statistics.fmean(d.tokens for d in draws), statistics.fmean(d.alignment for d in draws))
                                for draws in prompt_draws[key].values()]
                panel.plot([t for t, _ in prompt_means], [c for _, c in prompt_means], ".", color=colour, alpha=0.35)
                interval = paired_interval([c for _, c in prompt_means], unit="prompts")
                points.append((statistics.fmean(t for t, _ in prompt_means), interval))
            points.sort(key=lambda point: point[0])
            panel.plot([t for t, _ in points], [i.mean for _, i in points], "o-", color=colour, label=estimator)
            for tokens, interval in points:
                if interval.low is not None:
                    panel.plot([tokens, tokens], [interval.low, interval.high], color=colour, linewidth=1.5)
        _label_token_panel(panel, "generated tokens a draw (log)", "cosine with the true gradient (corrected)",
                           f"{policy} policy: small points one prompt each, large the mean over prompts")
    return _save(plt, figure, path)


def averaging_plot(curves: dict[tuple[str, str, str], list[tuple[float, float, int]]], path: Path) -> Path:
    """The corrected cosine of the mean of m draws against their generated tokens, one panel a policy and
    parameter set, one line an estimator (``gradients.averaging_curves``): where a line levels off below 1
    more tokens stop helping, the estimator's bias; how fast it climbs, its noise."""
    plt = _pyplot()
    panels_keys = sorted({key[:2] for key in curves})
    figure, panels = plt.subplots(1, max(1, len(panels_keys)), figsize=(6 * max(1, len(panels_keys)), 4.2), squeeze=False)
    colours = {}
    for panel, (policy, parameters) in zip(panels[0], panels_keys):
        for (p, q, estimator), curve in curves.items():
            if (p, q) != (policy, parameters) or not curve:
                continue
            colour = colours.setdefault(estimator, f"C{len(colours) % 10}")
            panel.plot([t for t, _, _ in curve], [c for _, c, _ in curve], "o-", color=colour, label=estimator)
        panel.axhline(1.0, color="black", linewidth=0.6)
        _label_token_panel(panel, "generated tokens of the draws averaged (log)", "corrected cosine of the draws' mean",
                           f"{policy} policy, {parameters}: 1, 2, ... draws averaged, mean over prompts")
    return _save(plt, figure, path)


def _label_token_panel(panel, xlabel: str, ylabel: str, title: str) -> None:
    panel.set_xscale("log")
    panel.set_xlabel(xlabel)
    panel.set_ylabel(ylabel)
    panel.set_title(title, fontsize=9)
    panel.legend(fontsize=7)


def _save(plt, figure, path: Path) -> Path:
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def along_response(rows: Sequence[ValueRow]) -> list[ValueRow] | None:
    """The wrong response with the most valued prefixes that include both sides of its first wrong token."""
    by_response: dict[str, list[ValueRow]] = {}
    for row in rows:
        by_response.setdefault(row.response_id, []).append(row)
    candidates = [r for r in by_response.values()
                  if {"before_error", "after_error"} <= {row.kind for row in r}]
    return sorted(max(candidates, key=len), key=lambda row: row.length) if candidates else None


def along_plot(response: Sequence[ValueRow], tokens_text: str, path: Path) -> Path:
    """V (reference and estimate) at each valued prefix of one wrong response, the first wrong token marked."""
    plt = _pyplot()
    figure, axes = plt.subplots(figsize=(7, 3.2))
    lengths = [row.length for row in response]
    axes.step(lengths, [row.reference for row in response], where="post", label="reference", color="tab:blue")
    axes.plot(lengths, [row.estimate for row in response], "o", label="estimate", color="tab:orange", markersize=4)
    error = response[0].first_error
    if error is not None:
        axes.axvline(error + 0.5, color="tab:red", linestyle="--", linewidth=1, label="first wrong token")
    axes.set_xlabel("prefix length (response tokens)")
    axes.set_ylabel("V(prefix)")
    axes.set_ylim(-0.05, 1.05)
    axes.set_title(f"V along {response[0].response_id}: " + _short(tokens_text, 70), fontsize=8)
    axes.legend(fontsize=7)
    return _save(plt, figure, path)


def _short(text: str, limit: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _token_row(name: str, response: Response, texts: Sequence[str], scale: float) -> str:
    cells = []
    for t, (text, advantage) in enumerate(zip(texts, response.advantages)):
        classes = ["tok"] + (["error"] if t == response.first_error else []) + ([] if response.in_loss[t] else ["out"])
        cells.append(f"<span class='{' '.join(classes)}' style='background:{advantage_colour(advantage, scale)}' "
                     f"title='token {t}: advantage {advantage:+.3f}'>{html.escape(text)}</span>")
    share = blame(list(response.advantages), response.first_error).on_error if response.first_error is not None else None
    note = "" if share is None else f" (blame on the error {share + 0.0:.2f})"  # no "-0.00"
    return f"<div class='name'>{html.escape(name)}{note}</div><div class='response'>{''.join(cells)}</div>"


PAGE_STYLE = """
body { font-family: sans-serif; margin: 1.5em; max-width: 70em; }
.response { font-family: monospace; white-space: pre-wrap; border: 1px solid #ddd; padding: .4em; margin: .2em 0 .8em;
            line-height: 1.8; }
.tok.error { outline: 2px solid #1f4fd8; }
.tok.out { opacity: .55; }
.name { font-size: .9em; color: #333; }
"""


def credit_page(examples: Sequence[tuple[str, dict[str, Response]]], decode, path: Path,
                images: Sequence[tuple[str, str]] = ()) -> Path:
    """One section per example (a title, and the same response under each estimator), tokens coloured
    by advantage (green positive, red negative), the first wrong token outlined, tokens outside the
    probability mask faded; ``images``: (caption, file name) shown after."""
    parts = ["<!doctype html><html><head><meta charset='utf-8'><title>Where the blame goes</title>",
             f"<style>{PAGE_STYLE}</style></head><body><h1>Where the blame goes</h1>",
             "<p>One wrong answer per task and setup, as each estimator hands it to the loss: green tokens get a "
             "positive advantage, red a negative one (stronger for larger, on one scale per answer); the first wrong "
             "token is outlined; faded tokens are outside the probability mask.</p>"]
    for title, by_estimator in examples:
        first = next(iter(by_estimator.values()))
        texts = [decode(token) for token in first.tokens]
        scale = max((abs(a) for r in by_estimator.values() for a in r.advantages), default=1.0) or 1.0
        parts.append(f"<h2>{html.escape(title)}</h2><p class='name'>reward {first.reward:g}, first wrong token "
                     f"{first.first_error}, {len(first.tokens)} tokens</p>")
        parts += [_token_row(name, response, texts, scale) for name, response in by_estimator.items()]
    for caption, image in images:
        parts.append(f"<h2>{html.escape(caption)}</h2><img src='{html.escape(image)}' alt='{html.escape(caption)}'>")
    parts.append("</body></html>")
    path.write_text("\n".join(parts))
    return path


def wrong_example(by_estimator: dict[str, list[Response]]) -> dict[str, Response] | None:
    """The first wrong answer, placed, that every estimator blames (gives some negative advantage),
    under each estimator."""
    names = list(by_estimator)
    for i, response in enumerate(by_estimator[names[0]]):
        if response.right or response.first_error is None:
            continue
        views = {name: by_estimator[name][i] for name in names}
        if all(any(a < 0 for a in r.advantages) for r in views.values()):
            return views
    return None
