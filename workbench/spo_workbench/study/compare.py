"""A learning study: SPO-tree, SPO-chain, GRPO and GRPO with the probability mask, several seeds each,
every (algorithm, seed) its own verl run to the same budget of generated tokens, then one report.

    bash scripts/compare.sh [--setting cpu-smollm2] [--algorithms spo_tree,grpo] [--seeds 0,1,2]
                            [--token-budget 8000] [--lr 1e-5 | --lr spo_tree=1e-5,grpo=5e-6] [--prompts-per-step 8]
                            [--val-every 5] [--max-steps 30] [--task add_sub] [--validate-on test|tune]
                            [--sampled-validation 4] [--output-dir outputs/study-<setting>] [--quick] [--report-only]
                            [-- HYDRA_OVERRIDES...]

Each run is the project's run script (``scripts/spo_launch.sh``) with the study's setting, in its own
folder ``<output-dir>/<algorithm>/seed<k>/``. Running the command again skips finished runs (their
``done.json``) and resumes unfinished ones from their last checkpoint whose step was logged (two are
kept, written at every validation), with the generated tokens the earlier attempts spent up to that checkpoint taken off the
budget and the last step the run had already chosen kept (one stopped after its last step trains no
more); so a study survives a killed job and can be spread over several sittings, and a resumed run ends
where it would have ended. One progress line per step and one line per finished run are printed.

On ``cpu-smollm2`` the held-out set is 256 problems (``VAL_FILES`` overrides it), validated greedily, and
the study trains with the settings its learning-rate sweep chose (``STUDY_SETTING_DEFAULTS``, docs/RESULTS.md):
8 prompts a step in 2 optimizer steps of 4. ``--prompts-per-step N`` sets ``data.train_batch_size=N``
and ``ppo_mini_batch_size=N/2`` (two optimizer steps a step) on any setting.

``--validate-on tune`` validates on problems of their own (none of them a training or held-out
problem), for choosing settings such as the learning rate without looking at the test set.
``--sampled-validation N`` adds, once a run has trained, a validation of its final policy with N
samples a problem at the training temperature (verl's validation, ``trainer.val_only``, from the
last checkpoint), beside the greedy ones. ``--report-only`` trains nothing and writes the report and
the final table of the runs that have finished (a study restored from its archive, or one still running).

Seeds: seed ``k`` sets verl's ``data.seed`` (the order the training prompts are drawn in: the same
for every algorithm under one seed) and ``actor_rollout_ref.rollout.seed`` (vLLM's engine seed).
vLLM's sampling is not reproducible request by request (verl seeds requests only under
``full_determinism``, which would give a prompt's samples one seed), so two runs with one seed
share their data order but not their samples.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from spo_workbench import REPO
from recipe.spo.metrics_log import read_logged_steps

ALGORITHMS = ("spo_tree", "spo_chain", "grpo", "grpo_prob_mask", "spo_tree_cutpoint")
SETTINGS = ("cpu-smollm2", "cpu-tiny", "gsm8k-rhomath-1.1b", "math-r1-1.5b")
VALIDATION_KEY_PREFIX = "val-core/"
GENERATED = "spo/generated_tokens"
DONE_FILE, ATTEMPTS_FILE, TRAINED_FILE = "done.json", "attempts.json", "trained.json"
SAMPLED_METRICS_FILE = "metrics-sampled-validation.jsonl"
# A run that logs no step for --stall-minutes is stopped and resumed from its checkpoint, at most this often.
STALL_RETRIES = 2


@dataclass(frozen=True)
class Study:
    setting: str
    algorithms: tuple[str, ...]
    seeds: tuple[int, ...]
    token_budget: int
    max_steps: int
    val_every: int
    output_dir: Path
    lr: float | None = None
    prompts_per_step: int | None = None
    overrides: tuple[str, ...] = ()
    task: str | None = None  # cpu-smollm2's generated task (None: the setting's default)
    lr_by_algorithm: tuple[tuple[str, float], ...] = ()  # each algorithm's own rate (over ``lr``)
    validate_on: str = "test"  # cpu-smollm2: the held-out problems ("test") or the problems it tunes on ("tune")
    sampled_validation: int = 0  # after training, this many samples a problem at the training temperature (0: none)
    report_only: bool = False  # train nothing: the report and table of the runs that have finished
    stall_minutes: float = 60.0  # a training attempt that logs no step for this long is stopped and resumed (0: never)

    def learning_rate(self, algorithm: str) -> float | None:
        return dict(self.lr_by_algorithm).get(algorithm, self.lr)

    def training_overrides(self, algorithm: str | None = None) -> list[str]:
        """The study's training settings as Hydra overrides (the user's own come after them and win)."""
        values = []
        lr = self.learning_rate(algorithm) if algorithm is not None else self.lr
        if lr is not None:
            values.append(f"actor_rollout_ref.actor.optim.lr={lr}")
        if self.prompts_per_step is not None:
            values += [f"data.train_batch_size={self.prompts_per_step}",
                       f"actor_rollout_ref.actor.ppo_mini_batch_size={self.prompts_per_step // 2}"]
        return values + list(self.overrides)


# --quick: the whole pipeline on the tiny model in minutes (CI); the defaults: the CPU default's study.
QUICK = dict(setting="cpu-tiny", algorithms=("spo_tree", "spo_tree_cutpoint"), seeds=(0,), token_budget=500, max_steps=3,
             val_every=1)
DEFAULTS = dict(setting="cpu-smollm2", algorithms=ALGORITHMS, seeds=(0, 1, 2), token_budget=8_000, max_steps=30,
                val_every=5)
# What the study trains with on a setting unless told otherwise (elsewhere: the setting's own values).
STUDY_SETTING_DEFAULTS = {"cpu-smollm2": dict(lr=1e-5, prompts_per_step=8)}


def validation_accuracy(data: dict, samples: int = 1) -> float | None:
    """verl's validation accuracy in a logged step: the mean score over ``samples`` answers a problem."""
    suffix = f"/acc/mean@{samples}"
    for key, value in sorted(data.items()):
        if key.startswith(VALIDATION_KEY_PREFIX) and key.endswith(suffix):
            return value
    return None


