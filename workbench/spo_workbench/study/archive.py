"""A study's finished runs kept small enough to commit, and put back where the study expects them, so
that a study spread over machines that do not keep their disks resumes from what was committed.

    python -m spo_workbench.study.archive save --output-dir outputs/study3 --archive docs/results/study3/runs
    python -m spo_workbench.study.archive restore --archive docs/results/study3/runs --output-dir outputs/study3

``save`` copies each finished run (its ``done.json``) to ``<archive>/<algorithm>/seed<k>/``: the
run's own records (``done.json``, ``attempts.json``, ``trained.json``, the metrics verl logged) as
they are, and its validation dumps as one ``answers.csv`` (``kind`` greedy or sampled, ``step``,
``problem``, ``sample``, ``score``): the score of every held-out answer, the problem named by a hash of
its prompt (and a multi-turn episode's row), without the prompt and response texts that make the dumps
megabytes a run. ``restore`` writes those files back, the dumps as ``{"input": problem, "score": score}``
lines, which is all the study's table, verdict and report read of them; ``compare`` then skips the
restored runs as finished.
Neither overwrites a run already at its destination. Checkpoints are not kept: a finished run has none.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import re
import shutil
from pathlib import Path

RECORDS = ("*.json", "*.jsonl")  # the run folder's own files; console logs and checkpoints stay behind
DUMPS = {"greedy": "validation", "sampled": "validation_sampled"}  # kind -> the folder verl dumps it to
ANSWERS_FILE = "answers.csv"
ANSWER_COLUMNS = ("kind", "step", "problem", "sample", "score")


_KEY = re.compile(r"[0-9a-f]{12}")


def problem_key(prompt: str) -> str:
    return hashlib.sha1(prompt.encode("utf-8")).hexdigest()[:12]


def problem_of(record: dict) -> str:
    """The key of the problem a validation dump's line answers. A fresh dump names the problem by its
    prompt, and a multi-turn episode's line by its row too (``problem``: dialogues that open alike go on
    differently); a restored one by its key already (no chat prompt is twelve hex digits), so runs
    restored from the archive and runs trained since pair problem by problem."""
    prompt, row = record["input"], record.get("problem") or ""
    if _KEY.fullmatch(prompt):
        return prompt
    return problem_key(f"{prompt}\n{row}" if row else prompt)


def finished_runs(output_dir: Path) -> list[Path]:
    return sorted(done.parent for done in output_dir.glob("*/seed*/done.json"))


def answer_rows(run: Path) -> list[dict]:
    """Every validation dump of ``run`` as rows; a problem's answers are numbered in dump order."""
    rows = []
    for kind, folder in DUMPS.items():
        for dump in sorted((run / folder).glob("*.jsonl"), key=lambda path: int(path.stem)):
            seen: dict[str, int] = {}
            for line in dump.read_text(encoding="utf-8").splitlines():
                if not line.strip():
                    continue
                record = json.loads(line)
                problem = problem_of(record)
                seen[problem] = seen.get(problem, -1) + 1
                rows.append({"kind": kind, "step": int(dump.stem), "problem": problem,
                             "sample": seen[problem], "score": float(record["score"])})
    return rows


def _copy_records(source: Path, target: Path) -> None:
    """A run's own files but ``done.json``, which its callers copy last: a folder with it is complete."""
    for pattern in RECORDS:
        for record in sorted(source.glob(pattern)):
            if record.name != "done.json":
                shutil.copy2(record, target / record.name)


def _not_yet_at(source: Path, destination: Path) -> list[tuple[Path, Path]]:
    """Each finished run under ``source`` with its folder under ``destination``, where it has not finished."""
    pairs = [(run, destination / run.parent.name / run.name) for run in finished_runs(source)]
    return [(run, there) for run, there in pairs if not (there / "done.json").exists()]


def save(output_dir: Path, archive: Path) -> list[Path]:
    """Archive every finished run not archived yet; returns the new archive folders."""
    saved = []
    for run, target in _not_yet_at(output_dir, archive):
        target.mkdir(parents=True, exist_ok=True)
        _copy_records(run, target)
        with open(target / ANSWERS_FILE, "w", newline="", encoding="utf-8") as handle:
            writer = csv.DictWriter(handle, fieldnames=ANSWER_COLUMNS)
            writer.writeheader()
            writer.writerows(answer_rows(run))
        shutil.copy2(run / "done.json", target / "done.json")  # last: a folder with it is complete
        saved.append(target)
    return saved


def restore(archive: Path, output_dir: Path) -> list[Path]:
    """Put every archived run back under ``output_dir``; returns the restored run folders."""
    restored = []
    for kept, run in _not_yet_at(archive, output_dir):
        if run.exists():
            shutil.rmtree(run)  # an unfinished attempt of a run that finished elsewhere
        run.mkdir(parents=True)
        dumps: dict[Path, list[str]] = {}
        with open(kept / ANSWERS_FILE, newline="", encoding="utf-8") as handle:
            for row in csv.DictReader(handle):
                path = run / DUMPS[row["kind"]] / f"{row['step']}.jsonl"
                dumps.setdefault(path, []).append(json.dumps({"input": row["problem"], "score": float(row["score"])}))
        for path, lines in dumps.items():
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("\n".join(lines) + "\n", encoding="utf-8")
        _copy_records(kept, run)
        shutil.copy2(kept / "done.json", run / "done.json")
        restored.append(run)
    return restored


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spo_workbench.study.archive", description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("save", "restore"))
    parser.add_argument("--output-dir", type=Path, required=True, help="the study's output folder")
    parser.add_argument("--archive", type=Path, required=True, help="where the finished runs are kept")
    args = parser.parse_args(argv)
    if args.action == "save":
        done = save(args.output_dir, args.archive)
    else:
        done = restore(args.archive, args.output_dir)
    for folder in done:
        print(f"archive: {args.action}d {folder}")
    print(f"archive: {len(done)} run(s) {args.action}d")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
