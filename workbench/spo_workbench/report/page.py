"""The report's self-contained HTML page: plots embedded as base64 PNG, inline CSS, no external URL;
the summary table; for multi-turn runs, where the blame went per turn; per run, a few logged responses with their segments; one SPO tree per SPO-tree run
drawn as an inline SVG tree with each node's segment text, value V and advantage A."""

from __future__ import annotations

import base64
import html
from collections.abc import Mapping, Sequence
from pathlib import Path

from spo_workbench.credit.turns import TABLE_HEADER as TURN_TABLE_HEADER
from spo_workbench.credit.turns import TurnCredit
from spo_workbench.credit.turns import table_rows as turn_table_rows
from spo_workbench.report.runs import Run
from spo_workbench.report.tables import GroupSummary, Summary
from spo_workbench.report.response_view import LOGGED_STYLE, STYLE, advantage_colour, colour_scale, render_logged_response

PAGE_STYLE = STYLE + LOGGED_STYLE + """
body { max-width: 1500px; color: #222; }
h2 { margin-top: 1.6em; border-bottom: 1px solid #ccc; }
.plots { display: grid; grid-template-columns: repeat(2, minmax(0, 1fr)); gap: 12px; }
.plots img { width: 100%; border: 1px solid #ddd; }
.summary td:first-child, .summary th:first-child { text-align: left; }
.prompt { color: #444; font-family: monospace; white-space: pre-wrap; font-size: .85em; background: #f6f6f6;
          padding: .3em; }
.tree { overflow-x: auto; border: 1px solid #ddd; padding: 6px; }
.tree text { font-family: monospace; font-size: 11px; }
.legend span { padding: 0 .4em; }
"""

NODE_WIDTH, NODE_HEIGHT, X_GAP, Y_GAP = 176, 60, 10, 56
FIT_LEAVES = 12


def _number(value, fmt: str = "{:.3f}") -> str:
    return "-" if value is None else fmt.format(value)


def _short(text: str, limit: int, tail: bool = False) -> str:
    text = text.replace("\n", "\u23ce")
    if len(text) <= limit:
        return text
    return "\u2026" + text[-(limit - 1):] if tail else text[: limit - 1] + "\u2026"


def _image(path: Path) -> str:
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    return f"<img alt='{html.escape(path.stem)}' src='data:image/png;base64,{data}'>"


def _with_error(mean, error) -> str:
    return _number(mean) + ("" if error is None else f" &plusmn; {error:.3f}")


# The phases a reader compares (verl's timing_s/<phase>): three inside a step, the rest of the step as
# "other"; validation runs outside verl's step timer (both trainers), so it is a column of its own.
STEP_PHASES = {"gen": "generation", "old_log_prob": "old log-probs", "update_actor": "actor update"}


def _phase_header() -> list[str]:
    return [f"{label}, s" for label in STEP_PHASES.values()] + ["other in steps, s", "validation, s"]


def _phase_cells(steps_total: float, phases: Mapping[str, float]) -> list[str]:
    shown = [phases.get(phase) or 0.0 for phase in STEP_PHASES]
    other = max(steps_total - sum(shown), 0.0)
    return [f"{value:,.0f}" for value in [*shown, other, phases.get("testing") or 0.0]]


