"""The study command's bookkeeping (spo_workbench.study.compare): options, attempts merged step by step, the tokens a
resumed run has already spent. The command itself, killed and resumed through verl's trainer, is in
test_end_to_end_on_cpu."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from spo_workbench.study import compare as study
from recipe.spo.metrics_log import read_logged_steps

REPO = Path(__file__).resolve().parents[1]


def write_metrics(path, steps):
    path.write_text("".join(json.dumps({"step": step, "data": data}) + "\n" for step, data in steps))


def test_an_attempt_resumed_from_a_checkpoint_replaces_the_steps_after_it(tmp_path):
    folder = study.RunFolder.open(tmp_path / "spo_tree" / "seed0")
    first = folder.new_attempt(resumed_from=0)
    write_metrics(first, [(0, {"val-core/x/acc/mean@1": 0.2}), (1, {study.GENERATED: 100.0}),
                          (2, {study.GENERATED: 120.0}), (3, {study.GENERATED: 90.0})])
    first.write_text(first.read_text() + '{"step": 4, "da')  # killed while writing a line
    # Killed after step 3; the last checkpoint was step 2: the second attempt redoes step 3.
    second = folder.new_attempt(resumed_from=2)
    write_metrics(second, [(3, {study.GENERATED: 80.0}), (4, {study.GENERATED: 70.0, "val-core/x/acc/mean@1": 0.3})])
    reopened = study.RunFolder.open(folder.path)
    assert [a["resumed_from"] for a in reopened.attempts] == [0, 2]
    steps = reopened.merged_steps()
    assert sorted(steps) == [0, 1, 2, 3, 4]
    assert steps[3][study.GENERATED] == 80.0  # the resumed attempt's step 3
    assert reopened.spent_until(2) == 220.0 and reopened.spent_until(4) == 370.0
    merged = read_logged_steps(reopened.write_merged())
    assert [data["spo/generated_tokens_cumulative"] for step, data in merged if step > 0] == [100, 220, 300, 370]
    assert study.validation_accuracy(dict(merged)[4]) == 0.3


def test_a_run_resumes_from_its_last_checkpoint_whose_steps_were_logged(tmp_path):
    folder = study.RunFolder.open(tmp_path / "grpo" / "seed1")
    assert folder.resumable_step() == 0 and folder.spent_until(0) == 0 and not folder.done
    for step in (2, 4):
        (folder.checkpoints / f"global_step_{step}").mkdir(parents=True)
    (folder.checkpoints / "latest_checkpointed_iteration.txt").write_text("4\n")
    assert folder.checkpointed_step() == 4
    attempt = folder.new_attempt(resumed_from=0)
    # Stopped after step 4's checkpoint but before verl logged step 4: resume from step 2.
    write_metrics(attempt, [(0, {}), (1, {study.GENERATED: 10.0}), (2, {study.GENERATED: 10.0}), (3, {study.GENERATED: 10.0})])
    assert folder.resumable_step() == 2
    write_metrics(attempt, [(0, {}), *[(s, {study.GENERATED: 10.0}) for s in (1, 2, 3, 4)]])
    assert folder.resumable_step() == 4


def test_a_run_resumed_after_it_chose_its_last_step_is_held_to_it(tmp_path, monkeypatch):
    """Steps of 400 tokens against a budget of 1,000: after step 2 (800 + 400 reach it) the run made step
    3 its last. Resumed from step 2's checkpoint, the new process is told so (it would otherwise count its
    budget afresh and run step 4 as well); resumed from step 1, nothing was chosen yet; stopped after
    step 3 was logged and checkpointed, nothing is left to train."""
    folder = study.RunFolder.open(tmp_path / "grpo" / "seed0")
    attempt = folder.new_attempt(resumed_from=0)
    write_metrics(attempt, [(0, {}), (1, {study.GENERATED: 400.0}), (2, {study.GENERATED: 400.0})])
    assert folder.chosen_last_step(2, 1_000) == 3 and folder.chosen_last_step(1, 1_000) is None
    assert folder.chosen_last_step(0, 1_000) is None and folder.chosen_last_step(2, 1_300) is None
    assert folder.chosen_last_step(2, 700) == 2  # chosen after step 1 already (400 + 400)
    for step in (1, 2):
        (folder.checkpoints / f"global_step_{step}").mkdir(parents=True)
    (folder.checkpoints / "latest_checkpointed_iteration.txt").write_text("2\n")
    commands = []
    monkeypatch.setattr(study, "_run_logged", lambda command, *args: commands.append(command) or 0)
    config = study.Study(**{**study.QUICK, "token_budget": 1_000, "max_steps": 10, "output_dir": tmp_path})
    assert study._train(config, folder, "grpo", 0)
    assert commands[0][-1] == "trainer.total_training_steps=3"
    assert "algorithm.spo.budget.generated_tokens=200" in commands[0]
    # The new attempt trained step 3 (its last) and was stopped before it could exit: resumed from
    # step 3, nothing is launched and the run counts as trained.
    write_metrics(folder.path / folder.attempts[-1]["metrics"], [(3, {study.GENERATED: 400.0})])
    (folder.checkpoints / "global_step_3").mkdir()
    (folder.checkpoints / "latest_checkpointed_iteration.txt").write_text("3\n")
    assert study._train(config, folder, "grpo", 0) and len(commands) == 1
    trained = json.loads((folder.path / study.TRAINED_FILE).read_text())
    assert (trained["steps"], trained["generated_tokens"], trained["attempts"]) == (3, 1_200, 2)


# A stand-in trainer (the real one cannot be made to hang on cue): it logs as verl's file logger does and,
# on the attempts listed in STALL_ON, stops logging after step 1 and waits for ever, as verl's trainer does
# when Ray has killed its vLLM server.
STALLING_TRAINER = """
import json, os, sys, time
counter, stall_on = sys.argv[1], {int(a) for a in sys.argv[2].split(",") if a}
attempt = int(open(counter).read()) + 1 if os.path.exists(counter) else 1
open(counter, "w").write(str(attempt))
with open(os.environ["VERL_FILE_LOGGER_PATH"], "a") as log:
    for step in (0, 1, 2):
        if step == 2 and attempt in stall_on:
            log.flush()
            time.sleep(600)
        data = {"val-core/x/acc/mean@1": 0.5} if step in (0, 2) else {}
        log.write(json.dumps({"step": step, "data": {**data, **({%r: 600.0} if step else {})}}) + "\\n")
