"""Where each estimator puts the blame, measured on the same rollouts, and the Monte Carlo values checked.

    python -m spo_workbench.credit [--tasks steps2,steps4,steps6] [--prompts 32]
                              [--setups study,cutpoint,wide,chain,6_6_6,int5_mc9]
                              [--value-prefixes 200] [--reference-samples 32] [--value-tasks TASKS]
                              [--output-dir outputs/credit] [--quick] [--from-responses CSV [CSV ...]]

For each task of the cpu-smollm2 setting (SmolLM2-135M-Instruct; the horizon tasks ``steps<k>`` work a
sum in k steps) and each configuration, rollouts of held-out-style problems are sampled on verl's vLLM
server (CPU), every response scored by verl's GSM8K reward: one tree a problem by the ``spo_tree``
agent loop for the tree setups, ``rollout.n`` chains a problem by the ``spo_chain`` agent loop for the
chain setup. On those same responses SPO-tree (or SPO-chain) and verl's GRPO compute their advantages
through verl's advantage step, and SPO-tree once more with its values pooled over identical prefixes
(``spo_workbench.credit.rollouts``). Each wrong answer's first wrong step is placed as a token
(``spo_verl.core.credit.answer_errors``) and the blame measures are computed in three views (all
tokens, the tokens in the loss, the net advantage per unique token; ``spo_verl.core.credit.blame``) with
bootstrap intervals over prompts. On the chains of ``--value-tasks``, the chain's Monte Carlo values of
at least ``--value-prefixes`` prefixes are checked against ``--reference-samples`` continuations each
(``spo_workbench.credit.values``).

Writes to ``--output-dir``: ``responses.csv`` (one row per response and estimator: the raw material),
``summary.csv`` and ``table.md``; ``values.csv`` and ``values.md``; ``credit.html`` (one wrong answer per
task and setup under each estimator, the value plots). Each task's files are kept under ``tasks/`` as it
finishes, so a stopped sweep, started again with the same arguments, resumes at the next task.

``--quick``: the cpu-tiny setting ("What is a + b?", one worked step), 8 prompts, a small value check,
in a few minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import gzip
import os
from dataclasses import dataclass
from pathlib import Path

from spo_verl.core.credit.blame import MEASURES, VIEWS, Response, bootstrap, groups_of, paired_difference, summarise
from spo_workbench.credit.rollouts import PAPER_CHAIN, ChainSetup, TreeSetup, paper_tree

THRESHOLD = 0.9  # algorithm.spo.prob_mask.threshold
SMOLLM2_SETUPS = {
    # The study's tree: 2-2, a 10-token first segment (docs/RESULTS.md).
    "study": TreeSetup("study", (2, 2), (10,)),
    # A tree that forks at the policy's uncertain tokens (the study's spo_tree_cutpoint settings).
    "cutpoint": TreeSetup("cutpoint", (2, 2), (10,), branch_at="cutpoint",
                          cutpoint=("responses=2", "max_forks=1", "width=1", "interval=5")),
    # More leaves under each node: 2-4.
    "wide": TreeSetup("wide", (2, 4), (10,)),
    # SPO-chain as the study ran it: 4 responses a prompt, cutpoints every 5 tokens, 4 MC samples.
    "chain": ChainSetup("chain", responses=4, cutpoint_interval=5, mc_samples=4),
    # The paper's shapes: the 6-6-6 tree, its segments scaled to each task's answers, and int5 with 9 MC samples.
    "6_6_6": paper_tree,
    "int5_mc9": PAPER_CHAIN,
}


def setup_for(setup, task: str):
    """``setup`` as ``task`` samples it: a setup whose shape follows the task is a function of its name."""
    return setup(task) if callable(setup) else setup
QUICK_SETUPS = {"tiny": TreeSetup("tiny", (3, 3), (4,)),
                "tiny_chain": ChainSetup("tiny_chain", responses=3, cutpoint_interval=1, mc_samples=4)}
COLUMNS = ("task", "horizon", "setup", "estimator", "prompt_uid", "response_id", "reward", "first_error_token",
           "length", "advantages", "in_loss", "trained", "tokens", "mc_tokens")


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
    from recipe.spo.cpu_settings import smollm2
    from spo_verl.core.credit.answer_errors import expected_steps

    model = smollm2.build(smollm2.default_cache())["model"]
    drawn = smollm2.problems(count, smollm2.SEED + 1, name)  # held-out-style problems, never trained on here
    problems = [(f"p{i}", smollm2.messages(q, name), str(a)) for i, (q, a) in enumerate(drawn)]
    task = smollm2.TASKS[name]
    return Task(name, len(expected_steps(drawn[0][0])), model, problems, task.prompt_tokens, task.response_tokens,
                {f"p{i}": q for i, (q, _) in enumerate(drawn)})


def tiny_task(count: int) -> Task:
    from recipe.spo.cpu_settings import tiny

    paths = tiny.build(Path(os.environ.get("SPO_CPU_CACHE", Path.home() / ".cache" / "spo-verl" / "cpu-tiny")))
    pairs = tiny.problems()[80 : 80 + count]  # the held-out problems
    problems = [(f"p{i}", [{"role": "user", "content": tiny.question(a, b)}], str(a + b)) for i, (a, b) in enumerate(pairs)]
    return Task("tiny_add", 1, paths["model"], problems, 64, 32,
                {f"p{i}": tiny.question(a, b) for i, (a, b) in enumerate(pairs)})


@dataclass(frozen=True)
class ValueCheck:
    """Check the chain's Monte Carlo values on at least ``prefixes`` prefixes against ``reference_samples``
    continuations each."""

    prefixes: int
    reference_samples: int


async def measure_task(task: Task, setups: list, value_check: ValueCheck | None = None, client=None):
    """Sample every setup's rollouts of ``task`` on one verl server, its own unless ``client`` is that of
    a server already serving ``task.model``; returns, per setup, the estimators' views of the responses,
    and the value check's rows (on the chain setup's responses)."""
    from transformers import AutoTokenizer

    from spo_verl.core.credit.answer_errors import first_error_token
    from spo_workbench.credit.rollouts import (chain_and_grpo_responses, gsm8k_score, rollout_config, sample_rollouts,
                                                tree_and_grpo_responses)
    from spo_workbench.credit.values import choose_prefixes, value_prefixes
    from spo_workbench.testing.verl_server import start_verl_server

    tokenizer = AutoTokenizer.from_pretrained(task.model)

    def locate(uid, texts, score):
        return first_error_token(task.question[uid], texts, score)[1]

    server = None
    if client is None:
        server = await start_verl_server(task.model, prompt_length=task.prompt_length, response_length=task.response_length)
        client = server.client
    try:
        results, value_rows = [], []
        for setup in setups:
            config = rollout_config(task.model, setup, task.prompt_length, task.response_length)
            leaves = await sample_rollouts(config, client, tokenizer, task.problems)
            chain = isinstance(setup, ChainSetup)
            views = (chain_and_grpo_responses if chain else tree_and_grpo_responses)(leaves, config, tokenizer,
                                                                                      THRESHOLD, locate)
            results.append((setup, views))
            print(f"credit: {task.name} {setup.name}: {len(leaves)} responses of {len(task.problems)} prompts", flush=True)
            if chain and value_check is not None:
                first_errors = [r.first_error for r in views["spo_chain"]]
                chosen = choose_prefixes([leaf.output.extra_fields["spo"]["segment_starts"] for leaf in leaves],
                                         first_errors, [leaf.uid for leaf in leaves], value_check.prefixes)
                truths = {uid: truth for uid, _, truth in task.problems}

                async def score(token_ids, uid):
                    return gsm8k_score(tokenizer.decode(token_ids, skip_special_tokens=True), truths[uid])

                value_rows += await value_prefixes(
                    client, leaves, chosen, score, estimate_samples=setup.mc_samples,
                    reference_samples=value_check.reference_samples, response_length=task.response_length,
                    eos_token_ids={tokenizer.eos_token_id}, first_errors=first_errors)
                print(f"credit: {task.name}: {len(chosen)} prefixes valued", flush=True)
        return results, value_rows
    finally:
        if server is not None:
            server.shutdown()


def keep_task(parts: Path, task: Task, results, value_rows) -> None:
    """``measure_task``'s results as the task's files under ``parts``, the responses' file last (renamed
    into place): a sweep started again keeps a task whose responses are there."""
    from spo_workbench.credit.values import write_values

    rows = [(task, setup, estimator, r) for setup, views in results for estimator, responses in views.items()
            for r in responses]
    if value_rows:
        write_values(parts / f"{task.name}-values.csv", [(task.name, row) for row in value_rows])
    write_responses(parts / f"{task.name}.partial", rows)
    (parts / f"{task.name}.partial").rename(parts / f"{task.name}.csv")


def _joined(values) -> str:
    return " ".join(f"{float(v):.6g}" if isinstance(v, float) else str(int(v)) for v in values)


def write_responses(path: Path, rows: list[tuple[Task, TreeSetup, str, Response]]) -> None:
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(COLUMNS)
        for task, setup, estimator, r in rows:
            writer.writerow([task.name, task.horizon, setup.name, estimator, r.prompt_uid, r.response_id, r.reward,
                             "" if r.first_error is None else r.first_error, len(r.tokens), _joined(r.advantages),
                             _joined(r.in_loss), _joined(r.trained), _joined(r.tokens), r.mc_tokens])


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
                                       int(row["first_error_token"]) if row["first_error_token"] else None,
                                       int(row.get("mc_tokens") or 0))))
    return rows


def summary_rows(path: Path, resamples: int = 1000) -> list[dict]:
    """The measures of every (task, setup, estimator, view), recomputed from ``responses.csv``."""
    by_key: dict[tuple, list[Response]] = {}
    for row, response in read_responses(path):
        by_key.setdefault((row["task"], int(row["horizon"]), row["setup"], row["estimator"]), []).append(response)
    out = []
    for (task, horizon, setup, estimator), responses in by_key.items():
        groups = groups_of(responses)
        # What the rollouts generated: each distinct prefix of a prompt's responses is one generated token
        # (a tree generates a shared prefix once), and SPO-chain's Monte Carlo continuations.
        generated = (len({(r.prompt_uid, r.tokens[: t + 1]) for r in responses for t in range(len(r.tokens))})
                     + sum(r.mc_tokens for r in responses))
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
             "mean advantage on right steps | right steps net negative | wrong placed / not / right | blamed | generated tokens |",
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


def write_views(output_dir: Path, decode) -> None:
    """``credit.html`` (one wrong answer per task and setup under each estimator, beside the value
    plots) and the value plots, from the files in ``output_dir``."""
    from spo_workbench.credit.figures import along_plot, along_response, calibration_plot, credit_page, wrong_example

    by_key: dict[tuple[str, str], dict[str, list[Response]]] = {}
    for row, response in read_responses(_responses_file(output_dir)):
        by_key.setdefault((row["task"], row["setup"]), {}).setdefault(row["estimator"], []).append(response)
    examples = [(f"{task}, {setup}", example) for (task, setup), views in by_key.items()
                if (example := wrong_example(views)) is not None]
    images = []
    values_file = output_dir / "values.csv"
    if values_file.exists():
        from spo_workbench.credit.values import read_values

        values = read_values(values_file)
        images.append(("Monte Carlo values against the reference", calibration_plot(values, output_dir / "values_calibration.png").name))
        task = values[0][0]
        response = along_response([row for t, row in values if t == task])
        if response is not None:  # the values are of the task's chains: its response ids are the chains'
            tokens = next(r.tokens for (t, _), views in by_key.items() if t == task
                          for r in views.get("spo_chain", []) if r.response_id == response[0].response_id)
            images.append((f"V along one wrong answer of {task} ({response[0].response_id})",
                           along_plot(response, "".join(decode(t) for t in tokens), output_dir / "values_along.png").name))
    credit_page(examples, decode, output_dir / "credit.html", images)


def _responses_file(output_dir: Path) -> Path:
    plain = output_dir / "responses.csv"
    return plain if plain.exists() else output_dir / "responses.csv.gz"


def _decoder(model: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    return lambda token: tokenizer.decode([token])


def _recompute(output_dir: Path, responses: Path) -> None:
    write_summary(summary_rows(responses), output_dir / "summary.csv", output_dir / "table.md")
    values_file = output_dir / "values.csv"
    if values_file.exists():
        from spo_workbench.credit.values import read_values, write_value_table

        write_value_table(read_values(values_file), output_dir / "values.md")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spo_workbench.credit", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tasks", default="steps2,steps4,steps6", help="cpu-smollm2 tasks (default: a horizon sweep)")
    parser.add_argument("--prompts", type=int, default=32, help="problems (one tree each) per task and setup")
    parser.add_argument("--setups", default="study,cutpoint,wide,chain",
                        help=f"of {','.join(SMOLLM2_SETUPS)} (default: all but the paper's shapes, whose trees cost 5,000 tokens a prompt)")
    parser.add_argument("--value-prefixes", type=int, default=200,
                        help="check the chain's Monte Carlo values on this many prefixes of each task's chains (0: no check)")
    parser.add_argument("--reference-samples", type=int, default=32, help="continuations of each checked prefix's reference value")
    parser.add_argument("--value-tasks", default=None, help="the tasks whose values are checked (default: the first of --tasks)")
    parser.add_argument("--output-dir", type=Path, default=Path("outputs/credit"))
    parser.add_argument("--quick", action="store_true", help="cpu-tiny, 8 prompts: the pipeline in minutes")
    parser.add_argument("--from-responses", type=Path, help="sample nothing: recompute summary.csv and table.md "
                                                             "(and values.md from a values.csv there) in --output-dir "
                                                             "from this responses.csv (or .csv.gz)")
    args = parser.parse_args(argv)
    if args.from_responses is not None:
        args.output_dir.mkdir(parents=True, exist_ok=True)
        _recompute(args.output_dir, args.from_responses)
        print((args.output_dir / "table.md").read_text(), end="")
        return 0
    from recipe.spo.cpu_settings.smollm2 import TASKS

    if args.prompts < 2:
        parser.error(f"--prompts must be at least 2 (intervals are over prompts), got {args.prompts}")
    if args.reference_samples < 2 or args.value_prefixes < 0:
        parser.error(f"--reference-samples must be at least 2 and --value-prefixes at least 0, got "
                     f"{args.reference_samples} and {args.value_prefixes}")
    if args.quick:
        tasks, setups = [tiny_task(min(args.prompts, 8))], list(QUICK_SETUPS.values())
        value_tasks = {"tiny_add"}
        check = ValueCheck(min(args.value_prefixes, 12), min(args.reference_samples, 8)) if args.value_prefixes else None
    else:
        names = [t for t in args.tasks.split(",") if t]
        value_tasks = set(names[:1] if args.value_tasks is None else [t for t in args.value_tasks.split(",") if t])
        unknown = [t for t in [*names, *value_tasks] if t not in TASKS]
        if unknown or not names:
            parser.error(f"--tasks and --value-tasks must name tasks of the cpu-smollm2 setting ({','.join(TASKS)}), "
                         f"got {unknown or 'none'}")
        chosen = [s for s in args.setups.split(",") if s]
        if not chosen or any(s not in SMOLLM2_SETUPS for s in chosen):
            parser.error(f"--setups must be a non-empty subset of {','.join(SMOLLM2_SETUPS)}, got {args.setups!r}")
        tasks, setups = [smollm2_task(t, args.prompts) for t in names], [SMOLLM2_SETUPS[s] for s in chosen]
        check = ValueCheck(args.value_prefixes, args.reference_samples) if args.value_prefixes else None
    from spo_verl.adapters.cpu_platform.environment import cpu_run_env
    from spo_workbench.credit.values import read_values, write_values

    os.environ.update({key: os.environ.get(key, value) for key, value in cpu_run_env().items()})
    parts = args.output_dir / "tasks"
    parts.mkdir(parents=True, exist_ok=True)
    for task in tasks:  # each task's files are kept as it finishes: a stopped sweep resumes at the next task
        done = parts / f"{task.name}.csv"
        if done.exists():
            print(f"credit: {task.name}: kept from {done}", flush=True)
            continue
        task_setups = [setup_for(setup, task.name) for setup in setups]
        keep_task(parts, task, *asyncio.run(measure_task(task, task_setups, check if task.name in value_tasks else None)))
    # The sweep's files: every task's, in the order of --tasks.
    responses = args.output_dir / "responses.csv"
    with open(responses, "w") as out:
        for i, task in enumerate(tasks):
            lines = (parts / f"{task.name}.csv").read_text().splitlines(keepends=True)
            out.writelines(lines if i == 0 else lines[1:])
    value_parts = [parts / f"{task.name}-values.csv" for task in tasks if (parts / f"{task.name}-values.csv").exists()]
    if value_parts:
        write_values(args.output_dir / "values.csv", [row for part in value_parts for row in read_values(part)])
    _recompute(args.output_dir, responses)
    write_views(args.output_dir, _decoder(tasks[0].model))
    print((args.output_dir / "table.md").read_text(), end="")
    if value_parts:
        print((args.output_dir / "values.md").read_text(), end="")
    print(f"credit: {responses}, summary.csv, table.md, values.csv, values.md, credit.html in {args.output_dir}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
