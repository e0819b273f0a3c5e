"""The study's final table: gains over the base model with their standard errors over seeds and over
problems, on validation dumps written here in verl's format."""

import json
import math
import shutil

import pytest

from spo_workbench.study import archive
from spo_workbench.study import table as study_table
from spo_workbench.study.archive import problem_key


def write_run(folder, base, final, final_step=10):
    (folder / "validation").mkdir(parents=True)
    for step, scores in ((0, base), (final_step, final)):
        (folder / "validation" / f"{step}.jsonl").write_text(
            "".join(json.dumps({"input": f"problem {i}", "output": "", "score": s}) + "\n" for i, s in enumerate(scores)))


def test_gains_and_their_standard_errors(tmp_path, capsys):
    base = [1, 0, 0, 0]
    finals = {"spo_tree": [[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]], "grpo": [[0, 0, 0, 0], [1, 0, 0, 0], [1, 0, 0, 0]]}
    for name, runs in finals.items():
        for seed, final in enumerate(runs):
            write_run(tmp_path / name / f"seed{seed}", base, final)
    rows = study_table.summarize(study_table.read_runs(study_table.study_runs(tmp_path)))
    tree = rows["spo_tree"]
    assert (tree.seeds, tree.problems, tree.base) == (3, 4, 0.25)
    assert tree.final_mean == pytest.approx(0.5) and tree.gain == pytest.approx(0.25)
    # Per-seed gains 0.25, 0.5, 0: sample std 0.25, over sqrt(3).
    assert tree.gain_se_seeds == pytest.approx(0.25 / math.sqrt(3))
    # Per-problem gains averaged over seeds: 0, 2/3, 1/3, 0.
    gains = [0, 2 / 3, 1 / 3, 0]
    mean = sum(gains) / 4
    assert tree.gain_se_problems == pytest.approx(math.sqrt(sum((g - mean) ** 2 for g in gains) / 3 / 4))
    assert tree.gain_se == pytest.approx(math.hypot(tree.gain_se_seeds, tree.gain_se_problems))
    difference = study_table.difference(study_table.read_runs(study_table.study_runs(tmp_path)), "spo_tree", "grpo")
    assert difference["difference"] == pytest.approx(0.5 - 1 / 6)
    assert study_table.main(["--output-dir", str(tmp_path), "--export", str(tmp_path / "answers.csv")]) == 0
    import csv

    with open(tmp_path / "answers.csv") as handle:
        answers = list(csv.DictReader(handle))
    assert len(answers) == 2 * 3 * 2 * 4  # algorithms x seeds x (first, last) x problems
    # Problems numbered by their sorted keys: grpo seed 1 got only "problem 0" right.
    keys = sorted(problem_key(f"problem {i}") for i in range(4))
    assert [a["score"] for a in answers if a["algorithm"] == "grpo" and a["seed"] == "1" and a["step"] == "10"] == [
        "1" if key == problem_key("problem 0") else "0" for key in keys]
    out = capsys.readouterr().out
    assert "| spo_tree | 3 | 4 | 0.250 | 0.500 +- 0.144 | +0.250 |" in out and "| spo_tree | +0.333 |" in out


def test_a_run_without_its_base_validation_is_left_out(tmp_path):
    write_run(tmp_path / "grpo" / "seed0", [1, 0], [1, 1])
    (tmp_path / "grpo" / "seed0" / "validation" / "0.jsonl").rename(tmp_path / "grpo" / "seed0" / "validation" / "5.jsonl")
    assert study_table.summarize(study_table.read_runs(study_table.study_runs(tmp_path))) == {}


def test_runs_restored_from_the_archive_pair_with_runs_trained_since(tmp_path):
    """A study resumed on a new machine holds restored runs (their dumps name problems by key) beside
    runs it trained since (named by prompt): the table pairs them problem by problem, as if all were fresh."""
    fresh, resumed = tmp_path / "fresh", tmp_path / "resumed"
    base = [1, 0, 0, 0]
    finals = {"spo_tree": [[1, 1, 0, 0], [1, 1, 1, 0]], "grpo": [[0, 0, 0, 0], [1, 0, 0, 0]]}
    for name, runs in finals.items():
        for seed, final in enumerate(runs):
            for study in (fresh, resumed):
                write_run(study / name / f"seed{seed}", base, final)
    for name in finals:  # seed 0 of every arm went through the archive, seed 1 trained on the new machine
        (resumed / name / "seed0" / "done.json").write_text("{}")
    archive.save(resumed, tmp_path / "archive")
    for name in finals:
        shutil.rmtree(resumed / name / "seed0")
    assert len(archive.restore(tmp_path / "archive", resumed)) == 2
    assert json.loads((resumed / "grpo" / "seed0" / "validation" / "0.jsonl").read_text().splitlines()[0])["input"] == \
        problem_key("problem 0")
    expected, got = (study_table.read_runs(study_table.study_runs(study)) for study in (fresh, resumed))
    assert study_table.summarize(got) == study_table.summarize(expected)
    assert study_table.summarize(got)["spo_tree"].problems == 4
    assert study_table.difference(got, "spo_tree", "grpo") == study_table.difference(expected, "spo_tree", "grpo")


