"""A self-contained HTML view of SPO segments: each response with its segments, their advantages,
and the tokens the probability mask trains, so a person can see where the credit went."""

from __future__ import annotations

import html
from collections.abc import Callable, Sequence

import torch

STYLE = """
body { font-family: sans-serif; margin: 1.5em; }
.response { font-family: monospace; white-space: pre-wrap; border: 1px solid #ddd; padding: .4em; margin: .3em 0 1em; }
.seg { border-right: 2px solid #444; padding: 1px 0; }
.masked { text-decoration: underline; font-weight: bold; }
.untrained { opacity: .45; }
.meta { color: #555; font-size: .85em; }
table { border-collapse: collapse; } td, th { border: 1px solid #ccc; padding: 2px 8px; text-align: right; }
"""


def _colour(advantage: float, scale: float) -> str:
    strength = min(abs(advantage) / scale, 1.0) if scale > 0 else 0.0
    alpha = 0.15 + 0.6 * strength if advantage != 0 else 0.0
    return f"rgba(0,160,0,{alpha:.2f})" if advantage > 0 else f"rgba(220,0,0,{alpha:.2f})"


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


# The view of one response from the sample log (spo_verl.trainer.sample_log), for the report.
LOGGED_STYLE = """
.response { font-family: monospace; white-space: pre-wrap; border: 1px solid #ddd; padding: .4em; margin: .3em 0 1em;
            line-height: 1.9; }
.seg { border-left: 2px solid #555; padding: 2px 0 2px 1px; }
.seg.cut { border-left: 4px solid #1f4fd8; }
.seg.cut::before { content: '\\2702'; color: #1f4fd8; font-size: .75em; vertical-align: super; }
.tok.masked { text-decoration: underline 2px; font-weight: bold; }
.tok.untrained { opacity: .45; }
"""


def advantage_colour(advantage: float | None, scale: float) -> str:
    """Background of a segment: green for a positive advantage, red for a negative one, stronger for larger."""
    return _colour(float(advantage or 0.0), scale)


def _number(value, digits: int = 4) -> str:
    return "-" if value is None else f"{value:+.{digits}f}"


def render_logged_response(record: dict, scale: float, show_prob_mask: bool) -> str:
    """One logged response as HTML: a bar before every segment (a thick blue one with a scissors mark
    where the segment starts at a low-probability cutpoint), the segment's background coloured by
    its advantage, tokens in the probability mask bold and underlined (when the loss uses the mask),
    tokens left out of the loss faded, and hover titles with the numbers."""
    tokens, probs = record["tokens"], record["probs"]
    parts = ["<div class='response'>"]
    for index, segment in enumerate(record["segments"]):
        classes = "seg cut" if segment.get("cutpoint") else "seg"
        node = f" (tree node {segment['node']})" if segment.get("node") is not None else ""
        title = (f"segment {index}{node}: tokens {segment['start']}-{segment['end'] - 1}, advantage "
                 f"{_number(segment['advantage'])}, V before {_number(segment.get('value_before'), 3)}, V after "
                 f"{_number(segment.get('value_after'), 3)}" + ("" if segment.get("trained") else ", not trained here"))
        parts.append(f"<span class='{classes}' style='background:{advantage_colour(segment['advantage'], scale)}' "
                     f"title='{html.escape(title, quote=True)}'>")
        for t in range(segment["start"], min(segment["end"], len(tokens))):
            token_classes = ["tok"]
            if show_prob_mask and record["in_prob_mask"][t]:
                token_classes.append("masked")
            if not record["trained"][t]:
                token_classes.append("untrained")
            token_title = f"p={probs[t]:.3f} advantage={_number(record['advantages'][t])}"
            parts.append(f"<span class='{' '.join(token_classes)}' title='{html.escape(token_title, quote=True)}'>"
                         f"{html.escape(tokens[t])}</span>")
        parts.append("</span>")
    parts.append("</div>")
    return "".join(parts)
