"""A study's finished runs archived small and restored where the study, its table and its verdict read
them, with the same results; unfinished runs are not archived, and nothing is overwritten."""

import csv
import json

from spo_workbench.study import table as study_table
from spo_workbench.study.archive import main, problem_key, restore, save
from spo_workbench.study.verdict import study_at_budget

KEY = "val-core/arithmetic/acc/mean@1"
PROMPTS = ["What is 1 + 2?", "What is 3 + 4?", "What is 5 + 6?"]


def write_dump(path, scores, samples=1):
    path.parent.mkdir(parents=True, exist_ok=True)
    lines = [json.dumps({"input": prompt, "output": "a long response " * 20, "score": score})
             for prompt, score in zip(PROMPTS, scores) for _ in range(samples)]
    path.write_text("\n".join(lines) + "\n")


def write_run(run, base, final, done=True):
    run.mkdir(parents=True)
    metrics = [{"step": 0, "data": {KEY: sum(base) / 3}},
               {"step": 5, "data": {KEY: sum(final) / 3, "spo/generated_tokens_cumulative": 1000.0}}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    (run / "attempts.json").write_text(json.dumps([{"metrics": "metrics-attempt1.jsonl", "resumed_from": 0}]))
    (run / "console-attempt1.log").write_text("a console log is not kept")
    write_dump(run / "validation" / "0.jsonl", base)
    write_dump(run / "validation" / "5.jsonl", final)
    write_dump(run / "validation_sampled" / "5.jsonl", final, samples=2)
    (run / "checkpoints").mkdir()
    if done:
        (run / "done.json").write_text(json.dumps({"steps": 5}))


def test_save_keeps_records_and_scores_and_restore_gives_the_same_table_and_verdict(tmp_path, capsys):
    study = tmp_path / "study"
    write_run(study / "spo" / "seed0", (0, 0, 1), (1, 0, 1))
    write_run(study / "grpo" / "seed0", (0, 0, 1), (0, 1, 1))
    write_run(study / "grpo" / "seed1", (0, 0, 1), (1, 1, 1), done=False)  # still training
    archive = tmp_path / "archive"

    assert save(study, archive) == [archive / "grpo" / "seed0", archive / "spo" / "seed0"]
    kept = archive / "spo" / "seed0"
    assert sorted(p.name for p in kept.iterdir()) == ["answers.csv", "attempts.json", "done.json", "metrics.jsonl"]
    with open(kept / "answers.csv", newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert len(rows) == 3 + 3 + 3 * 2
    sampled = [r for r in rows if r["kind"] == "sampled"]
    assert [(r["problem"], r["sample"], r["score"]) for r in sampled[:2]] == [
        (problem_key(PROMPTS[0]), "0", "1.0"), (problem_key(PROMPTS[0]), "1", "1.0")]
    assert {(r["kind"], r["step"]) for r in rows} == {("greedy", "0"), ("greedy", "5"), ("sampled", "5")}
    assert save(study, archive) == []  # archived once

    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "spo" / "seed0").mkdir(parents=True)  # an unfinished attempt there: replaced
    assert restore(archive, elsewhere) == [elsewhere / "grpo" / "seed0", elsewhere / "spo" / "seed0"]
    assert restore(archive, elsewhere) == []
    assert study_at_budget(elsewhere, 1000) == study_at_budget(study, 1000) == {("grpo", 0): 2 / 3, ("spo", 0): 2 / 3}
    runs = {name: [elsewhere / name / "seed0"] for name in ("spo", "grpo")}
    originals = {name: [study / name / "seed0"] for name in ("spo", "grpo")}
    restored, original = study_table.read_runs(runs), study_table.read_runs(originals)
    for name in runs:
        assert [(r.step, sorted(r.base.values()), sorted(r.final.values())) for r in restored[name]] == \
               [(r.step, sorted(r.base.values()), sorted(r.final.values())) for r in original[name]]
    dump = (elsewhere / "spo" / "seed0" / "validation_sampled" / "5.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in dump[:2]] == [{"input": problem_key(PROMPTS[0]), "score": 1.0}] * 2

    assert main(["save", "--output-dir", str(study), "--archive", str(archive)]) == 0
    assert "archive: 0 run(s) saved" in capsys.readouterr().out
