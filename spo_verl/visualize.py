"""A self-contained HTML view of SPO segments: each response with its segments, their advantages,
and the tokens the probability mask trains, so a person can see where the credit went."""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence

import torch

from spo_verl.report.response_view import _colour

STYLE = """
body { font-family: sans-serif; margin: 1.5em; }
.response { font-family: monospace; white-space: pre-wrap; border: 1px solid #ddd; padding: .4em; margin: .3em 0 1em; }
.seg { border-right: 2px solid #444; padding: 1px 0; }
.masked { text-decoration: underline; font-weight: bold; }
.untrained { opacity: .45; }
.meta { color: #555; font-size: .85em; }
table { border-collapse: collapse; } td, th { border: 1px solid #ccc; padding: 2px 8px; text-align: right; }
"""


def render_segments_html(
    title: str,
    rows: Sequence[dict],
    responses: Sequence[Sequence[int]],
    rewards: Sequence[float],
    advantages: torch.Tensor,
    prob_mask: torch.Tensor,
    trained_mask: torch.Tensor,
    decode_token: Callable[[int], str],
    summary: dict[str, float] | None = None,
) -> str:
    """One block per response: segment boundaries as bars, background colour = segment advantage
    (green positive, red negative), underlined = in the probability mask, faded = not trained here."""
    scale = float(advantages.abs().max()) if advantages.numel() else 0.0
    parts = [f"<!doctype html><meta charset='utf-8'><title>{html.escape(title)}</title><style>{STYLE}</style>",
             f"<h1>{html.escape(title)}</h1>",
             "<p class='meta'>Bars separate segments. Background: the segment's advantage (green positive, red "
             "negative, stronger = larger). <span class='masked'>Bold underlined</span>: tokens in the probability "
             "mask. <span class='untrained'>Faded</span>: not trained in this row (the segment is trained by "
             "another leaf that shares it, or its advantage is 0). Hover a segment for its advantage.</p>"]
    if summary:
        parts.append("<table>" + "".join(
            f"<tr><th>{html.escape(k)}</th><td>{v:.4g}</td></tr>" for k, v in summary.items()) + "</table>")
    for row_index, (row, tokens, reward) in enumerate(zip(rows, responses, rewards)):
        ends = list(row.get("segment_ends", []))
        starts = [0] + ends[:-1]
        label = f"tree {row.get('tree_id', '')} path {row.get('path', '')}" if "path" in row else f"row {row_index}"
        parts.append(f"<div class='meta'>{html.escape(label)} &middot; reward {reward:g}</div><div class='response'>")
        for start, end in zip(starts, ends):
            seg_adv = next((float(advantages[row_index, t]) for t in range(start, end) if advantages[row_index, t] != 0), 0.0)
            parts.append(f"<span class='seg' style='background:{_colour(seg_adv, scale)}' title='advantage {seg_adv:+.4f}'>")
            for t in range(start, min(end, len(tokens))):
                classes = []
                if prob_mask[row_index, t]:
                    classes.append("masked")
                if not trained_mask[row_index, t]:
                    classes.append("untrained")
                parts.append(f"<span class='{' '.join(classes)}'>{html.escape(decode_token(tokens[t]))}</span>")
            parts.append("</span>")
        parts.append("</div>")
    return "".join(parts)
