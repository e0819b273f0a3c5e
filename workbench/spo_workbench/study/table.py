"""The study's final table with both sources of uncertainty: the seeds (runs differ in their data
order and their samples) and the held-out problems (a finite set, the same for every run).

    python -m spo_workbench.study.table --output-dir outputs/study-cpu-smollm2 [--reference grpo]

Reads each run's validation dumps (``<algorithm>/seed<k>/validation/<step>.jsonl``: one line per
held-out answer with its ``input`` and ``score``; the study keeps them) and prints, per algorithm:
the base model's accuracy (the validation before training), the final accuracy (the last validation)
as a mean over seeds, and the gain over the base model with

* ``se seeds``: the standard error of the per-seed gains (sample std / sqrt(seeds));
* ``se problems``: the paired standard error over problems of the per-problem gain averaged over
  seeds (each problem's answer after training against its base answer, so the problems' difficulty
  cancels);
* ``se``: both combined, sqrt(se_seeds^2 + se_problems^2), the figure the gain is compared with.

Then each algorithm against ``--reference`` (final accuracy minus the reference's, the same
standard errors, problems paired across the two). The last line of stdout is the JSON of it all.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from spo_workbench.standard_error import standard_error
from spo_workbench.study.archive import problem_of


def read_dump(path: Path) -> dict[str, float]:
    """Score of each held-out problem (keyed as the archive keys it) in one greedy validation dump, which
    answers each problem once: two answers under one key are two problems it cannot tell apart, and
    pairing either with its base answer would be wrong, so they are refused."""
    scores = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            problem = problem_of(record)
            if problem in scores:
                raise ValueError(f"{path}: two answers to problem {problem}: its held-out problems share a prompt "
                                 "and the dump does not tell them apart (a multi-turn episode's line names its row "
                                 "in 'problem')")
            scores[problem] = float(record["score"])
    return scores


def first_and_last(run: Path) -> tuple[dict[str, float], dict[str, float], int] | None:
    dumps = sorted((run / "validation").glob("*.jsonl"), key=lambda p: int(p.stem) if p.stem.isdigit() else -1)
    if len(dumps) < 2 or dumps[0].stem != "0":
        return None
    return read_dump(dumps[0]), read_dump(dumps[-1]), int(dumps[-1].stem)


@dataclass(frozen=True)
class RunScores:
    """One run's held-out scores before training (``base``) and at its last validation (``final``,
    at ``step``)."""

    folder: Path
    base: dict[str, float]
    final: dict[str, float]
    step: int


def read_runs(runs: dict[str, list[Path]]) -> dict[str, list[RunScores]]:
    """Every run's first and last validation dump, each read once; runs without both are left out, and
    so is an algorithm with none."""
    read: dict[str, list[RunScores]] = {}
    for name, folders in runs.items():
        scores = [RunScores(folder, *pair) for folder in folders if (pair := first_and_last(folder)) is not None]
        if scores:
            read[name] = scores
    return read


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


@dataclass
class Row:
    name: str
    seeds: int
    problems: int
    base: float
    final_mean: float
    final_se_seeds: float | None
    gain: float
    gain_se_seeds: float | None
    gain_se_problems: float
    gain_se: float
    final_steps: list[int]


def _combined(se_seeds: float | None, se_problems: float) -> float:
    return math.sqrt((se_seeds or 0.0) ** 2 + se_problems ** 2)


def _paired(per_problem: list[float]) -> float:
    return standard_error(per_problem) or 0.0


def summarize(read: dict[str, list[RunScores]]) -> dict[str, Row]:
    """``read``: algorithm -> its seeds' scores (:func:`read_runs`)."""
    rows = {}
    for name, scores in read.items():
        problems = sorted(set.intersection(*(set(run.base) & set(run.final) for run in scores)))
        base = {p: _mean([run.base[p] for run in scores]) for p in problems}  # greedy: the same in every run
        finals = [_mean([run.final[p] for p in problems]) for run in scores]
        gains = [final - _mean(list(base.values())) for final in finals]
        per_problem_gain = [_mean([run.final[p] for run in scores]) - base[p] for p in problems]
        se_problems = _paired(per_problem_gain)
        rows[name] = Row(name, len(scores), len(problems), _mean(list(base.values())), _mean(finals), standard_error(finals),
                         _mean(gains), standard_error(gains), se_problems, _combined(standard_error(gains), se_problems),
                         [run.step for run in scores])
    return rows


