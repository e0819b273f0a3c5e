"""Where each estimator puts the blame, measured on the same rollouts.

    python -m spo_verl.credit [--tasks steps2,steps4,steps6] [--prompts 32] [--setups study,cutpoint,wide]
                              [--output-dir docs/results/credit] [--quick] [--from-responses CSV]

For each task of the cpu-smollm2 setting (SmolLM2-135M-Instruct; the horizon tasks ``steps<k>`` work a
sum in k steps) and each SPO-tree configuration, one tree per held-out-style problem is sampled by the
``spo_tree`` agent loop on verl's vLLM server (CPU), every leaf scored by verl's GSM8K reward; on those
same leaves SPO-tree and verl's GRPO compute their advantages through verl's advantage step, and
SPO-tree once more with its values pooled over identical prefixes (``spo_verl.credit.rollouts``). Each wrong answer's first wrong step is placed as a token
(``spo_verl.cpu_settings.answer_errors``) and the blame measures are computed in three views (all
tokens, the tokens in the loss, the net advantage per unique token; ``spo_verl.credit.blame``) with
bootstrap intervals over prompts. Writes ``responses.csv`` (one row per response and estimator: the raw
material), ``summary.csv`` and ``table.md`` to ``--output-dir``.

``--quick``: the cpu-tiny setting ("What is a + b?", one worked step) and 8 prompts, in a few minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import gzip
import os
from dataclasses import dataclass
from pathlib import Path

from spo_verl.credit.blame import MEASURES, VIEWS, Response, bootstrap, paired_difference, summarise
from spo_verl.credit.rollouts import TreeSetup, groups_of

THRESHOLD = 0.9  # algorithm.spo.prob_mask.threshold
SMOLLM2_SETUPS = {
    # The study's tree: 2-2, a 10-token first segment (docs/RESULTS.md).
    "study": TreeSetup("study", (2, 2), (10,)),
    # A tree that forks at the policy's uncertain tokens (the study's spo_tree_cutpoint settings).
    "cutpoint": TreeSetup("cutpoint", (2, 2), (10,), branch_at="cutpoint",
                          cutpoint=("responses=2", "max_forks=1", "width=1", "interval=5")),
    # More leaves under each node: 2-4.
    "wide": TreeSetup("wide", (2, 4), (10,)),
}
QUICK_SETUPS = {"tiny": TreeSetup("tiny", (3, 3), (4,))}
COLUMNS = ("task", "horizon", "setup", "estimator", "prompt_uid", "response_id", "reward", "first_error_token",
           "length", "advantages", "in_loss", "trained", "tokens")


@dataclass(frozen=True)
class Task:
    name: str
    horizon: int
    model: str
    problems: list  # (uid, chat messages, ground truth)
    prompt_length: int
    response_length: int
    question: dict  # uid -> the problem's question, for the step checker


def smollm2_task(name: str, count: int) -> Task:
    from spo_verl.cpu_settings import smollm2
    from spo_verl.cpu_settings.answer_errors import expected_steps

    model = smollm2.build(smollm2.default_cache())["model"]
    drawn = smollm2.problems(count, smollm2.SEED + 1, name)  # held-out-style problems, never trained on here
    problems = [(f"p{i}", smollm2.messages(q, name), str(a)) for i, (q, a) in enumerate(drawn)]
    task = smollm2.TASKS[name]
    return Task(name, len(expected_steps(drawn[0][0])), model, problems, task.prompt_tokens, task.response_tokens,
                {f"p{i}": q for i, (q, _) in enumerate(drawn)})


def tiny_task(count: int) -> Task:
    from spo_verl.cpu_settings import tiny

    paths = tiny.build(Path(os.environ.get("SPO_CPU_CACHE", Path.home() / ".cache" / "spo-verl" / "cpu-tiny")))
    pairs = tiny.problems()[80 : 80 + count]  # the held-out problems
    problems = [(f"p{i}", [{"role": "user", "content": tiny.question(a, b)}], str(a + b)) for i, (a, b) in enumerate(pairs)]
    return Task("tiny_add", 1, paths["model"], problems, 64, 32,
                {f"p{i}": tiny.question(a, b) for i, (a, b) in enumerate(pairs)})


async def measure_task(task: Task, setups: list[TreeSetup]) -> list[tuple[TreeSetup, dict[str, list[Response]]]]:
    from transformers import AutoTokenizer

    from spo_verl.cpu_settings.answer_errors import first_error_token
    from spo_verl.credit.rollouts import sample_trees, tree_and_grpo_responses, tree_config
    from spo_verl.testing.verl_server import start_verl_server

    tokenizer = AutoTokenizer.from_pretrained(task.model)

    def locate(uid, texts, score):
        return first_error_token(task.question[uid], texts, score)[1]

    server = await start_verl_server(task.model, prompt_length=task.prompt_length, response_length=task.response_length)
    try:
        results = []
        for setup in setups:
            config = tree_config(task.model, setup, task.prompt_length, task.response_length)
            leaves = await sample_trees(config, server.client, tokenizer, task.problems)
            results.append((setup, tree_and_grpo_responses(leaves, config, tokenizer, THRESHOLD, locate)))
            print(f"credit: {task.name} {setup.name}: {len(leaves)} leaves of {len(task.problems)} trees", flush=True)
        return results
    finally:
        server.shutdown()


def _joined(values) -> str:
    return " ".join(f"{float(v):.6g}" if isinstance(v, float) else str(int(v)) for v in values)


def write_responses(path: Path, rows: list[tuple[Task, TreeSetup, str, Response]]) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(COLUMNS)
        for task, setup, estimator, r in rows:
            writer.writerow([task.name, task.horizon, setup.name, estimator, r.prompt_uid, r.response_id, r.reward,
                             "" if r.first_error is None else r.first_error, len(r.tokens), _joined(r.advantages),
                             _joined(r.in_loss), _joined(r.trained), _joined(r.tokens)])


def read_responses(path: Path) -> list[tuple[dict, Response]]:
    """``responses.csv`` (or its gzip, ``.csv.gz``) back as (its task columns, a :class:`Response`), to
    recompute the tables."""
    rows = []
    with (gzip.open(path, "rt", newline="") if str(path).endswith(".gz") else open(path, newline="")) as handle:
        for row in csv.DictReader(handle):
            numbers = lambda key, kind: tuple(kind(v) for v in row[key].split())  # noqa: E731
            rows.append((row, Response(row["prompt_uid"], row["response_id"], float(row["reward"]),
                                       numbers("tokens", int), numbers("advantages", float),
                                       tuple(bool(v) for v in numbers("in_loss", int)),
                                       tuple(bool(v) for v in numbers("trained", int)),
                                       int(row["first_error_token"]) if row["first_error_token"] else None)))
    return rows


def summary_rows(path: Path, resamples: int = 1000) -> list[dict]:
    """The measures of every (task, setup, estimator, view), recomputed from ``responses.csv``."""
    by_key: dict[tuple, list[Response]] = {}
    for row, response in read_responses(path):
        by_key.setdefault((row["task"], int(row["horizon"]), row["setup"], row["estimator"]), []).append(response)
    out = []
    for (task, horizon, setup, estimator), responses in by_key.items():
        groups = groups_of(responses)
        # What the trees generated: each distinct prefix of a prompt's responses is one generated token.
        generated = len({(r.prompt_uid, r.tokens[: t + 1]) for r in responses for t in range(len(r.tokens))})
        for view in VIEWS:
            summary = summarise(groups, view)
            intervals = bootstrap(groups, view, resamples=resamples)
            for measure in MEASURES:
                value = getattr(summary, measure)
                low, high = intervals.get(measure, (None, None))
                out.append({"task": task, "horizon": horizon, "setup": setup, "estimator": estimator, "view": view,
                            "measure": measure, "value": value, "low": low, "high": high, "prompts": len(groups),
                            "responses": len(responses), "generated_tokens": generated,
                            "wrong_placed": summary.wrong_placed, "wrong_not_placed": summary.wrong_not_placed,
                            "right": summary.right, "blamed": summary.blamed})
            baseline = by_key.get((task, horizon, setup, "grpo"))
            if estimator != "grpo" and baseline is not None:
                # On the same responses: this estimator's blame on the error minus GRPO's, per response.
                value, interval = paired_difference(groups, groups_of(baseline), view, resamples=resamples)
                out.append({**out[-1], "measure": "on_error_minus_grpo", "value": value,
                            "low": interval[0] if interval else None, "high": interval[1] if interval else None})
    return out


def write_summary(rows: list[dict], csv_path: Path, table_path: Path) -> None:
    with open(csv_path, "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    fmt = lambda v: "-" if v is None else f"{v:.2f}"  # noqa: E731
    lines = ["| task | k | setup | estimator | view | blame on the error | minus GRPO's, same responses | "
             "mean advantage on right steps | right steps net negative | wrong placed / not / right | blamed | tree tokens |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    cells: dict[tuple, dict] = {}
    for row in rows:
        cells.setdefault((row["task"], row["horizon"], row["setup"], row["estimator"], row["view"]), {})[row["measure"]] = row
    for (task, horizon, setup, estimator, view), measures in cells.items():
        text = []
        for name in ("on_error", "on_error_minus_grpo", "right_steps_mean", "right_steps_negative_share"):
            row = measures.get(name)
            text.append("-" if row is None else f"{fmt(row['value'])} [{fmt(row['low'])}, {fmt(row['high'])}]")
        counts = measures["on_error"]
        lines.append(f"| {task} | {horizon} | {setup} | {estimator} | {view} | " + " | ".join(text)
                     + f" | {counts['wrong_placed']} / {counts['wrong_not_placed']} / {counts['right']} | "
                     f"{counts['blamed']} | {counts['generated_tokens']} |")
    table_path.write_text("\n".join(lines) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spo_verl.credit", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default="steps2,steps4,steps6", help="cpu-smollm2 tasks (default: a horizon sweep)")
    parser.add_argument("--prompts", type=int, default=32, help="problems (one tree each) per task and setup")
    parser.add_argument("--setups", default=",".join(SMOLLM2_SETUPS), help=f"of {','.join(SMOLLM2_SETUPS)}")
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/credit"))
    parser.add_argument("--quick", action="store_true", help="cpu-tiny, 8 prompts: the pipeline in minutes")
    parser.add_argument("--from-responses", type=Path, help="sample nothing: recompute summary.csv and table.md "
                                                             "in --output-dir from this responses.csv")
    args = parser.parse_args(argv)
    if args.from_responses is not None:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        write_summary(summary_rows(args.from_responses), args.output_dir / "summary.csv", args.output_dir / "table.md")
        print((args.output_dir / "table.md").read_text(), end="")
        return 0
    from spo_verl.cpu_settings.smollm2 import TASKS

    if args.prompts < 2:
        parser.error(f"--prompts must be at least 2 (intervals are over prompts), got {args.prompts}")
    if args.quick:
        tasks, setups = [tiny_task(min(args.prompts, 8))], list(QUICK_SETUPS.values())
    else:
        names = [t for t in args.tasks.split(",") if t]
        unknown = [t for t in names if t not in TASKS]
        if unknown or not names:
            parser.error(f"--tasks must name tasks of the cpu-smollm2 setting ({','.join(TASKS)}), got {unknown or 'none'}")
        chosen = [s for s in args.setups.split(",") if s]
        if not chosen or any(s not in SMOLLM2_SETUPS for s in chosen):
            parser.error(f"--setups must be a non-empty subset of {','.join(SMOLLM2_SETUPS)}, got {args.setups!r}")
        tasks, setups = [smollm2_task(t, args.prompts) for t in names], [SMOLLM2_SETUPS[s] for s in chosen]
    from spo_verl.cpu_platform.environment import cpu_run_env

    os.environ.update({key: os.environ.get(key, value) for key, value in cpu_run_env().items()})
    args.output_dir.mkdir(parents=True, exist_ok=True)
    responses = args.output_dir / "responses.csv"
    rows = []
    for task in tasks:  # the files are rewritten after each task: a long sweep shows (and keeps) what it has
        for setup, views in asyncio.run(measure_task(task, setups)):
            rows += [(task, setup, estimator, r) for estimator, responses in views.items() for r in responses]
        write_responses(responses, rows)
        write_summary(summary_rows(responses), args.output_dir / "summary.csv", args.output_dir / "table.md")
    print((args.output_dir / "table.md").read_text(), end="")
    print(f"credit: {responses}, {args.output_dir / 'summary.csv'}, {args.output_dir / 'table.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