def group_table(groups: Sequence[GroupSummary]) -> str:
    """Per algorithm over its seeds: mean &plusmn; standard error (shown only when some group has several seeds)."""
    if not any(group.seeds > 1 for group in groups):
        return ""
    header = ["algorithm", "seeds", "base model held-out acc", "final held-out acc", "best held-out acc (after step 0)",
              "generated tokens (mean)", "trained tokens (mean)", "actor tokens per update (mean)", "steps (mean)",
              "wall time of steps, s (mean)", *_phase_header()]
    rows = ["<table class='summary'><tr>" + "".join(f"<th>{h}</th>" for h in header) + "</tr>"]
    for g in groups:
        cells = [html.escape(g.group), str(g.seeds), _number(g.base_heldout_accuracy),
                 _with_error(g.final_heldout_accuracy_mean, g.final_heldout_accuracy_se),
                 _with_error(g.best_heldout_accuracy_mean, g.best_heldout_accuracy_se),
                 f"{g.generated_tokens_mean:,.0f}",
                 "-" if g.trained_tokens_mean is None else f"{g.trained_tokens_mean:,.0f}",
                 "-" if g.actor_tokens_per_update_mean is None else f"{g.actor_tokens_per_update_mean:,.0f}",
                 f"{g.steps_mean:.1f}", f"{g.wall_time_s_mean:,.0f}",
                 *_phase_cells(g.wall_time_s_mean, g.phase_s_mean)]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    rows.append("</table><p class='meta'>&plusmn;: one standard error over seeds (sample standard deviation / "
                "&radic;seeds); it leaves out the held-out set's own sampling error. Trained tokens: spo/trained_tokens "
                "summed over the run (response tokens with a non-zero advantage, each tree segment once; SPO's "
                "estimators only, so - for verl's baselines). Actor tokens per update: spo/packing/packed_tokens, the tokens "
                "the actor's forward and backward computed in one optimizer update, averaged over the run's steps "
                "(packed training only; a prefix shared by several rows counted once). Wall time: verl's timing_s/step "
                 "summed over the run's steps, split by its timers (timing_s/gen, old_log_prob, update_actor; the "
                 "rest as other); validation (timing_s/testing, outside the step timer) beside it; means over "
                 "seeds.</p>")
    return "".join(rows)


