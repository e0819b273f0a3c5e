"""The sample log: a few trained responses per step, the way a person wants to see them.

With ``algorithm.spo.diagnostics.sample_log.dir`` set, SPO's step (``spo_verl.adapters.trainer.step``, on
both trainers) calls this module after verl's advantage step, on the driver, for every algorithm (the
``grpo`` baselines too: plain responses, one segment each), and appends one JSON line per training step
to ``<dir>/samples.jsonl``. The cost is a handful of rows per step: which rows is decided from the uids
and lengths alone, and only those rows are fetched and decoded.
``python -m spo_workbench.report`` draws the segments and the tree from it.

One line (``step_record``)::

    {"step": 3, "algorithm": "spo_tree", "loss_mode": "spo_prob_mask",
     "prob_mask_threshold": 0.9,
     "prob_mask_applied": true,          # the loss trains only tokens with p_old < threshold
     "responses": [{
        "uid": "...", "prompt": "decoded prompt",
        "token_ids": [int], "tokens": ["decoded token"], "probs": [p_old per token],
        "in_prob_mask": [0|1],            # response_mask AND p_old < threshold (probability_mask)
        "advantages": [float],            # the advantage verl hands the loss, per token
        "trained": [0|1],                 # the token is in the loss (SPO-tree: its segment is trained by this row)
        "score": float,                   # the reward function's score of the response
        "truncated": bool | null,         # cut by the length limit (SPO rows only)
        "segments": [{"start": int, "end": int, "advantage": float,
                      "value_before": float | null, "value_after": float | null,
                      "cutpoint": bool,   # the segment starts at a low-probability cutpoint (SPO-chain)
                      "node": str | null, # SPO-tree node id
                      "trained": bool}],
        "boundary_values": [float],       # SPO-chain only: V before each segment start
        "environment": [0|1],             # multi-turn episodes only: the token is the environment's
                                          # (out of verl's response_mask), not the model's
        "episode": {"turns": int, "reply_tokens": int, "ended_by": str,
                    "environment_error": str | null}   # multi-turn episodes only
     }],
     "tree": {                            # spo_tree only: the whole tree of one prompt, every leaf a response
        "tree_id": str, "uid": str, "leaves": int,
        "nodes": [{"id": "root" | str, "parent": str | null, "depth": int, "text": str, "tokens": int,
                   "value": float, "advantage": float | null, "trained": bool,
                   "reward": float | null,       # leaves: the reward R the estimator used (V of the leaf)
                   "response": int | null}]}}    # leaves: index in "responses"

Probabilities, advantages and values are rounded to 6 decimals; the mask flags are computed before
rounding, with ``spo_verl.core.algorithms.masked_loss.probability_mask`` as the loss does.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

from spo_verl.core.algorithms.masked_loss import probability_mask
from spo_verl.core.algorithms.tree_rows import build_forest
from spo_verl.core.config import SPOSettings
from spo_verl.adapters.advantage_channel import TreeNodes, is_padding_uid
from spo_verl.adapters.estimators import scores_zero
from spo_verl.adapters.trainer.batch_view import SampledResponse
from spo_verl.core.metadata import ChainRow, SPORow, TreeLeafRow, from_extra_field

logger = logging.getLogger(__name__)

SAMPLES_FILE = "samples.jsonl"
DIGITS = 6


def _usable(index: int, uids, lengths, rows, padding) -> bool:
    if lengths[index] <= 0 or is_padding_uid(uids[index]):
        return False
    if padding is not None and padding[index]:
        return False
    row = from_extra_field(rows[index]) if rows is not None else None
    return not (isinstance(row, TreeLeafRow) and not row.trains)  # the legacy trainer's stand-in copies


def choose_rows(
    estimator: str,
    uids: Sequence[Any],
    lengths: Sequence[int],
    count: int,
    rows: Sequence[SPORow | None] | None = None,
    tree_nodes: TreeNodes | None = None,
    padding: Sequence[bool] | None = None,
) -> list[int]:
    """Batch rows to log. ``spo_tree``: every leaf of one tree, the first (in batch order) with a
    non-zero node advantage, else the first tree. Others: ``count`` rows, one per prompt first."""
    usable = [i for i in range(len(uids)) if _usable(i, uids, lengths, rows, padding)]
    if estimator == "spo_tree":
        if tree_nodes is None:
            return []
        forest = build_forest(tree_nodes.tree_ids, tree_nodes.paths)
        trees: dict[Any, list[int]] = {}
        for i in usable:
            if tree_nodes.tree_ids[i] is not None:
                trees.setdefault(tree_nodes.tree_ids[i], []).append(i)
        for members in trees.values():
            if any(float(tree_nodes.advantages[node]) != 0.0 for i in members for node in forest.row_nodes[i]):
                return members
        return next(iter(trees.values()), [])
    seen: dict[str, int] = {}
    rank = {}
    for i in usable:
        uid = str(uids[i])
        rank[i] = seen.get(uid, 0)
        seen[uid] = rank[i] + 1
    return sorted(usable, key=lambda i: (rank[i], i))[:count]


def _round(value: float | None) -> float | None:
    return None if value is None else round(float(value), DIGITS)


def _decode_tokens(tokenizer: Any, ids: Sequence[int]) -> list[str]:
    batch_decode = getattr(tokenizer, "batch_decode", None)
    pieces = [[int(t)] for t in ids]
    if batch_decode is not None:
        return list(batch_decode(pieces, skip_special_tokens=False, clean_up_tokenization_spaces=False))
    return [tokenizer.decode(piece) for piece in pieces]


def _decode(tokenizer: Any, ids: Sequence[int]) -> str:
    return tokenizer.decode([int(t) for t in ids], skip_special_tokens=False)


def _trajectory_reward(response: SampledResponse, settings: SPOSettings) -> float:
    """R as the SPO estimators take it (``algorithm.spo.truncated_response_score``)."""
    return 0.0 if scores_zero(response.row, settings) else response.score


def _any(mask: torch.Tensor, start: int, end: int) -> bool:
    return bool(mask[start:end].any()) if end > start else False


def chain_segments(response: SampledResponse, settings: SPOSettings) -> list[dict]:
    """Segments of an SPO-chain response: a head before the first start (advantage 0), then one
    segment per start with ``V`` before it and the next ``V`` (``R`` after the last) after it."""
    length = len(response.response_ids)
    row = response.row
    starts = [int(s) for s in row.segment_starts] if isinstance(row, ChainRow) else []
    values = [float(v) for v in row.boundary_values] if isinstance(row, ChainRow) else []
    cut = settings.chain.partition == "cutpoint"
    segments = []
    if not starts or starts[0] > 0:
        head_end = starts[0] if starts else length
        segments.append({"start": 0, "end": head_end, "advantage": 0.0, "value_before": None, "value_after": None,
                         "cutpoint": False, "node": None, "trained": _any(response.trained, 0, head_end)})
    after = values[1:] + [_trajectory_reward(response, settings)]
    for j, start in enumerate(starts):
        end = starts[j + 1] if j + 1 < len(starts) else length
        segments.append({
            "start": start, "end": end, "advantage": _round(response.advantages[start]) if start < length else 0.0,
            "value_before": _round(values[j]), "value_after": _round(after[j]), "cutpoint": cut, "node": None,
            "trained": _any(response.trained, start, end),
        })
    return segments


def tree_segments(response: SampledResponse, tree_nodes: TreeNodes, row_nodes: Sequence[int],
                  parents: Sequence[int]) -> list[dict]:
    """Segments of an SPO-tree leaf row: one per node of its root-to-leaf path."""
    row = response.row
    ends = [int(e) for e in row.segment_ends]
    segments = []
    start = 0
    for node_id, node, end in zip(row.path, row_nodes, ends):
        segments.append({
            "start": start, "end": end, "advantage": _round(tree_nodes.advantages[node]),
            "value_before": _round(tree_nodes.values[parents[node]]), "value_after": _round(tree_nodes.values[node]),
            "cutpoint": False, "node": str(node_id), "trained": _any(response.trained, start, end),
        })
        start = end
    return segments


def plain_segments(response: SampledResponse) -> list[dict]:
    """A response without SPO metadata (grpo, ppo): one segment, the first token's advantage."""
    length = len(response.response_ids)
    advantage = _round(response.advantages[0]) if length else 0.0
    return [{"start": 0, "end": length, "advantage": advantage, "value_before": None, "value_after": None,
             "cutpoint": False, "node": None, "trained": _any(response.trained, 0, length)}]


