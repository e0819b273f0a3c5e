"""python -m spo_workbench.report --run LABEL=METRICS_JSONL[,SAMPLES_JSONL] ... --output DIR [--title TITLE]

Writes DIR/accuracy_vs_step.png, accuracy_vs_generated_tokens.png, accuracy_vs_wall_time.png,
reward_vs_step.png, reward_vs_generated_tokens.png, reward_vs_wall_time.png, blame_on_error_vs_generated_tokens.png,
blame_on_error_masked_vs_generated_tokens.png, results.csv, summary.csv, groups.csv (per group of seeds: means and
standard errors), turns.csv (multi-turn runs' spo/turns/* metrics, when any run logged them), turns_credit.csv
(every turn of the sample logs' multi-turn episodes with its credit, spo_workbench.credit.turns) and report.html
(self-contained). Label seeds of one algorithm ``NAME/seed<k>``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from spo_workbench.credit.turns import turns_of_records
from spo_workbench.credit.turns import write_csv as write_turn_credit_csv
from spo_workbench.report.page import render_page
from spo_workbench.report.plots import write_plots
from spo_workbench.report.runs import load_run, parse_run_argument
from spo_workbench.report.tables import (summarize, summarize_groups, write_group_csv, write_results_csv, write_summary_csv,
                                         write_turns_csv)


def build_report(run_arguments: list[str], output: str | Path, title: str = "SPO versus GRPO",
                 responses: int = 4) -> dict[str, Path]:
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    runs = [load_run(*parse_run_argument(argument)) for argument in run_arguments]
    plots = write_plots(runs, output)
    summaries = [summarize(run) for run in runs]
    written = dict(plots)
    written["results.csv"] = write_results_csv(runs, output / "results.csv")
    written["summary.csv"] = write_summary_csv(summaries, output / "summary.csv")
    groups = summarize_groups(runs, summaries)
    written["groups.csv"] = write_group_csv(groups, output / "groups.csv")
    if (turns := write_turns_csv(runs, output / "turns.csv")) is not None:
        written["turns.csv"] = turns
    turn_credits = [row for run in runs for row in turns_of_records(run.samples, run.label, run.group, run.seed)]
    if turn_credits:
        written["turns_credit.csv"] = write_turn_credit_csv(turn_credits, output / "turns_credit.csv")
    page = output / "report.html"
    page.write_text(render_page(title, runs, summaries, plots, responses, groups, turn_credits), encoding="utf-8")
    written["report.html"] = page
    return written


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spo_workbench.report", description=__doc__.split("\n\n")[1])
    parser.add_argument("--run", action="append", required=True, metavar="LABEL=METRICS_JSONL[,SAMPLES_JSONL]",
                        help="one training run: a label, verl's file-logger JSONL and optionally its samples.jsonl")
    parser.add_argument("--output", required=True, help="folder for the plots, CSV files and report.html")
    parser.add_argument("--title", default="SPO versus GRPO")
    parser.add_argument("--responses", type=int, default=4, help="responses shown per run (default 4)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    written = build_report(args.run, args.output, args.title, args.responses)
    for name, path in written.items():
        print(f"report: {name} -> {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