def progress_line(run: str, step: int, data: dict, spent: float, budget: int) -> str:
    parts = [f"compare: {run:<20} step {step:>3}"]
    if "critic/score/mean" in data:
        parts.append(f"reward {data['critic/score/mean']:.3f}")
    accuracy = validation_accuracy(data)
    if accuracy is not None:
        parts.append(f"held-out acc {accuracy:.3f}")
    if GENERATED in data:
        parts.append(f"generated {data[GENERATED]:,.0f} (total {spent:,.0f} of {budget:,})")
    if "timing_s/step" in data:
        parts.append(f"{data['timing_s/step']:.0f} s")
    return ", ".join(parts)




@dataclass
class RunFolder:
    """One (algorithm, seed) of a study: its attempts' metric files, checkpoints and done marker."""

    path: Path
    attempts: list[dict] = field(default_factory=list)  # [{"metrics": file name, "resumed_from": step}]

    @classmethod
    def open(cls, path: Path) -> "RunFolder":
        path.mkdir(parents=True, exist_ok=True)
        attempts_file = path / ATTEMPTS_FILE
        attempts = json.loads(attempts_file.read_text()) if attempts_file.exists() else []
        return cls(path, attempts)

    @property
    def done(self) -> bool:
        return (self.path / DONE_FILE).exists()

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    def checkpointed_step(self) -> int:
        """The step of the last checkpoint verl completed (0: none)."""
        marker = self.checkpoints / "latest_checkpointed_iteration.txt"
        return int(marker.read_text().strip()) if marker.exists() else 0

    def resumable_step(self) -> int:
        """The latest completed checkpoint whose steps up to it are all in the metrics (verl saves a
        step's checkpoint before it logs the step, so a run stopped in between has a checkpoint whose
        step, and its generated tokens, were never logged: resume from the one before); 0: none."""
        logged = set(self.merged_steps())
        done = self.checkpointed_step()
        steps = sorted((int(path.name.removeprefix("global_step_")) for path in self.checkpoints.glob("global_step_*")
                        if path.name.removeprefix("global_step_").isdigit()), reverse=True)
        return next((step for step in steps if step <= done and set(range(1, step + 1)) <= logged), 0)

    def merged_steps(self) -> dict[int, dict]:
        """Every step once, from the attempt that ran it last: a resumed attempt redoes the steps after
        the checkpoint it resumed from, so an earlier attempt's steps past that point are dropped."""
        merged: dict[int, dict] = {}
        for attempt in self.attempts:
            for step in [s for s in merged if s > attempt["resumed_from"]]:
                del merged[step]
            merged.update(read_logged_steps(self.path / attempt["metrics"]))
        return dict(sorted(merged.items()))

    def spent_until(self, step: int) -> float:
        return sum(data.get(GENERATED, 0.0) for s, data in self.merged_steps().items() if 0 < s <= step)

    def chosen_last_step(self, until: int, budget: float) -> int | None:
        """The last step the run had chosen by the end of step ``until``: the token budget makes step
        k + 1 the last once the tokens up to k plus step k's own reach the budget
        (``spo_verl.adapters.trainer.token_budget``); None where it had not chosen. The choice lived in
        the stopped process, so a run resumed from ``until`` is held to it here."""
        steps, spent = self.merged_steps(), 0.0
        for step in range(1, until + 1):
            tokens = steps.get(step, {}).get(GENERATED)
            if tokens is None:
                return None
            spent += tokens
            if spent + tokens >= budget:
                return step + 1
        return None

    def new_attempt(self, resumed_from: int) -> Path:
        name = f"metrics-attempt{len(self.attempts) + 1}.jsonl"
        self.attempts.append({"metrics": name, "resumed_from": resumed_from})
        (self.path / ATTEMPTS_FILE).write_text(json.dumps(self.attempts, indent=1))
        return self.path / name

    def record_process(self, process_group: int) -> None:
        self.attempts[-1]["process_group"] = process_group
        (self.path / ATTEMPTS_FILE).write_text(json.dumps(self.attempts, indent=1))

    def write_merged(self) -> Path:
        """All steps in one metrics file (verl's format), with the cumulative token count recomputed."""
        merged = self.path / "metrics.jsonl"
        total = 0.0
        with open(merged, "w") as out:
            for step, data in self.merged_steps().items():
                if step > 0:
                    total += data.get(GENERATED, 0.0)
                    data = {**data, "spo/generated_tokens_cumulative": total}
                out.write(json.dumps({"step": step, "data": data}) + "\n")
        return merged


