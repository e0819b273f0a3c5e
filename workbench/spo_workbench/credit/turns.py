"""Where the blame went per turn in multi-turn runs, read back from their sample logs.

    python -m spo_workbench.credit.turns RUN_DIR [RUN_DIR ...] [--csv FILE]

Each ``RUN_DIR`` holds a run's ``samples.jsonl`` (``algorithm.spo.diagnostics.sample_log``: a few episodes each
step, every leaf of one tree for SPO-tree) and, when the study command wrote it, ``done.json`` (its
algorithm and seed). Every logged episode of an arithmetic dialogue gets its first wrong turn
(:mod:`spo_verl.core.credit.dialogue_errors`), and each of its turns the credit it was given: the
advantage of the segment holding the turn, on the model's tokens (the environment's are no step of the
answer). A tree trains a turn its leaves share on one leaf's row only; here every leaf that went through
the turn shows its advantage, because the question is what the estimator said of each episode's turns.

A run started again (``attempts.json``) logged the steps of its discarded attempts too; only its final
attempt's are read, the trajectory its metrics and results report.

``--csv`` writes one row per logged turn (run, algorithm, seed, step, episode, reward,
first_wrong_turn, turn, tokens, masked_tokens, advantage, negative_mass, masked_negative_mass), from
which the table this prints is recomputed: for each algorithm, the episodes by first wrong turn and,
over the wrong episodes whose first K - 1 turns were right (K >= 2), the share of their negative
advantage on turn K and after ("blame on the wrong turn": all of it where an estimator credits turns
apart, the later turns' share of the tokens under GRPO's one advantage an episode) and the mean
advantage of their right turns; means over each run's episodes, then mean +- standard error over runs.
"""

from __future__ import annotations

import argparse
import csv
import json
import statistics
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from spo_verl.core.credit.dialogue_errors import first_wrong_turn_token, turn_spans
from spo_workbench.standard_error import mean_and_se


@dataclass(frozen=True)
class TurnCredit:
    run: str
    algorithm: str
    seed: int | None
    step: int
    episode: int  # its place in the run's sample log
    reward: float
    first_wrong_turn: int | None  # None: right, or not placed
    turn: int  # from 1
    tokens: int  # the model's tokens in the turn
    masked_tokens: int  # of those, in the probability mask
    advantage: float  # mean over the turn's tokens of its segment's advantage
    negative_mass: float  # sum of the negative advantages over its tokens
    masked_negative_mass: float  # the same over its masked tokens


def credit_given(response: dict) -> list[float]:
    """Each token's segment advantage, whichever row trained the segment."""
    advantages = [0.0] * len(response["tokens"])
    for segment in response["segments"]:
        for index in range(segment["start"], segment["end"]):
            advantages[index] = float(segment["advantage"])
    return advantages


def turn_credits(response: dict, run: str, algorithm: str, seed: int | None, step: int, episode: int) -> list[TurnCredit]:
    """One logged episode's turns; none for a response that is no multi-turn episode."""
    if "environment" not in response:
        return []
    environment = [bool(flag) for flag in response["environment"]]
    try:
        placed = first_wrong_turn_token(response["prompt"], response["tokens"], environment, float(response["score"]))
    except ValueError:  # not an arithmetic dialogue: its turns are listed, its errors not placed
        placed = None
    advantages = credit_given(response)
    rows = []
    for number, indices in enumerate(turn_spans(environment)[0], start=1):
        masked = [i for i in indices if response["in_prob_mask"][i]]
        rows.append(TurnCredit(
            run=run, algorithm=algorithm, seed=seed, step=step, episode=episode, reward=float(response["score"]),
            first_wrong_turn=None if placed is None else placed[0], turn=number, tokens=len(indices),
            masked_tokens=len(masked), advantage=statistics.fmean(advantages[i] for i in indices) if indices else 0.0,
            negative_mass=sum(min(advantages[i], 0.0) for i in indices),
            masked_negative_mass=sum(min(advantages[i], 0.0) for i in masked)))
    return rows


def final_attempt(records: Sequence[dict]) -> list[dict]:
    """The records of the run's final trajectory: a run stopped and started again (from step 0, or from a
    checkpoint) logs its steps again, and only the attempt that finished trained the run the results
    report. Read from the end, a record is kept when its step lies before every step kept so far, so a
    restart from step 0 drops the whole discarded attempt and a resume from a checkpoint keeps the steps
    before the checkpoint, once each; the order stays the log's."""
    kept, earliest = [], None
    for record in reversed(records):
        step = int(record["step"])
        if earliest is None or step < earliest:
            kept.append(record)
            earliest = step
    return kept[::-1]


def turns_of_records(records: Sequence[dict], run: str, algorithm: str, seed: int | None) -> list[TurnCredit]:
    """The logged turns of one run's sample-log records (each a step's line), of its final attempt only
    (:func:`final_attempt`)."""
    rows, episode = [], 0
    for record in final_attempt(records):
        for response in record["responses"]:
            rows += turn_credits(response, run, algorithm, seed, int(record["step"]), episode)
            episode += 1
    return rows