OPENING = "Start with 3. Add 4 to that."  # two dialogues open alike; the environment's second turn differs
DIALOGUES = [json.dumps({"operations": ["+4", "-2"], "start": 3}), json.dumps({"operations": ["+4", "+5"], "start": 3})]


def write_dialogue_run(folder, base, final, order):
    """Validation dumps as verl writes them for multi-turn episodes: one prompt for both dialogues, each
    line naming its row in ``problem``; ``order``: the dialogues in dump order, which differs run to run."""
    (folder / "validation").mkdir(parents=True)
    for step, scores in ((0, base), (10, final)):
        (folder / "validation" / f"{step}.jsonl").write_text("".join(
            json.dumps({"input": OPENING, "output": "", "score": scores[k], "problem": DIALOGUES[k]}) + "\n" for k in order))


def test_dialogues_that_open_alike_pair_by_their_rows_fresh_or_restored(tmp_path):
    """Each dialogue's final answer pairs with its own base answer, whatever order the dumps hold them
    in, and the archive keeps them apart."""
    study = tmp_path / "study"
    write_dialogue_run(study / "spo_tree" / "seed0", base=[1, 0], final=[1, 1], order=[0, 1])
    write_dialogue_run(study / "spo_tree" / "seed1", base=[1, 0], final=[0, 1], order=[1, 0])
    write_dialogue_run(study / "grpo" / "seed0", base=[1, 0], final=[1, 0], order=[1, 0])
    read = study_table.read_runs(study_table.study_runs(study))
    tree = study_table.summarize(read)["spo_tree"]
    assert (tree.problems, tree.base, tree.final_mean, tree.gain) == (2, 0.5, 0.75, 0.25)
    # Per-dialogue gains averaged over the seeds: -0.5 (the first), +1 (the second).
    assert tree.gain_se_problems == pytest.approx(0.75)
    assert study_table.difference(read, "spo_tree", "grpo")["se_problems"] == pytest.approx(0.75)
    for run in study.glob("*/seed*"):
        (run / "done.json").write_text("{}")
    archive.save(study, tmp_path / "archive")
    archive.restore(tmp_path / "archive", tmp_path / "restored")
    assert study_table.summarize(study_table.read_runs(study_table.study_runs(tmp_path / "restored"))) == \
        study_table.summarize(read)


def test_a_greedy_dump_that_cannot_tell_two_problems_apart_is_refused(tmp_path):
    write_dialogue_run(tmp_path / "grpo" / "seed0", base=[1, 0], final=[1, 1], order=[0, 1])
    dump = tmp_path / "grpo" / "seed0" / "validation" / "0.jsonl"
    dump.write_text("".join(json.dumps({k: v for k, v in json.loads(line).items() if k != "problem"}) + "\n"
                            for line in dump.read_text().splitlines()))
    with pytest.raises(ValueError, match=r"0\.jsonl: two answers to problem [0-9a-f]{12}"):
        study_table.read_runs(study_table.study_runs(tmp_path))


def test_the_study_writes_its_table_and_answers_beside_the_report(tmp_path):
    write_run(tmp_path / "spo_tree" / "seed0", [1, 0, 0, 0], [1, 1, 0, 0])
    write_run(tmp_path / "grpo" / "seed0", [1, 0, 0, 0], [0, 0, 0, 0])
    table = study_table.write_table(tmp_path, tmp_path / "report" / "table.md")
    text = table.read_text()
    assert "| spo_tree | 1 | 4 | 0.250 | 0.500 +- - | +0.250 |" in text and "| spo_tree | +0.500 |" in text
    assert (tmp_path / "report" / "heldout_answers.csv").read_text().count("\n") == 1 + 2 * 2 * 4
    assert study_table.write_table(tmp_path / "nothing", tmp_path / "t.md") is None


def test_the_calibration_table_is_written_as_csv_with_every_figure(tmp_path):
    """``python -m spo_workbench.study.calibration --csv``: one row per task, the table's figures as measured."""
    import csv

    from spo_workbench.study.calibration import write_csv

    result = {"problems": 128, "samples": 4, "tasks": {
        "steps2": {"example": "What is 3 + 4 + 2?", "greedy_accuracy": 0.5, "greedy_se": 0.04, "pass_at_4": 0.75},
        "steps4": {"example": "What is 3 + 4 + 2 + 6 + 5?", "greedy_accuracy": 0.25, "greedy_se": 0.03, "pass_at_4": 0.5}}}
    write_csv(result, tmp_path / "calibration.csv")
    with open(tmp_path / "calibration.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert [row["task"] for row in rows] == ["steps2", "steps4"]
    assert rows[1] == {"task": "steps4", "problems": "128", "samples": "4", "example": "What is 3 + 4 + 2 + 6 + 5?",
                       "greedy_accuracy": "0.25", "greedy_se": "0.03", "pass_at_4": "0.5"}