class RunStalled(RuntimeError):
    """A training attempt logged no step for the study's ``stall_minutes`` while its trainer lived: when Ray
    kills a vLLM server or a worker (its memory monitor does so under memory pressure), verl's trainer can wait
    for its answers for ever."""


def _follow(process: subprocess.Popen, metrics: Path, name: str, spent: float, budget: int,
            stall_s: float | None = None, poll_s: float = 2.0):
    """Print each step the run logs until its process ends; :class:`RunStalled` when ``stall_s`` pass
    without a new step while it runs."""
    printed, progressed = 0, time.monotonic()
    while True:
        finished = process.poll() is not None
        steps = read_logged_steps(metrics)
        for step, data in steps[printed:]:
            spent += data.get(GENERATED, 0.0) if step > 0 else 0.0
            print(progress_line(name, step, data, spent, budget), flush=True)
        if len(steps) > printed:
            printed, progressed = len(steps), time.monotonic()
        if finished:
            return
        if stall_s and time.monotonic() - progressed > stall_s:
            raise RunStalled(f"no step logged for {stall_s / 60:g} minutes while its trainer ran")
        time.sleep(poll_s)


def _stop_run(process: subprocess.Popen, grace_s: float = 60.0) -> None:
    """SIGTERM to the run's session, then wait until every process of it has ended (Ray's actors keep
    writing metrics and checkpoints for a while after their driver got the signal); SIGKILL after
    ``grace_s``."""
    try:
        tree = [psutil.Process(process.pid), *psutil.Process(process.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    try:
        os.killpg(process.pid, signal.SIGTERM)
    except ProcessLookupError:
        pass
    for survivor in psutil.wait_procs(tree, timeout=grace_s)[1]:
        survivor.kill()
    process.wait()


def _wait_for_earlier_attempt(folder: "RunFolder", name: str, wait_s: float = 120.0) -> None:
    """An earlier attempt's processes may still be ending (a study killed without its signal
    handler): a second run in the same folder would race it for the checkpoints."""
    pgid = folder.attempts[-1].get("process_group") if folder.attempts else None
    deadline = time.monotonic() + wait_s
    while pgid is not None and any(p.info["pid"] != os.getpid() and _in_group(p, pgid)
                                   for p in psutil.process_iter(["pid"])):
        if time.monotonic() > deadline:
            raise RuntimeError(f"compare: {name}: processes of its previous attempt (process group {pgid}) are "
                               f"still running; stop them (kill -- -{pgid}) and run the command again")
        time.sleep(2)


def _in_group(process: psutil.Process, pgid: int) -> bool:
    try:
        return os.getpgid(process.info["pid"]) == pgid
    except (ProcessLookupError, PermissionError):
        return False


def run_one(study: Study, algorithm: str, seed: int) -> bool:
    """Train (or resume) one (algorithm, seed) run to the study's budget, then (``sampled_validation``)
    validate its final policy by sampling; True when it is done."""
    name = f"{algorithm}/seed{seed}"
    folder = RunFolder.open(study.output_dir / algorithm / f"seed{seed}")
    if folder.done:
        print(f"compare: {name}: finished earlier, skipped ({folder.path / DONE_FILE})", flush=True)
        return True
    trained = folder.path / TRAINED_FILE
    if not trained.exists() and not _train(study, folder, algorithm, seed):
        return False
    summary = json.loads(trained.read_text())
    if study.sampled_validation:
        accuracy = _sampled_validation(study, folder, algorithm, seed, summary["steps"])
        if accuracy is None:
            return False
        summary["final_sampled_accuracy"] = accuracy
    (folder.path / DONE_FILE).write_text(json.dumps(summary, indent=1))
    shutil.rmtree(folder.checkpoints, ignore_errors=True)  # a finished run needs no checkpoint (GBs each)
    print(f"compare: {name}: done: {summary['steps']} steps, {summary['generated_tokens']:,.0f} generated tokens, "
          f"final held-out accuracy {summary['final_held_out_accuracy']}"
          + (f", sampled {summary['final_sampled_accuracy']:.3f}" if "final_sampled_accuracy" in summary else ""),
          flush=True)
    return True


def _launch_env(study: Study, folder: "RunFolder", algorithm: str, seed: int, metrics: Path) -> dict[str, str]:
    env = dict(
        os.environ, SETTING=study.setting, ALGORITHM=algorithm, CLUSTER_SETTING="math-r1-1.5b",
        EXPERIMENT_NAME=f"study-{algorithm}-seed{seed}", PROJECT_NAME="spo-study", VERL_FILE_LOGGER_PATH=str(metrics),
        CHECKPOINT_DIR=str(folder.checkpoints), TENSORBOARD_DIR=str(folder.path / "tensorboard"),
        TOTAL_TRAINING_STEPS=str(study.max_steps), TEST_FREQ=str(study.val_every), SAVE_FREQ=str(study.val_every),
    )
    if study.setting == "cpu-smollm2":  # the study's held-out set: 256 problems (the run scripts use 64 of them)
        from recipe.spo.cpu_settings import smollm2 as cpu_smollm2

        task = study.task or cpu_smollm2.DEFAULT_TASK
        env["SMOLLM2_TASK"] = task
        env.setdefault("VAL_FILES", cpu_smollm2.study_val_files(cpu_smollm2.default_cache(), task, study.validate_on))
    return env


def _launch_command(study: Study, folder: "RunFolder", algorithm: str, seed: int, resume_step: int,
                    *overrides: str) -> list[str]:
    """The run script with the study's settings for one arm and seed, starting from the checkpoint of
    ``resume_step`` (0: from the base model)."""
    checkpoint = folder.checkpoints / f"global_step_{resume_step}"
    resume = (["trainer.resume_mode=resume_path", f"trainer.resume_from_path={checkpoint}"] if resume_step
              else ["trainer.resume_mode=disable"])
    return ["bash", str(REPO / "scripts" / "spo_launch.sh"), *overrides, *resume,
            f"data.seed={seed}", f"actor_rollout_ref.rollout.seed={seed}", *study.training_overrides(algorithm)]


def _run_logged(command: list[str], env: dict, console: Path, record_process, metrics: Path, name: str,
                spent: float, budget: int, stall_s: float | None = None) -> int:
    with open(console, "w") as out:
        # Its own session, so that stopping the study stops the run's Ray and vLLM processes with it.
        process = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT,
                                   start_new_session=True)
        record_process(process.pid)
        try:
            _follow(process, metrics, name, spent, budget, stall_s)
        except BaseException:
            _stop_run(process)
            raise
    return process.returncode


def _train(study: Study, folder: "RunFolder", algorithm: str, seed: int) -> bool:
    """Train the run to its budget, resuming from its last checkpoint after an attempt that stalled."""
    name = f"{algorithm}/seed{seed}"
    for retry in range(STALL_RETRIES + 1):
        try:
            return _train_from_last_checkpoint(study, folder, algorithm, seed)
        except RunStalled as stalled:
            again = "resuming from its last checkpoint" if retry < STALL_RETRIES else "rerun the command to resume"
            print(f"compare: {name}: {stalled}; stopped it (see its console log), {again}", flush=True)
    return False


def _train_from_last_checkpoint(study: Study, folder: "RunFolder", algorithm: str, seed: int) -> bool:
    name = f"{algorithm}/seed{seed}"
    _wait_for_earlier_attempt(folder, name)
    resumed_from = folder.resumable_step()
    if resumed_from == 0:
        shutil.rmtree(folder.checkpoints, ignore_errors=True)  # nothing usable: start from the base model
    spent = folder.spent_until(resumed_from)
    last = folder.chosen_last_step(resumed_from, study.token_budget)
    started = time.monotonic()
    if resumed_from and (last == resumed_from or resumed_from >= study.max_steps):
        # Stopped after its last step was trained, validated, checkpointed and logged: nothing to redo.
        print(f"compare: {name}: resuming from step {resumed_from} ({spent:,.0f} tokens spent): its last step, "
              "nothing left to train", flush=True)
    elif not _train_attempt(study, folder, algorithm, seed, resumed_from, spent, last):
        return False
    steps = folder.merged_steps()
    folder.write_merged()
    trained = [s for s in steps if s > 0]
    summary = {"algorithm": algorithm, "seed": seed, "steps": max(trained, default=0),
               "generated_tokens": folder.spent_until(max(trained, default=0)),
               "final_held_out_accuracy": next((validation_accuracy(d) for s, d in reversed(steps.items())
                                                if validation_accuracy(d) is not None), None),
               "learning_rate": study.learning_rate(algorithm),
               "attempts": len(folder.attempts), "last_attempt_s": round(time.monotonic() - started)}
    (folder.path / TRAINED_FILE).write_text(json.dumps(summary, indent=1))
    return True


def _train_attempt(study: Study, folder: "RunFolder", algorithm: str, seed: int, resumed_from: int, spent: float,
                   last: int | None) -> bool:
    """One attempt of the run's training from the checkpoint of ``resumed_from`` (0: the base model) to the
    budget; ``last``: the last step the run had already chosen, if any. True when it exited cleanly."""
    name = f"{algorithm}/seed{seed}"
    remaining = max(1, int(study.token_budget - spent))
    metrics = folder.new_attempt(resumed_from)
    command = _launch_command(
        study, folder, algorithm, seed, resumed_from,
        f"algorithm.spo.budget.generated_tokens={remaining}",
        f"algorithm.spo.diagnostics.sample_log.dir={folder.path}",
        # Every validation's answers (verl writes <step>.jsonl: input, output, score), for the error analysis.
        f"trainer.validation_data_dir={folder.path / 'validation'}",
        f"trainer.val_before_train={str(resumed_from == 0).lower()}",  # step 0: the base model's accuracy
        # Two checkpoints kept: the latest may belong to a step that was never logged.
        "trainer.max_actor_ckpt_to_keep=2",
    )
    if last is not None and last < study.max_steps:  # the choice the stopped process had made
        command.append(f"trainer.total_training_steps={last}")
    how = f"resuming from step {resumed_from} ({spent:,.0f} tokens spent)" if resumed_from else "training"
    console = folder.path / f"console-attempt{len(folder.attempts)}.log"
    print(f"compare: {name}: {how} (console: {console})", flush=True)
    returncode = _run_logged(command, _launch_env(study, folder, algorithm, seed, metrics), console,
                             folder.record_process, metrics, name, spent, study.token_budget, study.stall_minutes * 60)
    if returncode != 0:
        print(f"compare: {name}: exit code {returncode}; see {console}; rerun the command to resume", flush=True)
    return returncode == 0


def _sampled_validation(study: Study, folder: "RunFolder", algorithm: str, seed: int, step: int) -> float | None:
    """The final policy (the run's last checkpoint) validated by sampling ``study.sampled_validation``
    answers a problem at the training temperature: verl's own validation (``trainer.val_only``), its
    answers in ``validation_sampled/<step>.jsonl``; returns the mean accuracy over every sample."""
    name = f"{algorithm}/seed{seed}"
    metrics = folder.path / SAMPLED_METRICS_FILE
    metrics.unlink(missing_ok=True)
    samples = study.sampled_validation
    command = _launch_command(
        study, folder, algorithm, seed, step,
        f"trainer.validation_data_dir={folder.path / 'validation_sampled'}",
        "trainer.val_only=true", "trainer.val_before_train=true",
        f"actor_rollout_ref.rollout.val_kwargs.n={samples}", "actor_rollout_ref.rollout.val_kwargs.do_sample=true",
        "actor_rollout_ref.rollout.val_kwargs.temperature=${actor_rollout_ref.rollout.temperature}",
        "actor_rollout_ref.rollout.val_kwargs.top_p=${actor_rollout_ref.rollout.top_p}",
        "actor_rollout_ref.rollout.val_kwargs.top_k=${actor_rollout_ref.rollout.top_k}",
    )
    console = folder.path / "console-sampled-validation.log"
    print(f"compare: {name}: validating the final policy, {samples} samples a problem (console: {console})", flush=True)
    # Not an attempt of the training run: its log is kept apart from the merged training steps.
    returncode = _run_logged(command, _launch_env(study, folder, algorithm, seed, metrics), console, lambda pid: None,
                             metrics, name, 0.0, study.token_budget)
    logged = [validation_accuracy(data, samples) for _, data in read_logged_steps(metrics)]
    accuracy = next((a for a in logged if a is not None), None)
    if returncode != 0 or accuracy is None:
        print(f"compare: {name}: the sampled validation failed (exit code {returncode}); see {console}; rerun the "
              f"command to try again", flush=True)
        return None
    return accuracy


def _has_answer_texts(dump: Path) -> bool:
    with open(dump) as handle:
        first = handle.readline()
    return bool(first.strip()) and "output" in json.loads(first)


def write_error_table(study: Study, path: Path) -> Path | None:
    """cpu-smollm2: what the held-out answers got wrong at each run's first and last validation
    (``spo_verl.core.credit.answer_errors``), one CSV row per (algorithm, seed, step), shares of the answers.
    None for a multi-turn task: the kinds are those of one arithmetic problem's worked answer. A run
    restored from a study's archive keeps each answer's score but not its text, so it has no row."""
    from recipe.spo.cpu_settings.smollm2 import DIALOGUE_TASKS

    if study.setting != "cpu-smollm2" or study.task in DIALOGUE_TASKS:
        return None
    import csv

    from spo_verl.core.credit.answer_errors import KINDS, count_kinds

    rows = []
    for algorithm in study.algorithms:
        for seed in study.seeds:
            dumps = sorted((study.output_dir / algorithm / f"seed{seed}" / "validation").glob("*.jsonl"),
                           key=lambda dump: int(dump.stem) if dump.stem.isdigit() else -1)
            for dump in dumps[:1] + dumps[-1:] if len(dumps) > 1 else dumps:
                if not _has_answer_texts(dump):
                    continue
                kinds = count_kinds(dump)
                total = sum(kinds.values()) or 1
                rows.append([algorithm, seed, dump.stem, total, *(round(kinds[k] / total, 4) for k in KINDS)])
    if not rows:
        return None
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["algorithm", "seed", "step", "answers", *KINDS])
        writer.writerows(rows)
    return path


