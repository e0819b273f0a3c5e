"""The multi-turn study's held-out answers, each named by its own dialogue.

The study's runs were trained at a commit whose validation dumps name a dialogue by its prompt alone,
and a prompt shows only a dialogue's opening (the environment gives the second operation): the 256
held-out dialogues open with 169 prompts, and the 128 tuning dialogues with fewer than 128, so the
archived ``answers.csv`` put several dialogues under one key and the study's table paired one dialogue's
answer with another's base answer. The episode loops now name each dump line's row (``problem``, the
row's ``extra_info``); this script puts that name back into the study's dumps and writes each archived
run's ``answers.csv`` again. On ``dialogue2`` a dialogue's opening and its answer fix the row: the two
operations add or subtract 2-9, so the start, the first operation and the result fix the second; the
script checks that every row is told apart so and every dump line finds its row.

    .venv/bin/python docs/results/study4/name_dialogues.py /path/to/study4/clone/outputs

reads the dumps the clone's runs wrote (``study4/<arm>/seed<k>/`` and ``study4-tune/lr<rate>/...``)
and rewrites ``answers.csv`` under ``docs/results/study4/runs/`` and ``docs/results/study4/tune/``;
every answer keeps its kind, step and score (checked against the file it replaces).
"""

from __future__ import annotations

import argparse
import collections
import csv
import json
import sys
import tempfile
from pathlib import Path

import pandas as pd

from spo_verl.adapters.agent_loops.sessions import row_problem
from recipe.spo.cpu_settings.smollm2 import STUDY_VAL_FILE, TUNE_FILE, write_dialogue_data
from spo_workbench.study.archive import ANSWER_COLUMNS, ANSWERS_FILE, DUMPS, answer_rows

HERE = Path(__file__).resolve().parent
ARCHIVES = {HERE / "runs": "study4", **{folder: f"study4-tune/{folder.name}" for folder in sorted((HERE / "tune").glob("lr*"))}}


def opening_of(prompt: str) -> str:
    """The last user turn of a decoded chat prompt (verl's dump ``input``): the dialogue's opening."""
    return prompt.rsplit("user\n", 1)[1].removesuffix("\n").removesuffix("assistant").strip()


def row_names() -> dict[tuple[str, str], str]:
    """(opening, answer) -> the row's name, for every held-out and tuning dialogue of dialogue2."""
    names: dict[tuple[str, str], str] = {}
    with tempfile.TemporaryDirectory() as data:
        write_dialogue_data(Path(data), "dialogue2")
        for file in (STUDY_VAL_FILE, TUNE_FILE):
            for row in pd.read_parquet(Path(data) / file).to_dict("records"):
                key = (row["prompt"][-1]["content"].strip(), str(row["reward_model"]["ground_truth"]))
                if key in names:
                    raise ValueError(f"two dialogues open and end alike: {key}")
                names[key] = row_problem(row)
    return names


def named_copy(run: Path, names: dict[tuple[str, str], str], into: Path) -> Path:
    """``run``'s dumps with each line's row named, under ``into``."""
    for folder in DUMPS.values():
        for dump in sorted((run / folder).glob("*.jsonl")):
            lines = []
            for line in dump.read_text(encoding="utf-8").splitlines():
                if line.strip():
                    record = json.loads(line)
                    record["problem"] = names[(opening_of(record["input"]), str(record["gts"]))]
                    lines.append(json.dumps(record))
            (into / folder).mkdir(parents=True, exist_ok=True)
            (into / folder / dump.name).write_text("\n".join(lines) + "\n", encoding="utf-8")
    return into


def scores_by_dump(rows: list[dict]) -> collections.Counter:
    return collections.Counter((r["kind"], str(r["step"]), float(r["score"])) for r in rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("outputs", type=Path, help="the clone's outputs folder (holding study4/ and study4-tune/)")
    args = parser.parse_args(argv)
    names = row_names()
    for archive, trained in ARCHIVES.items():
        for kept in sorted(archive.glob("*/seed*")):
            run = args.outputs / trained / kept.parent.name / kept.name
            with tempfile.TemporaryDirectory() as scratch:
                rows = answer_rows(named_copy(run, names, Path(scratch)))
            with open(kept / ANSWERS_FILE, newline="", encoding="utf-8") as handle:
                before = list(csv.DictReader(handle))
            if scores_by_dump(rows) != scores_by_dump(before):
                raise ValueError(f"{run}: its dumps do not hold the answers archived in {kept / ANSWERS_FILE}")
            with open(kept / ANSWERS_FILE, "w", newline="", encoding="utf-8") as handle:
                writer = csv.DictWriter(handle, fieldnames=ANSWER_COLUMNS)
                writer.writeheader()
                writer.writerows(rows)
            base = {r["problem"] for r in rows if r["kind"] == "greedy" and r["step"] == 0}
            print(f"{kept.relative_to(HERE)}: {len(rows)} answers, {len(base)} dialogues at step 0 "
                  f"(under {len({r['problem'] for r in before if r['kind'] == 'greedy' and r['step'] == '0'})} keys before)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