""" % study.GENERATED


@pytest.mark.parametrize("stall_on, trained", [("1", True), ("1,2,3", False)])
def test_a_run_that_stops_logging_is_stopped_and_resumed(tmp_path, monkeypatch, capsys, stall_on, trained):
    """A stalled attempt's whole process group is ended and the run started again from its last checkpoint
    (here none: from the base model); one that stalls every time gives up after STALL_RETRIES resumptions."""
    script, counter = tmp_path / "trainer.py", tmp_path / "attempts"
    script.write_text(STALLING_TRAINER)
    monkeypatch.setattr(study, "_launch_command", lambda *args: [sys.executable, str(script), str(counter), stall_on])
    config = study.Study(**{**study.QUICK, "token_budget": 1_000, "max_steps": 10, "output_dir": tmp_path,
                            "stall_minutes": 3 / 60})
    folder = study.RunFolder.open(tmp_path / "grpo" / "seed0")
    assert study._train(config, folder, "grpo", 0) is trained
    out = capsys.readouterr().out
    attempts = study.RunFolder.open(folder.path).attempts
    stalls = 1 if trained else study.STALL_RETRIES + 1
    assert len(attempts) == stalls + trained and int(counter.read_text()) == len(attempts)
    assert out.count("grpo/seed0: no step logged for 0.05 minutes while its trainer ran; stopped it") == stalls
    assert out.count("resuming from its last checkpoint") == (1 if trained else study.STALL_RETRIES)
    assert ("rerun the command to resume" in out) is not trained
    for attempt in attempts[:stalls]:  # nothing of a stalled attempt is left running
        with pytest.raises(ProcessLookupError):
            os.killpg(attempt["process_group"], 0)
    if trained:
        summary = json.loads((folder.path / study.TRAINED_FILE).read_text())
        assert (summary["steps"], summary["generated_tokens"], summary["attempts"]) == (2, 1_200, 2)


def test_options_and_their_errors(capsys):
    quick = study.parse_args(["--quick"])
    assert (quick.setting, quick.algorithms, quick.seeds, quick.token_budget) == ("cpu-tiny", ("spo_tree", "spo_tree_cutpoint"), (0,), 500)
    full = study.parse_args(["--seeds", "3,4", "--lr", "1e-5", "--token-budget", "9000", "--", "data.train_batch_size=8"])
    assert full.setting == "cpu-smollm2" and full.algorithms == study.ALGORITHMS and full.seeds == (3, 4)
    assert full.lr == 1e-5 and full.token_budget == 9000 and full.overrides == ("data.train_batch_size=8",)
    assert full.output_dir.name == "study-cpu-smollm2"
    # The study's own settings for the CPU default; the user's overrides come last, so they win.
    assert full.training_overrides() == ["actor_rollout_ref.actor.optim.lr=1e-05", "data.train_batch_size=8",
                                         "actor_rollout_ref.actor.ppo_mini_batch_size=4", "data.train_batch_size=8"]
    default = study.parse_args([])
    assert (default.lr, default.prompts_per_step, default.token_budget, default.task) == (1e-5, 8, 8000, None)
    assert study.parse_args(["--task", "add_add"]).task == "add_add"
    assert study.parse_args(["--task", "dialogue2", "--algorithms", "spo_tree,spo_chain,grpo,grpo_prob_mask"]).task == "dialogue2"
    assert study.parse_args(["--setting", "cpu-tiny", "--prompts-per-step", "6"]).training_overrides() == [
        "data.train_batch_size=6", "actor_rollout_ref.actor.ppo_mini_batch_size=3"]
    assert quick.training_overrides() == []  # cpu-tiny: the setting's own lr and batch
    # Each algorithm at its own rate (the tuning sweep's choice); the others at the default one.
    tuned = study.parse_args(["--algorithms", "spo_tree,grpo", "--lr", "spo_tree=2e-5", "--validate-on", "tune",
                              "--sampled-validation", "4"])
    assert (tuned.learning_rate("spo_tree"), tuned.learning_rate("grpo")) == (2e-5, 1e-5)
    assert tuned.training_overrides("spo_tree")[0] == "actor_rollout_ref.actor.optim.lr=2e-05"
    assert tuned.training_overrides("grpo")[0] == "actor_rollout_ref.actor.optim.lr=1e-05"
    assert (tuned.validate_on, tuned.sampled_validation, default.validate_on, default.sampled_validation) == ("tune", 4, "test", 0)
    assert study.parse_args(["--report-only"]).report_only and not default.report_only
    assert (default.stall_minutes, study.parse_args(["--stall-minutes", "0"]).stall_minutes) == (60.0, 0.0)
    for argv, message in [(["--algorithms", "spo_tree,dpo"], "--algorithms must be a non-empty subset"),
                          (["--token-budget", "0"], "--token-budget must be a positive integer, got 0"),
                          (["--lr", "-1"], "--lr must be positive"),
                          (["--lr", "grpo=fast"], "expected a rate or algorithm=rate pairs"),
                          (["--algorithms", "grpo", "--lr", "spo_tree=1e-5"], "--lr names algorithms the study does not run: spo_tree"),
                          (["--sampled-validation", "-1"], "--sampled-validation must be 0 (none) or a number of samples"),
                          (["--stall-minutes", "-5"], "--stall-minutes must be 0 (never) or a number of minutes, got -5.0"),
                          (["--quick", "--validate-on", "tune"], "--validate-on tune needs the cpu-smollm2 setting"),
                          (["--prompts-per-step", "5"], "--prompts-per-step must be an even number of at least 2"),
                          (["--setting", "laptop"], "invalid choice: 'laptop'"),
                          (["--task", "add_mul"], "--task must be one of add_sub,add_sub_add,add_add,mul_add,steps2,steps3,steps4,steps5,steps6,steps7,dialogue3,dialogue2, got 'add_mul'"),
                          (["--task", "dialogue2"], "--task dialogue2 is a multi-turn task; spo_tree_cutpoint cannot play its episodes "
                                                    "(allowed: spo_tree,spo_chain,grpo,grpo_prob_mask)"),
                          (["--quick", "--task", "add_add"], "--task picks a task of the cpu-smollm2 setting, not of cpu-tiny")]:
        with pytest.raises(SystemExit):
            study.parse_args(argv)
        assert message in capsys.readouterr().err


def test_report_only_trains_nothing_and_reports_the_finished_runs(tmp_path, monkeypatch, capsys):
    """``--report-only`` over a study with one finished run and one that has not started: no run is
    started (a run would be a subprocess) and the report is made over the study's folder."""
    reported = []
    monkeypatch.setattr(study, "run_one", lambda *args: pytest.fail(f"a run was started: {args[1:]}"))
    monkeypatch.setattr(study, "report", lambda plan: reported.append(plan) or 0)
    (tmp_path / "grpo" / "seed0").mkdir(parents=True)
    (tmp_path / "grpo" / "seed0" / study.DONE_FILE).write_text("{}")
    assert study.main(["--report-only", "--algorithms", "grpo,spo_tree", "--seeds", "0", "--output-dir", str(tmp_path)]) == 0
    assert [plan.output_dir for plan in reported] == [tmp_path]
    assert "unfinished runs" not in capsys.readouterr().out