def response_record(response: SampledResponse, segments: list[dict], threshold: float, tokenizer: Any) -> dict:
    log_probs = response.log_probs.float()
    in_mask = probability_mask(log_probs, response.response_mask, threshold)
    record = {
        "uid": response.uid,
        "prompt": _decode(tokenizer, response.prompt_ids),
        "token_ids": [int(t) for t in response.response_ids],
        "tokens": _decode_tokens(tokenizer, response.response_ids),
        "probs": [_round(p) for p in log_probs.exp().tolist()],
        "in_prob_mask": [int(m) for m in in_mask.tolist()],
        "advantages": [_round(a) for a in response.advantages.tolist()],
        "trained": [int(t) for t in response.trained.bool().tolist()],
        "score": _round(response.score),
        "truncated": response.row.truncated if response.row is not None else None,
        "segments": segments,
    }
    if isinstance(response.row, ChainRow):
        record["boundary_values"] = [_round(v) for v in response.row.boundary_values]
    if response.episode is not None:
        record["environment"] = [int(m == 0) for m in response.response_mask.tolist()]
        record["episode"] = asdict(response.episode)
    return record


def tree_record(responses: Sequence[SampledResponse], records: Sequence[dict], tree_nodes: TreeNodes,
                forest_row_nodes: Sequence[Sequence[int]], parents: Sequence[int], tokenizer: Any) -> dict:
    """The tree the responses (all leaves of one tree) come from: every node once, root first."""
    first = responses[0]
    root = parents[forest_row_nodes[first.batch_index][0]]
    name = {root: "root"}
    nodes = {root: {"id": "root", "parent": None, "depth": 0, "text": records[0]["prompt"], "tokens": len(first.prompt_ids),
                    "value": _round(tree_nodes.values[root]), "advantage": None, "trained": False, "reward": None,
                    "response": None}}
    for r, (response, record) in enumerate(zip(responses, records)):
        path_nodes = forest_row_nodes[response.batch_index]
        for depth, (node, segment) in enumerate(zip(path_nodes, record["segments"]), start=1):
            name[node] = segment["node"]
            if node in nodes:
                nodes[node]["trained"] = nodes[node]["trained"] or segment["trained"]
                continue
            leaf = depth == len(path_nodes)
            start, end = segment["start"], segment["end"]
            nodes[node] = {
                "id": segment["node"], "parent": name[parents[node]], "depth": depth,
                "text": _decode(tokenizer, response.response_ids[start:end]), "tokens": end - start,
                "value": segment["value_after"], "advantage": segment["advantage"], "trained": segment["trained"],
                "reward": segment["value_after"] if leaf else None, "response": r if leaf else None,
            }
    ordered = sorted(nodes.values(), key=lambda n: n["depth"])  # stable: first appearance within a depth
    tree_id = first.row.tree_id if isinstance(first.row, TreeLeafRow) else None
    return {"tree_id": str(tree_id) if tree_id is not None else first.uid,
            "uid": first.uid, "leaves": len(responses), "nodes": ordered}