def turn_credit_table(turns: Sequence[TurnCredit]) -> str:
    """Where the blame went per turn in the runs' logged episodes (``spo_workbench.credit.turns``);
    nothing without a multi-turn episode."""
    if not turns:
        return ""
    rows = ["<h2>Where the blame went per turn (the sample logs' episodes)</h2><table class='summary'><tr>"
            + "".join(f"<th>{html.escape(h)}</th>" for h in TURN_TABLE_HEADER) + "</tr>"]
    rows += ["<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in line) + "</tr>" for line in turn_table_rows(turns)]
    rows.append("</table><p class='meta'>Each logged episode's first wrong turn: the first of the model's turns "
                "whose number is not the running result. Each turn's credit: the advantage its estimator gave the "
                "segment holding it, on the model's tokens (a tree's turn shared by several leaves shown on each). "
                "Over the wrong episodes whose first turn was right (later): the share of their negative advantage "
                "on the wrong turn and after, the same over the probability mask's tokens, and the mean advantage "
                "of their right turns; per run, then &plusmn; one standard error over runs. Every turn in "
                "turns_credit.csv.</p>")
    return "".join(rows)


def summary_table(summaries: Sequence[Summary]) -> str:
    header = ["run", "algorithm", "steps", "base model held-out acc", "final held-out acc",
              "best held-out acc (after step 0)", "final training reward", "generated tokens", "wall time (s)",
              *_phase_header()]
    rows = ["<table class='summary'><tr>" + "".join(f"<th>{h}</th>" for h in header) + "</tr>"]
    for s in summaries:
        cells = [html.escape(s.run), html.escape(s.algorithm), str(s.steps), _number(s.base_heldout_accuracy),
                 _number(s.final_heldout_accuracy), _number(s.best_heldout_accuracy), _number(s.final_training_reward),
                 f"{s.total_generated_tokens:,.0f}", f"{s.total_wall_time_s:,.1f}",
                 *_phase_cells(s.total_wall_time_s, s.phase_s)]
        rows.append("<tr>" + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    rows.append("</table>")
    return "".join(rows)


def tree_svg(tree: Mapping) -> str:
    """The tree top-down: leaves side by side in path order, a parent above the middle of its children.
    Each box: the segment's text (shortened; hover for all of it), V and A; leaves also R, the reward
    the estimator used. Fill: the node's advantage; dashed border: the segment is not trained."""
    nodes = list(tree["nodes"])
    children: dict[str | None, list[dict]] = {}
    for node in nodes:
        children.setdefault(node["parent"], []).append(node)
    root = children[None][0]
    x_of: dict[str, float] = {}
    next_leaf = [0]

    def place(node: dict) -> float:
        kids = children.get(node["id"], [])
        if not kids:
            x_of[node["id"]] = next_leaf[0] * (NODE_WIDTH + X_GAP)
            next_leaf[0] += 1
        else:
            xs = [place(kid) for kid in kids]
            x_of[node["id"]] = (xs[0] + xs[-1]) / 2
        return x_of[node["id"]]

    place(root)
    depth = max(node["depth"] for node in nodes)
    width = max(next_leaf[0], 1) * (NODE_WIDTH + X_GAP)
    height = (depth + 1) * (NODE_HEIGHT + Y_GAP)
    scale = max((abs(n["advantage"]) for n in nodes if n["advantage"] is not None), default=0.0)
    y_of = {node["id"]: node["depth"] * (NODE_HEIGHT + Y_GAP) + 4 for node in nodes}
    # Small trees shrink to the page's width; big ones (e.g. 6-6-6) keep their size and scroll sideways.
    fit = " style='max-width:100%;height:auto'" if next_leaf[0] <= FIT_LEAVES else ""
    parts = [f"<svg class='spo-tree' width='{width + 8}' height='{height}' viewBox='-4 0 {width + 8} {height}'{fit} "
             f"role='img' aria-label='SPO tree {html.escape(str(tree.get('tree_id', '')))}'>"]
    for node in nodes:
        if node["parent"] is not None:
            x1, y1 = x_of[node["parent"]] + NODE_WIDTH / 2, y_of[node["parent"]] + NODE_HEIGHT
            x2, y2 = x_of[node["id"]] + NODE_WIDTH / 2, y_of[node["id"]]
            parts.append(f"<line x1='{x1:.1f}' y1='{y1}' x2='{x2:.1f}' y2='{y2}' stroke='#888' stroke-width='1.2'/>")
    for node in nodes:
        x, y = x_of[node["id"]], y_of[node["id"]]
        is_root = node["parent"] is None
        fill = "#eeeeee" if is_root else advantage_colour(node["advantage"], scale)
        dash = "" if is_root or node["trained"] else " stroke-dasharray='4 3'"
        label = "prompt" if is_root else f"node {node['id']}"
        full = (f"{label} (depth {node['depth']}, {node['tokens']} tokens): V={_number(node['value'], '{:.4f}')} "
                f"A={_number(node['advantage'], '{:+.4f}')}"
                + ("" if node["reward"] is None else f" R={_number(node['reward'], '{:g}')}")
                + ("" if is_root or node["trained"] else " (not trained)") + "\n" + node["text"])
        lines = [f"prompt, {node['tokens']} tokens" if is_root else _short(node["text"], 24),
                 f"V {_number(node['value'])}" + ("" if is_root else f"  A {_number(node['advantage'], '{:+.3f}')}"),
                 (f"{label}  R {_number(node['reward'], '{:g}')}" if node["reward"] is not None else label)]
        parts.append(f"<g class='node' data-node='{html.escape(str(node['id']))}'><title>{html.escape(full)}</title>"
                     f"<rect x='{x:.1f}' y='{y}' width='{NODE_WIDTH}' height='{NODE_HEIGHT}' rx='5' "
                     f"style='fill:{fill};stroke:#555;stroke-width:1.2'{dash}/>")
        for i, line in enumerate(lines):
            weight = " font-weight='bold'" if i == 1 else ""
            parts.append(f"<text x='{x + 6:.1f}' y='{y + 16 + 17 * i}'{weight}>{html.escape(line)}</text>")
        parts.append("</g>")
    parts.append("</svg>")
    return "".join(parts)


def _response_block(record: Mapping, response: Mapping, index: int, scale: float) -> str:
    length = len(response["tokens"])
    masked = sum(response["in_prob_mask"])
    trained = sum(response["trained"])
    # A trained token with advantage 0 (or, under the mask, p_old above the threshold) gets no gradient.
    in_loss = response["in_prob_mask"] if record.get("prob_mask_applied") else [1] * length
    moved = sum(1 for t in range(length) if response["trained"][t] and in_loss[t] and response["advantages"][t] != 0)
    cut_tokens = [f"{html.escape(repr(response['tokens'][s['start']]))} (p={response['probs'][s['start']]:.2f})"
                  for s in response["segments"] if s.get("cutpoint") and s["start"] < length]
    facts = [f"response {index}", f"uid {html.escape(str(response.get('uid', '')))}",
             f"score {_number(response.get('score'), '{:g}')}", f"{length} tokens", f"{len(response['segments'])} segment(s)",
             f"{masked} below p {record['prob_mask_threshold']:g}", f"{trained} in the loss",
             f"{moved} with a gradient (non-zero advantage{', in the mask' if record.get('prob_mask_applied') else ''})"]
    if response.get("truncated"):
        facts.append("truncated")
    episode = response.get("episode")
    if episode:
        facts.append(f"episode: {episode['turns']} turn(s) of the model, {episode['reply_tokens']} tokens of the "
                     f"environment (out of the loss), ended by {html.escape(str(episode['ended_by']))}"
                     + (f" ({html.escape(str(episode['environment_error']))})" if episode.get("environment_error") else ""))
    block = [f"<div class='meta'>{' &middot; '.join(facts)}</div>"]
    if cut_tokens:
        block.append(f"<div class='meta'>cutpoints (first token of each cut segment): {', '.join(cut_tokens)}</div>")
    block.append(render_logged_response(dict(response), scale, bool(record.get("prob_mask_applied"))))
    return "".join(block)


def samples_section(run: Run, responses_to_show: int) -> str:
    """The run's last logged step: its responses with segments, and its tree (spo_tree)."""
    if not run.samples:
        return ""
    record = run.samples[-1]
    responses = record["responses"][:responses_to_show]
    scale = max((abs(s["advantage"] or 0.0) for r in responses for s in r["segments"]), default=0.0)
    applied = record.get("prob_mask_applied")
    parts = [f"<h2>Responses of {html.escape(run.label)} ({html.escape(str(record.get('algorithm')))}), "
             f"step {record['step']}</h2>",
             f"<p class='meta'>Loss {html.escape(str(record.get('loss_mode')))}; probability mask p &lt; "
             f"{record['prob_mask_threshold']:g} {'applied by the loss' if applied else 'not used by this loss'}. "
             f"{len(record['responses'])} response(s) logged this step, {len(responses)} shown.</p>"]
    parts.append(f"<p>{colour_scale(scale)}</p>")
    previous_prompt = None
    for index, response in enumerate(responses):
        if response["prompt"] != previous_prompt:  # responses of one prompt are logged together
            parts.append(f"<div class='prompt'>prompt of response {index}"
                         f"{'' if index else ' and those after it until the next prompt'}: "
                         f"{html.escape(response['prompt'])}</div>")
            previous_prompt = response["prompt"]
        parts.append(_response_block(record, response, index, scale))
    if record.get("tree"):
        tree = record["tree"]
        parts.append(f"<h2>SPO tree of {html.escape(run.label)}, step {record['step']} (prompt uid "
                     f"{html.escape(str(tree.get('uid')))}, {tree['leaves']} leaves)</h2>")
        parts.append("<p class='meta'>Each box is a segment: its text (hover for all of it), V = mean of its "
                     "children's values (a leaf: its reward R), A = V - V(parent). Green positive, red negative; "
                     "dashed: not trained (advantage 0).</p>")
        root = next(node for node in tree["nodes"] if node["parent"] is None)
        parts.append(f"<div class='prompt'>prompt: {html.escape(root['text'])}</div>")
        parts.append(f"<div class='tree'>{tree_svg(tree)}</div>")
        parts.append(credit_section(record))
    return "".join(parts)


def grpo_advantages(rewards: Sequence[float]) -> list[float]:
    """GRPO's advantage of each response of one group: verl's own outcome estimator on these rewards."""
    import numpy as np
    import torch
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    scores = torch.zeros(len(rewards), 1)
    scores[:, 0] = torch.tensor(rewards, dtype=torch.float32)
    advantages, _ = compute_grpo_outcome_advantage(scores, torch.ones_like(scores),
                                                   np.array(["group"] * len(rewards), dtype=object))
    return [round(float(a), 6) for a in advantages[:, 0]]


def credit_section(record: Mapping) -> str:
    """The tree's responses twice: with SPO-tree's segment advantages, and with the one advantage GRPO
    would give all of a response's tokens for the same rewards (verl's GRPO estimator over the leaves)."""
    leaves = [node for node in record["tree"]["nodes"] if node.get("response") is not None]
    if len(leaves) < 2:
        return ""
    responses = [record["responses"][leaf["response"]] for leaf in leaves]
    grpo = grpo_advantages([leaf["reward"] for leaf in leaves])
    spo_scale = max((abs(s["advantage"] or 0.0) for r in responses for s in r["segments"]), default=0.0)
    scale = max([spo_scale, *map(abs, grpo)])
    parts = ["<h3>Where the credit goes: SPO-tree against GRPO on the same responses</h3>",
             "<p class='meta'>Each leaf of the tree above, first with the advantages SPO-tree trained it with "
             "(one per segment: the segment's value minus its parent's), then with GRPO's (verl's estimator "
             "on the same rewards: (R - group mean) / group std, one number for every token). Where "
             "sibling responses share a prefix, GRPO pushes the shared tokens up in one response and down "
             "in the other; SPO-tree gives a shared segment one advantage and credits the segments where "
             "the responses part. One colour scale for both.</p>",
             f"<p>{colour_scale(scale)}</p>"]
    for leaf, response, advantage in zip(leaves, responses, grpo):
        length = len(response["tokens"])
        as_grpo = {**response, "advantages": [advantage] * length, "trained": [1] * length,
                   "segments": [{"start": 0, "end": length, "advantage": advantage, "trained": True}]}
        parts.append(f"<div class='meta'>response {leaf['response']} (node {html.escape(str(leaf['id']))}), "
                     f"reward R {_number(leaf['reward'], '{:g}')}</div>")
        parts.append("<div class='meta'>SPO-tree</div>" + render_logged_response(dict(response), scale, False))
        parts.append(f"<div class='meta'>GRPO: A {advantage:+.3f}</div>" + render_logged_response(as_grpo, scale, False))
    return "".join(parts)


def legend() -> str:
    return ("<p class='meta legend'>Segments: a bar starts each segment; <span class='seg cut'>&nbsp;</span> a thick "
            "blue bar with scissors marks a cut at a low-probability token (SPO-chain cutpoint). Background: the "
            "segment's advantage (<span style='background:rgba(0,160,0,.6)'>positive</span>, "
            "<span style='background:rgba(220,0,0,.6)'>negative</span>, stronger = larger). "
            "<span class='tok masked'>Bold underlined</span>: in the probability mask (p_old below the threshold; "
            "shown when the loss uses it). <span class='tok untrained'>Faded</span>: not in this row's loss. Hover a "
            "token for p and its advantage, a bar for the segment's numbers.</p>")


def render_page(title: str, runs: Sequence[Run], summaries: Sequence[Summary], plots: Mapping[str, Path],
                responses_to_show: int = 4, groups: Sequence[GroupSummary] = (), turns: Sequence[TurnCredit] = ()) -> str:
    # File names only: the page is shared, the reader's machine has other paths.
    sources = "".join(
        f"<li>{html.escape(run.label)}: {html.escape(run.metrics_path.name)}"
        + (f", samples {html.escape(run.samples_path.name)}" if run.samples_path else "")
        + (f"; held-out accuracy from {html.escape(run.accuracy_key)}" if run.accuracy_key else "") + "</li>"
        for run in runs)
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>{html.escape(title)}</title>"
        f"<style>{PAGE_STYLE}</style></head><body>",
        f"<h1>{html.escape(title)}</h1>",
        f"<ul class='meta'>{sources}</ul>",
        "<p class='meta'>Training reward: verl's critic/score/mean. Generated tokens: everything the rollout "
        "generated for a step (SPO-tree: the tree's nodes; SPO-chain: responses plus Monte Carlo continuations; "
        "GRPO: responses). Numbers per step in results.csv.</p>",
        group_table(groups),
        summary_table(summaries),
        "<div class='plots'>" + "".join(_image(path) for path in plots.values()) + "</div>",
        turn_credit_table(turns),
        legend(),
    ]
    parts += [samples_section(run, responses_to_show) for run in runs]
    parts.append("</body></html>")
    return "".join(parts)
