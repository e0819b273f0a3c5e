"""The declared tuning rule of a study: each algorithm runs at the learning rate whose tuning run had the
highest held-out accuracy at the budget on the tuning problems (a tie: the lower rate). Reads the CSVs
``verdict --csv`` wrote for each swept rate, writes the choice, and prints it as ``compare.sh --lr``
takes it.

    python -m spo_workbench.study.tuning --rate 5e-6=tune_lr5e-6.csv --rate 1e-5=tune_lr1e-5.csv \\
        [--csv chosen_rates.csv]
"""

from __future__ import annotations

import argparse
import csv
from pathlib import Path


def read_sweep(rates: dict[str, Path]) -> dict[str, dict[str, float | None]]:
    """algorithm -> rate -> accuracy at the budget (None where the run did not reach it)."""
    sweep: dict[str, dict[str, float | None]] = {}
    for rate, path in rates.items():
        with open(path, newline="") as handle:
            for row in csv.DictReader(handle):
                value = row["accuracy_at_budget"]
                sweep.setdefault(row["algorithm"], {})[rate] = float(value) if value else None
    return sweep


def choose(sweep: dict[str, dict[str, float | None]]) -> dict[str, tuple[str, float]]:
    """algorithm -> (chosen rate, its accuracy). Rates compare as numbers; a run with no value at the
    budget is not a candidate; an algorithm with none is an error."""
    chosen = {}
    for algorithm, by_rate in sorted(sweep.items()):
        candidates = [(float(rate), rate, value) for rate, value in by_rate.items() if value is not None]
        if not candidates:
            raise ValueError(f"{algorithm}: no tuning run reached the budget (rates {sorted(by_rate)}); nothing to choose")
        best = max(value for _, _, value in candidates)
        _, rate, value = min(c for c in candidates if c[2] == best)  # the lowest rate among the best
        chosen[algorithm] = (rate, value)
    return chosen


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spo_workbench.study.tuning", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rate", action="append", required=True, metavar="LR=CSV",
                        help="a swept learning rate and the CSV of its runs' accuracy at the budget (repeat)")
    parser.add_argument("--csv", type=Path, help="write the choice here (algorithm, lr, tune_accuracy_at_budget)")
    args = parser.parse_args(argv)
    rates = {}
    for item in args.rate:
        rate, sep, path = item.partition("=")
        if not sep or not path:
            parser.error(f"--rate takes LR=CSV, got {item!r}")
        rates[rate] = Path(path)
    chosen = choose(read_sweep(rates))
    if args.csv:
        with open(args.csv, "w", newline="") as handle:
            writer = csv.writer(handle)
            writer.writerow(["algorithm", "lr", "tune_accuracy_at_budget"])
            writer.writerows([name, rate, f"{value:.6f}"] for name, (rate, value) in chosen.items())
    print(",".join(f"{name}={rate}" for name, (rate, _) in chosen.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
