"""How a response from the sample log looks on the report page: its segments as bars, each coloured by
its advantage (with a colour scale that gives the numbers), the probability mask's tokens bold and
underlined, tokens outside the loss faded, hover titles with the numbers."""

from __future__ import annotations

import html

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


LOGGED_STYLE = """
.response { font-family: monospace; white-space: pre-wrap; border: 1px solid #ddd; padding: .4em; margin: .3em 0 1em;
            line-height: 1.9; }
.seg { border-left: 2px solid #555; padding: 2px 0 2px 1px; }
.seg.cut { border-left: 4px solid #1f4fd8; }
.seg.cut::before { content: '\\2702'; color: #1f4fd8; font-size: .75em; vertical-align: super; }
.tok.masked { text-decoration: underline 2px; font-weight: bold; }
.tok.untrained { opacity: .45; }
.tok.env { font-style: italic; color: #445; background: #e8ecf8; }
.turn { font-size: .7em; color: #333; vertical-align: super; margin-right: .2em; }
.swatch { display: inline-block; min-width: 4.2em; text-align: center; border: 1px solid #ccc; margin: 0 1px; }
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
    tokens left out of the loss faded, and hover titles with the numbers. In a multi-turn episode each
    segment is a turn, labelled with its values and advantage, and the environment's tokens are set
    apart (italic, on their own background)."""
    tokens, probs = record["tokens"], record["probs"]
    environment = record.get("environment")
    parts = ["<div class='response'>"]
    for index, segment in enumerate(record["segments"]):
        classes = "seg cut" if segment.get("cutpoint") else "seg"
        node = f" (tree node {segment['node']})" if segment.get("node") is not None else ""
        title = (f"segment {index}{node}: tokens {segment['start']}-{segment['end'] - 1}, advantage "
                 f"{_number(segment['advantage'])}, V before {_number(segment.get('value_before'), 3)}, V after "
                 f"{_number(segment.get('value_after'), 3)}" + ("" if segment.get("trained") else ", not trained here"))
        parts.append(f"<span class='{classes}' style='background:{advantage_colour(segment['advantage'], scale)}' "
                     f"title='{html.escape(title, quote=True)}'>")
        if environment is not None:
            parts.append(f"<span class='turn'>turn {index + 1}: V {_number(segment.get('value_before'), 2)} &rarr; "
                         f"{_number(segment.get('value_after'), 2)}, A {_number(segment['advantage'], 3)}</span>")
        for t in range(segment["start"], min(segment["end"], len(tokens))):
            token_classes = ["tok"]
            if environment is not None and environment[t]:
                parts.append(f"<span class='tok env' title='the environment&#x27;s token: not in the loss'>"
                             f"{html.escape(tokens[t])}</span>")
                continue
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


def colour_scale(scale: float, stops: int = 5) -> str:
    """The advantage colours with their numbers, from -scale to +scale."""
    if scale <= 0:
        return "<span class='meta'>every advantage shown is 0</span>"
    values = [scale * (2 * i / (stops - 1) - 1) for i in range(stops)]
    cells = "".join(f"<span class='swatch' style='background:{advantage_colour(v, scale)}'>{v:+.3g}</span>"
                    for v in values)
    return f"<span class='meta colour-scale'>advantage colour: {cells}</span>"