def report(study: Study) -> int:
    args = [sys.executable, "-m", "spo_workbench.report", "--output", str(study.output_dir / "report"),
            "--title", f"SPO vs GRPO, {study.setting}, {len(study.seeds)} seed(s)"]
    for algorithm in study.algorithms:
        for seed in study.seeds:
            folder = study.output_dir / algorithm / f"seed{seed}"
            if (folder / DONE_FILE).exists():
                samples = folder / "samples.jsonl"
                args += ["--run", f"{algorithm}/seed{seed}={folder / 'metrics.jsonl'}"
                         + (f",{samples}" if samples.exists() else "")]
    if "--run" not in args:
        print("compare: no run has finished yet: no report", flush=True)
        return 0
    status = subprocess.run(args, cwd=REPO).returncode
    errors = write_error_table(study, study.output_dir / "report" / "errors.csv")
    if errors is not None:
        print(f"compare: held-out errors by kind (first and last validation of each run): {errors}", flush=True)
    from spo_workbench.study.table import write_table

    table = write_table(study.output_dir, study.output_dir / "report" / "table.md")
    if table is not None:
        print(f"compare: final table with standard errors over seeds and problems: {table}", flush=True)
    return status


def _learning_rates(text: str) -> tuple[tuple[str | None, float], ...]:
    """``1e-5`` (every algorithm) or ``spo_tree=1e-5,grpo=5e-6``."""
    try:
        if "=" not in text:
            return ((None, float(text)),)
        return tuple((name.strip(), float(rate)) for name, rate in (item.split("=", 1) for item in text.split(",") if item))
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"expected a rate or algorithm=rate pairs: {error}") from None