def test_the_error_table_reads_each_runs_first_and_last_validation(tmp_path):
    import csv
    import json

    from recipe.spo.cpu_settings import smollm2

    prompt = " ".join(turn["content"] for turn in smollm2.messages("What is 12 + 5 - 6?"))
    answers = {"0": [("12 + 5 = 16. 16 - 6 = 10.\n#### 10", 0.0), ("12 + 5 = 17. 17 - 6 = 11.\n#### 11", 1.0)],
               "5": [("12 + 5 = 17.\n#### 17", 0.0)],
               "10": [("12 + 5 = 17. 17 - 6 = 11.\n#### 11", 1.0)] * 3}
    folder = tmp_path / "grpo" / "seed1" / "validation"
    folder.mkdir(parents=True)
    for step, rows in answers.items():
        (folder / f"{step}.jsonl").write_text("".join(json.dumps({"input": prompt, "output": o, "score": s}) + "\n"
                                                      for o, s in rows))
    plan = study.parse_args(["--algorithms", "grpo", "--seeds", "1", "--output-dir", str(tmp_path)])
    path = study.write_error_table(plan, tmp_path / "report" / "errors.csv")
    with open(path) as handle:
        rows = list(csv.DictReader(handle))
    assert [(r["step"], r["answers"], r["right"], r["step 1: wrong arithmetic"]) for r in rows] == [
        ("0", "2", "0.5", "0.5"), ("10", "3", "1.0", "0.0")]  # step 5 is neither the first nor the last
    assert study.write_error_table(study.parse_args(["--quick", "--output-dir", str(tmp_path)]), path) is None
    # A run restored from the archive has each answer's score, not its text: no row (it raised before).
    restored = tmp_path / "grpo" / "seed2" / "validation"
    restored.mkdir(parents=True)
    (restored / "0.jsonl").write_text(json.dumps({"input": "3f2a9c", "score": 1.0}) + "\n")
    both = study.parse_args(["--algorithms", "grpo", "--seeds", "1,2", "--output-dir", str(tmp_path)])
    with open(study.write_error_table(both, tmp_path / "report" / "both.csv")) as handle:
        assert [(r["seed"], r["step"]) for r in csv.DictReader(handle)] == [("1", "0"), ("1", "10")]
    # A multi-turn task's dumps are dialogues, not one problem's worked answer: no table (it raised before).
    dialogue = study.parse_args(["--task", "dialogue2", "--algorithms", "grpo", "--seeds", "1", "--output-dir", str(tmp_path)])
    assert study.write_error_table(dialogue, tmp_path / "report" / "dialogue_errors.csv") is None


def test_verls_metrics_file_is_read_with_an_unfinished_last_line(tmp_path):
    from recipe.spo.metrics_log import merged_by_step

    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0, "data": {"a": 1}}\n{"step": 0, "data": {"b": 2}}\n{"step": 1, "data": {"a": 3}}\n{"step": 2, "da')
    assert read_logged_steps(path) == [(0, {"a": 1}), (0, {"b": 2}), (1, {"a": 3})]  # a run still writing
    assert merged_by_step(path) == {0: {"a": 1, "b": 2}, 1: {"a": 3}}
    assert read_logged_steps(tmp_path / "missing.jsonl") == []
    path.write_text('{"step": 0, "data": {}}\nnot json\n{"step": 1, "data": {}}\n')
    with pytest.raises(ValueError, match="line 2 is not a JSON record"):
        read_logged_steps(path)


def test_study_help_lists_its_options():
    result = subprocess.run(["bash", "scripts/compare.sh", "--help"], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    for option in ("--setting", "--algorithms", "--seeds", "--token-budget", "--lr", "--val-every", "--max-steps",
                   "--output-dir", "--quick"):
        assert option in result.stdout, option