def read_run(run_dir: Path) -> list[TurnCredit]:
    """A run's logged turns, under the study's name of its arm where ``done.json`` has one (``grpo`` and
    ``grpo_prob_mask`` log the same estimator), else the logged estimator's."""
    done = run_dir / "done.json"
    run = json.loads(done.read_text()) if done.is_file() else {}
    records = [json.loads(line) for line in (run_dir / "samples.jsonl").read_text(encoding="utf-8").splitlines()]
    algorithm = run.get("algorithm", records[-1]["algorithm"] if records else "unknown")
    return turns_of_records(records, str(run_dir), algorithm, run.get("seed"))


@dataclass(frozen=True)
class EpisodeBlame:
    """A wrong episode whose first wrong turn is not the first: its blame and its right turns' credit."""

    on_wrong_turn: float | None  # share of the negative mass on the first wrong turn and after (None: none)
    on_wrong_turn_masked: float | None
    right_turns_advantage: float  # mean advantage over the right turns' tokens


def episode_blame(turns: Sequence[TurnCredit]) -> EpisodeBlame:
    wrong = turns[0].first_wrong_turn
    after = [t for t in turns if t.turn >= wrong]
    before = [t for t in turns if t.turn < wrong]

    def share(attribute: str) -> float | None:
        total = sum(getattr(t, attribute) for t in turns)
        return sum(getattr(t, attribute) for t in after) / total if total < 0 else None

    tokens = sum(t.tokens for t in before)
    return EpisodeBlame(share("negative_mass"), share("masked_negative_mass"),
                        sum(t.advantage * t.tokens for t in before) / tokens if tokens else 0.0)


def _episodes(rows: Sequence[TurnCredit]) -> dict[tuple[str, int], list[TurnCredit]]:
    episodes: dict[tuple[str, int], list[TurnCredit]] = defaultdict(list)
    for row in rows:
        episodes[(row.run, row.episode)].append(row)
    return episodes


def _mean_se(values: Sequence[float]) -> str:
    mean, error = mean_and_se(values)
    if mean is None:
        return "-"
    return f"{mean:.3f}" if error is None else f"{mean:.3f} +- {error:.3f}"


TABLE_HEADER = ("algorithm", "runs", "episodes", "right", "first wrong turn 1", "later", "not placed",
                "blame on the wrong turn (later)", "same, mask's tokens", "right turns' advantage (later)")


def table_rows(rows: Sequence[TurnCredit]) -> list[list[str]]:
    """One line of ``TABLE_HEADER`` an algorithm (module docstring)."""
    by_algorithm: dict[str, dict[str, list[list[TurnCredit]]]] = defaultdict(lambda: defaultdict(list))
    for turns in _episodes(rows).values():
        by_algorithm[turns[0].algorithm][turns[0].run].append(turns)
    lines = []
    for algorithm, runs in sorted(by_algorithm.items()):
        episodes = [turns for run in runs.values() for turns in run]
        right = sum(turns[0].reward >= 1 for turns in episodes)
        first = sum(turns[0].first_wrong_turn == 1 for turns in episodes)
        later = sum((turns[0].first_wrong_turn or 0) > 1 for turns in episodes)
        per_run: dict[str, list[float]] = defaultdict(list)
        for run in runs.values():
            blames = [episode_blame(turns) for turns in run if (turns[0].first_wrong_turn or 0) > 1]
            for name in ("on_wrong_turn", "on_wrong_turn_masked", "right_turns_advantage"):
                values = [getattr(b, name) for b in blames if getattr(b, name) is not None]
                if values:
                    per_run[name].append(statistics.fmean(values))
        lines.append([algorithm, str(len(runs)), str(len(episodes)), str(right), str(first), str(later),
                      str(len(episodes) - right - first - later), _mean_se(per_run["on_wrong_turn"]),
                      _mean_se(per_run["on_wrong_turn_masked"]), _mean_se(per_run["right_turns_advantage"])])
    return lines


def markdown_table(rows: Sequence[TurnCredit]) -> str:
    lines = [f"| {' | '.join(TABLE_HEADER)} |", "|" + "---|" * len(TABLE_HEADER)]
    lines += [f"| `{line[0]}` | {' | '.join(line[1:])} |" for line in table_rows(rows)]
    return "\n".join(lines)


def write_csv(rows: Sequence[TurnCredit], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(TurnCredit.__dataclass_fields__))
        writer.writeheader()
        for row in rows:
            writer.writerow({k: ("" if v is None else v) for k, v in asdict(row).items()})
    return path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spo_workbench.credit.turns", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="run folders, each with a samples.jsonl")
    parser.add_argument("--csv", type=Path, help="write one row per logged turn here")
    args = parser.parse_args(argv)
    missing = [str(run) for run in args.runs if not (run / "samples.jsonl").is_file()]
    if missing:
        parser.error(f"no samples.jsonl in {', '.join(missing)} (runs need algorithm.spo.diagnostics.sample_log.dir)")
    rows = [row for run in args.runs for row in read_run(run)]
    if not rows:
        parser.error("the sample logs hold no multi-turn episode")
    if args.csv:
        write_csv(rows, args.csv)
    print(markdown_table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