def _csv(kind, text: str) -> tuple:
    try:
        return tuple(kind(item) for item in text.split(",") if item)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def parse_args(argv=None) -> Study:
    parser = argparse.ArgumentParser(prog="bash scripts/compare.sh", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true",
                        help=f"the pipeline in minutes: {QUICK['setting']}, {QUICK['algorithms'][0]}, one seed, "
                             f"{QUICK['token_budget']} tokens (options given as well still apply)")
    parser.add_argument("--setting", choices=SETTINGS, help=f"run setting (default {DEFAULTS['setting']})")
    parser.add_argument("--algorithms", type=lambda t: _csv(str, t),
                        help=f"comma-separated subset of {','.join(ALGORITHMS)} (default: all)")
    parser.add_argument("--seeds", type=lambda t: _csv(int, t), help="comma-separated seeds (default 0,1,2)")
    parser.add_argument("--token-budget", type=int, help=f"generated tokens per run (default {DEFAULTS['token_budget']:,})")
    parser.add_argument("--lr", type=_learning_rates,
                        help="actor learning rate, one for all (1e-5) or per algorithm (spo_tree=1e-5,grpo=5e-6; the "
                             "others take the default); default: the study's for the setting, cpu-smollm2 1e-5; else "
                             "the setting's")
    parser.add_argument("--prompts-per-step", type=int, help="prompts a step, in two optimizer steps (default: the "
                                                             "study's for the setting, cpu-smollm2 8; else the setting's)")
    parser.add_argument("--val-every", type=int, help=f"validate and checkpoint every N steps (default {DEFAULTS['val_every']})")
    parser.add_argument("--max-steps", type=int, help=f"step bound per run (default {DEFAULTS['max_steps']})")
    parser.add_argument("--task", help="cpu-smollm2's generated task (default add_sub; the tasks of "
                                       "recipe/spo/cpu_settings/smollm2.py, docs/RESULTS.md)")
    parser.add_argument("--validate-on", choices=("test", "tune"), default="test",
                        help="cpu-smollm2: validate on the held-out problems (test, default) or on the problems "
                             "kept for tuning (tune: choosing settings never looks at the test set)")
    parser.add_argument("--sampled-validation", type=int, default=0, metavar="N",
                        help="after training, validate the final policy with N samples a problem at the training "
                             "temperature (verl's validation; 0, the default: none)")
    parser.add_argument("--output-dir", type=Path, help="default: outputs/study-<setting>")
    parser.add_argument("--report-only", action="store_true",
                        help="train nothing: write the report and the final table of the runs that have finished "
                             "(e.g. a study's runs restored from its archive)")
    parser.add_argument("--stall-minutes", type=float, default=60.0, metavar="M",
                        help="stop a run that logs no training step for M minutes (a worker Ray killed can leave "
                             f"verl waiting for ever) and resume it from its last checkpoint, at most {STALL_RETRIES} "
                             "times (default 60; 0: never)")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for every run (after --)")
    args = parser.parse_args(argv)
    base = {**DEFAULTS, **(QUICK if args.quick else {})}
    given = {key: getattr(args, key) for key in ("setting", "algorithms", "seeds", "token_budget", "val_every",
                                                  "max_steps") if getattr(args, key) is not None}
    values = {**base, **given}
    unknown = sorted(set(values["algorithms"]) - set(ALGORITHMS))
    if unknown or not values["algorithms"]:
        parser.error(f"--algorithms must be a non-empty subset of {','.join(ALGORITHMS)}, got {unknown or 'none'}")
    if not values["seeds"]:
        parser.error("--seeds must name at least one seed")
    for key in ("token_budget", "val_every", "max_steps"):
        if values[key] < 1:
            parser.error(f"--{key.replace('_', '-')} must be a positive integer, got {values[key]}")
    rates = dict(args.lr or {})
    unknown_rates = sorted(set(rates) - {None, *values["algorithms"]})
    if unknown_rates:
        parser.error(f"--lr names algorithms the study does not run: {','.join(unknown_rates)} (it runs "
                     f"{','.join(values['algorithms'])})")
    if any(not rate > 0 for rate in rates.values()):
        parser.error(f"--lr must be positive, got {args.lr}")
    if not args.stall_minutes >= 0:
        parser.error(f"--stall-minutes must be 0 (never) or a number of minutes, got {args.stall_minutes}")
    if args.sampled_validation < 0:
        parser.error(f"--sampled-validation must be 0 (none) or a number of samples, got {args.sampled_validation}")
    if args.validate_on != "test" and values["setting"] != "cpu-smollm2":
        parser.error(f"--validate-on {args.validate_on} needs the cpu-smollm2 setting (its tuning problems), not "
                     f"{values['setting']}")
    if args.prompts_per_step is not None and (args.prompts_per_step < 2 or args.prompts_per_step % 2):
        parser.error(f"--prompts-per-step must be an even number of at least 2 (two optimizer steps), got "
                     f"{args.prompts_per_step}")
    if args.task is not None:
        from recipe.spo.cpu_settings.smollm2 import ALL_TASKS, DIALOGUE_TASKS

        if values["setting"] != "cpu-smollm2":
            parser.error(f"--task picks a task of the cpu-smollm2 setting, not of {values['setting']}")
        if args.task not in ALL_TASKS:
            parser.error(f"--task must be one of {','.join(ALL_TASKS)}, got {args.task!r}")
        # A tree that forks at cutpoints inside a response has no form over turns (the launcher refuses it too).
        if args.task in DIALOGUE_TASKS and "spo_tree_cutpoint" in values["algorithms"]:
            parser.error(f"--task {args.task} is a multi-turn task; spo_tree_cutpoint cannot play its episodes "
                         f"(allowed: {','.join(a for a in ALGORITHMS if a != 'spo_tree_cutpoint')})")
    setting_defaults = STUDY_SETTING_DEFAULTS.get(values["setting"], {})
    lr = rates.pop(None, setting_defaults.get("lr"))
    prompts = args.prompts_per_step if args.prompts_per_step is not None else setting_defaults.get("prompts_per_step")
    output_dir = (args.output_dir or REPO / "outputs" / f"study-{values['setting']}").resolve()
    return Study(values["setting"], tuple(values["algorithms"]), tuple(values["seeds"]), values["token_budget"],
                 values["max_steps"], values["val_every"], output_dir, lr, prompts, tuple(args.overrides), args.task,
                 tuple(sorted(rates.items())), args.validate_on, args.sampled_validation, args.report_only,
                 args.stall_minutes)