def difference(read: dict[str, list[RunScores]], name: str, reference: str) -> dict | None:
    """Final accuracy of ``name`` minus ``reference``'s, seeds unpaired, problems paired."""
    ours, theirs = read.get(name, []), read.get(reference, [])
    if not ours or not theirs:
        return None
    problems = sorted(set.intersection(*(set(run.final) for run in ours + theirs)))
    ours_final = [_mean([run.final[p] for p in problems]) for run in ours]
    theirs_final = [_mean([run.final[p] for p in problems]) for run in theirs]
    se_seeds = None
    if len(ours) > 1 and len(theirs) > 1:
        se_seeds = math.sqrt(standard_error(ours_final) ** 2 + standard_error(theirs_final) ** 2)
    per_problem = [_mean([run.final[p] for run in ours]) - _mean([run.final[p] for run in theirs]) for p in problems]
    se_problems = _paired(per_problem)
    return {"algorithm": name, "reference": reference, "difference": _mean(ours_final) - _mean(theirs_final),
            "se_seeds": se_seeds, "se_problems": se_problems, "se": _combined(se_seeds, se_problems)}


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def study_runs(output_dir: Path) -> dict[str, list[Path]]:
    runs: dict[str, list[Path]] = {}
    for folder in sorted(output_dir.glob("*/seed*")):
        if (folder / "validation").is_dir():
            runs.setdefault(folder.parent.name, []).append(folder)
    return runs


def export_answers(read: dict[str, list[RunScores]], path: Path) -> Path:
    """Every held-out answer's score at each run's first and last validation, one CSV row each
    (``problem``: the answer's position among the sorted problem keys, the same in every run), so the table can be recomputed
    without the dumps."""
    import csv

    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["algorithm", "seed", "step", "problem", "score"])
        for name, scores in read.items():
            for run in scores:
                order = {prompt: i for i, prompt in enumerate(sorted(run.base))}
                for at, answers in ((0, run.base), (run.step, run.final)):
                    for prompt, score in sorted(answers.items(), key=lambda item: order.get(item[0], -1)):
                        writer.writerow([name, run.folder.name.removeprefix("seed"), at, order.get(prompt, -1), f"{score:g}"])
    return path


def render(rows: dict[str, Row], differences: list[dict], reference: str) -> str:
    """The two tables as markdown."""
    lines = ["| algorithm | seeds | problems | base | final (mean +- se seeds) | gain | se seeds | se problems | se | gain / se |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows.values():
        lines.append(f"| {row.name} | {row.seeds} | {row.problems} | {row.base:.3f} | {row.final_mean:.3f} +- "
                     f"{_fmt(row.final_se_seeds)} | {row.gain:+.3f} | {_fmt(row.gain_se_seeds)} | {row.gain_se_problems:.3f} | "
                     f"{row.gain_se:.3f} | {row.gain / row.gain_se if row.gain_se else float('nan'):+.1f} |")
    if differences:
        lines += ["", f"| algorithm minus {reference} (final) | difference | se seeds | se problems | se |", "|---|---|---|---|---|"]
        lines += [f"| {d['algorithm']} | {d['difference']:+.3f} | {_fmt(d['se_seeds'])} | {d['se_problems']:.3f} | {d['se']:.3f} |"
                  for d in differences]
    return "\n".join(lines)


def write_table(output_dir: Path, path: Path, reference: str = "grpo") -> Path | None:
    """The study's final table (markdown) and every answer's score (``answers.csv`` beside it)."""
    read = read_runs(study_runs(output_dir))
    rows = summarize(read)
    if not rows:
        return None
    differences = [d for name in rows if name != reference if (d := difference(read, name, reference)) is not None]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render(rows, differences, reference) + "\n")
    export_answers(read, path.parent / "heldout_answers.csv")
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spo_workbench.study.table", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, required=True, help="the study's folder (bash scripts/compare.sh --output-dir)")
    parser.add_argument("--reference", default="grpo", help="the algorithm the others are compared with (default grpo)")
    parser.add_argument("--export", type=Path, help="also write every answer's score to this CSV")
    args = parser.parse_args(argv)
    read = read_runs(study_runs(args.output_dir))
    if args.export:
        export_answers(read, args.export)
    rows = summarize(read)
    differences = [d for name in rows if name != args.reference
                   if (d := difference(read, name, args.reference)) is not None]
    print(render(rows, differences, args.reference))
    print(json.dumps({"rows": {name: asdict(row) for name, row in rows.items()}, "differences": differences}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
