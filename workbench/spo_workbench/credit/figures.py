"""What a person would rather look at than read: the value check's calibration plot, V along one wrong
response, and an HTML page with one wrong response per task and setup, its tokens coloured by each
estimator's advantage side by side, the first wrong token marked."""

from __future__ import annotations

import html
from collections.abc import Sequence
from pathlib import Path

from spo_verl.core.credit.blame import Response, blame
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
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


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