def _stop_on_sigterm(signum, frame):
    raise KeyboardInterrupt(f"signal {signum}")


def main(argv=None) -> int:
    study = parse_args(argv)
    signal.signal(signal.SIGTERM, _stop_on_sigterm)  # a killed job stops its run too; rerun to resume
    runs = [(algorithm, seed) for seed in study.seeds for algorithm in study.algorithms]
    print(f"compare: {len(runs)} run(s) on SETTING={study.setting} ({', '.join(study.algorithms)}; seeds "
          f"{', '.join(map(str, study.seeds))}), each to {study.token_budget:,} generated tokens (at most "
          f"{study.max_steps} steps), validating every {study.val_every} on the {study.validate_on} problems; "
          f"training overrides: {' '.join(study.training_overrides()) or 'none'}"
          + "".join(f"; {a}: lr {study.learning_rate(a)}" for a, _ in study.lr_by_algorithm)
          + f"; output {study.output_dir}", flush=True)
    started = time.monotonic()
    failed = [] if study.report_only else [f"{a}/seed{s}" for a, s in runs if not run_one(study, a, s)]
    status = report(study)
    print(f"compare: done in {(time.monotonic() - started) / 60:.1f} min; report: "
          f"{study.output_dir / 'report' / 'report.html'}", flush=True)
    if failed:
        print(f"compare: unfinished runs: {', '.join(failed)} (rerun the command to resume them)", flush=True)
    return 1 if failed or status != 0 else 0


if __name__ == "__main__":
    raise SystemExit(main())