def step_record(
    step: int,
    estimator: str,
    loss_mode: str,
    responses: Sequence[SampledResponse],
    tokenizer: Any,
    settings: SPOSettings,
    tree_nodes: TreeNodes | None = None,
) -> dict:
    """One line of ``samples.jsonl`` for the chosen responses of a step (see the module docstring);
    ``estimator``: ``algorithm.adv_estimator``; ``loss_mode``: the actor's ``policy_loss.loss_mode``;
    ``settings``: the trainer's ``algorithm.spo``."""
    threshold = settings.prob_mask.threshold
    record: dict[str, Any] = {
        "step": int(step), "algorithm": estimator, "loss_mode": loss_mode, "prob_mask_threshold": threshold,
        "prob_mask_applied": loss_mode == "spo_prob_mask", "responses": [],
    }
    forest = None
    if estimator == "spo_tree" and tree_nodes is not None:
        forest = build_forest(tree_nodes.tree_ids, tree_nodes.paths)
        if len(forest.parents) != tree_nodes.values.numel():
            raise ValueError(f"sample log: the forest has {len(forest.parents)} nodes, the estimator's values "
                             f"{tree_nodes.values.numel()}")
    for response in responses:
        if forest is not None and isinstance(response.row, TreeLeafRow):
            segments = tree_segments(response, tree_nodes, forest.row_nodes[response.batch_index], forest.parents)
        elif estimator == "spo_chain" and response.row is not None:
            segments = chain_segments(response, settings)
        else:
            segments = plain_segments(response)
        record["responses"].append(response_record(response, segments, threshold, tokenizer))
    if forest is not None and responses:
        record["tree"] = tree_record(responses, record["responses"], tree_nodes, forest.row_nodes, forest.parents, tokenizer)
    return record


def append_record(directory: str | Path, record: dict) -> Path:
    path = Path(directory).expanduser()
    path.mkdir(parents=True, exist_ok=True)
    path = path / SAMPLES_FILE
    with path.open("a", encoding="utf-8") as handle:
        handle.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


def read_records(path: str | Path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text(encoding="utf-8").splitlines() if line.strip()]


def log_step(
    step: int,
    estimator: str,
    loss_mode: str,
    tokenizer: Any,
    uids: Sequence[Any],
    lengths: Sequence[int],
    fetch: Callable[[list[int]], list[SampledResponse]],
    spo_settings: SPOSettings,
    rows: Sequence[SPORow | None] | None = None,
    tree_nodes: TreeNodes | None = None,
    padding: Sequence[bool] | None = None,
) -> Path | None:
    """Choose the rows of a step, fetch them (``fetch(batch indices)``), write one line. Returns the
    file written, or None when the sample log is off or no row qualifies. ``estimator``, ``loss_mode``:
    as :func:`step_record` takes them; ``spo_settings``: the trainer's ``algorithm.spo``."""
    settings = spo_settings.diagnostics.sample_log
    if settings.dir is None:
        return None
    chosen = choose_rows(estimator, uids, lengths, settings.responses_per_step, rows=rows, tree_nodes=tree_nodes,
                         padding=padding)
    if not chosen:
        return None
    record = step_record(step, estimator, loss_mode, fetch(chosen), tokenizer, spo_settings,
                         tree_nodes=tree_nodes)
    try:
        return append_record(settings.dir, record)
    except OSError as error:  # a full disk or an unwritable folder does not stop training; a bug above does
        logger.warning("sample log: could not write step %s to %s: %s", step, settings.dir, error)
        return None
