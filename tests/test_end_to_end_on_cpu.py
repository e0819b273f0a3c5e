"""End to end through verl 0.9.1's real trainer on the CPU, started by the run scripts exactly as a
user starts them (``scripts/run_*.sh``, which run the recipe's entry point ``recipe.spo.main_spo``):
verl's TaskRunner and Ray worker groups, the FSDP2 engine training on gloo, verl's vLLM server on
vLLM's CPU backend, verl's GSM8K reward, the SPO advantage step and loss, and verl's actor -> vLLM
weight sync, on the tiny ``cpu-tiny`` setting (spo_verl/cpu_settings/tiny.py). The README's command, with
no settings, trains the CPU default (``cpu-smollm2``: SmolLM2-135M, whose tied head must sync into
vLLM), and the study command ``scripts/compare.sh --quick`` is stopped after its first checkpoint,
resumed and run once more, report included.

Every (trainer, algorithm) run trains 2 steps, validates and checkpoints at step 2, then a second
run resumes from that checkpoint and trains step 3. The runs start verl and vLLM from scratch
(about 2-3 minutes each on two cores, mostly process start-up), so they run a few at a time
(``SPO_E2E_PARALLEL``, default 3) in one module fixture, and each test reads its run's results.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
import os
import subprocess
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch

from spo_verl.cpu_settings import tiny as cpu_default
from spo_verl.metrics_log import read_logged_steps

REPO = Path(__file__).resolve().parents[1]
RUN_TIMEOUT_S = 900
PARALLEL_RUNS = int(os.environ.get("SPO_E2E_PARALLEL", "3"))
TRAIN_BATCH = 4  # prompts per step in the cpu-tiny setting
TREE_LEAF_SLOTS = 9  # its tree is 3-3; its cutpoint tree has at most 3 x (1 + 2) leaves
# fp32 actor and fp32 vLLM: after an update and a weight sync, rollout and actor probabilities of the
# same tokens agree to float32 rounding (about 1e-6 measured); a stale or broken sync is off by >1e-2.
SYNC_BOUND = 1e-4

# (test id, run script, ALGORITHM or None for the script's own, extra Hydra overrides, overrides of
# the first run only). Two first runs are allowed 6 steps but stop after step 2 because their
# generated-token budget (1 token) is reached after step 1: the equal-cost stop on both trainers.
BUDGET_STOP = ["trainer.total_training_steps=6", "algorithm.spo.generated_token_budget=1"]
# The CPU settings pack every micro-batch (each unique token once) and, on the v1 trainer, take vLLM's
# log-probs as the old log-probs (verl's bypass mode); CHECK adds the per-row check of the first update.
CHECK = ["algorithm.spo.packed_training_check=true"]
# verl's per-row forwards and recomputed old log-probs, as before packing existed.
PER_ROW = ["algorithm.spo.packed_training=false", "algorithm.rollout_correction.bypass_mode=false"]
# verl's default FSDP mixed precision (bfloat16 forward and backward, float32 reduction), the GPU's
# precision path; old log-probs recomputed, since the rollout's (float32) no longer equal the actor's.
VERL_MIXED_PRECISION = [
    f"actor_rollout_ref.{role}.fsdp_config.mixed_precision={{param_dtype:bf16,reduce_dtype:fp32,buffer_dtype:fp32}}"
    for role in ("actor", "ref")
] + ["algorithm.rollout_correction.bypass_mode=false"]
# Packed and per-row forwards agree to float32 rounding (measured ~3e-6 in log-prob at down to -20).
PACKED_LOG_PROB_BOUND = 2e-5
# In bfloat16 the actor differs from float32 vLLM and packed from per-row by bfloat16 rounding: a
# log-prob near -10 is held to about 0.04, and the largest difference over a step's few hundred
# tokens was 0.065 (packed vs per-row) and 0.011 in probability (rollout vs actor) in a trial run.
BF16_BOUND = 0.25
CASES = [
    ("v1-spo_tree", "run_spo_tree.sh", None, CHECK, []),
    ("v1-spo_tree-per_row", "run_spo_tree.sh", None, PER_ROW, []),
    ("v1-spo_chain", "run_spo_chain.sh", None, CHECK, []),
    ("v1-grpo", "run_grpo.sh", None, CHECK, BUDGET_STOP),
    ("v1-grpo_prob_mask-bf16", "run_grpo.sh", "grpo_prob_mask", [*CHECK, *VERL_MIXED_PRECISION], []),
    ("v1-ppo", "run_grpo.sh", "ppo", CHECK, []),
    ("v1-spo_tree_cutpoint", "run_spo_tree.sh", "spo_tree_cutpoint", CHECK, []),
    # The legacy trainer's tree path (a leaf row per session, stand-in rows that train nothing) with a
    # tree that forks at cutpoints: its unused slots are the stand-ins.
    ("legacy-spo_tree_cutpoint", "run_spo_tree.sh", "spo_tree_cutpoint", ["trainer.use_v1=false", *CHECK], []),
    ("legacy-spo_chain", "run_spo_chain.sh", None, ["trainer.use_v1=false", *CHECK], BUDGET_STOP),
]


def _sync_gap(data: dict) -> float | None:
    """The largest gap between vLLM's and the actor's probability of a sampled token: verl's
    ``training/rollout_probs_diff_max`` where the old log-probs were recomputed, else (verl's bypass
    mode: the rollout's log-probs are the old ones) the actor's first mini-batch against them."""
    if "training/rollout_probs_diff_max" in data:
        return data["training/rollout_probs_diff_max"]
    return data.get("spo/old_log_probs/probs_diff_max")


@dataclass
class Run:
    returncode: int
    log: Path
    metrics: Path
    seconds: float

    def steps(self) -> dict[int, dict]:
        return dict(read_logged_steps(self.metrics)) if self.metrics.exists() else {}

    def failure(self) -> str:
        return f"exit {self.returncode}; last lines of {self.log}:\n" + "\n".join(self.log.read_text().splitlines()[-40:])


@dataclass
class Case:
    first: Run
    resumed: Run | None
    checkpoints: Path
    extra: dict = field(default_factory=dict)


# Ray's own start-up can time out on a loaded two-core machine before verl runs at all (its raylet
# waits a fixed time for its agents); such a run is started once more. Any other failure counts.
RAY_STARTUP_FAILURE = "timed out during startup"


def _launch(script: str, env: dict, args: list[str], log: Path, metrics: Path) -> Run:
    started = time.perf_counter()
    for attempt in (1, 2):
        with open(log, "w") as out:
            process = subprocess.run(
                ["bash", f"scripts/{script}", *args], cwd=REPO, env={**env, "VERL_FILE_LOGGER_PATH": str(metrics)},
                stdout=out, stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S,
            )
        if process.returncode == 0 or RAY_STARTUP_FAILURE not in log.read_text() or metrics.exists():
            break
    return Run(process.returncode, log, metrics, time.perf_counter() - started)


def _run_case(case_id: str, script: str, algorithm: str | None, overrides: list[str], first_only: list[str],
              cache: Path, work: Path) -> Case:
    work.mkdir(parents=True)
    env = {**os.environ, "SPO_CPU_CACHE": str(cache), "CHECKPOINT_DIR": str(work / "checkpoints"),
           "TENSORBOARD_DIR": str(work / "tensorboard"), "EXPERIMENT_NAME": case_id}
    env["SETTING"] = "cpu-tiny"  # the tiny model: these runs check verl's paths, not learning
    if algorithm:
        env["ALGORITHM"] = algorithm
    first = _launch(script, {**env, "TOTAL_TRAINING_STEPS": "2", "SAVE_FREQ": "2", "TEST_FREQ": "2"},
                    [*overrides, *first_only], work / "first.log", work / "first.jsonl")
    resumed = None
    if first.returncode == 0:
        resumed = _launch(script, {**env, "TOTAL_TRAINING_STEPS": "3", "SAVE_FREQ": "-1", "TEST_FREQ": "-1"},
                          [*overrides, "trainer.resume_mode=auto"], work / "resumed.log", work / "resumed.jsonl")
    return Case(first, resumed, work / "checkpoints")


def _run_readme_command(work: Path, smollm2_folder: Path) -> Run:
    """``bash scripts/run_spo_tree.sh`` with no settings, as the README shows it: on a machine without a
    GPU it must pick the CPU default (SmolLM2) itself. Only the model cache is the tests' own."""
    work.mkdir(parents=True)
    env = {k: v for k, v in os.environ.items() if k not in ("SETTING", "ALGORITHM", "VERL_FILE_LOGGER_PATH")}
    env["SPO_SMOLLM2_CACHE"] = str(smollm2_folder)
    started = time.perf_counter()
    log = work / "readme.log"
    with open(log, "w") as out:
        process = subprocess.run(["bash", "scripts/run_spo_tree.sh"], cwd=REPO, env=env, stdout=out,
                                 stderr=subprocess.STDOUT, timeout=RUN_TIMEOUT_S)
    metrics = re.search(r"^spo: logs -> .* and (\S+); checkpoints", log.read_text(), re.MULTILINE)
    return Run(process.returncode, log, REPO / metrics.group(1) if metrics else Path(), time.perf_counter() - started)


@dataclass
class Study:
    """``scripts/compare.sh --quick`` stopped after its first checkpoint, run again (it resumes and
    finishes), and run a third time (it skips the finished run)."""

    killed: Run
    resumed: Run
    again: Run
    folder: Path


def _run_study(work: Path, cache: Path) -> Study:
    env = {k: v for k, v in os.environ.items() if k not in ("SETTING", "ALGORITHM", "VERL_FILE_LOGGER_PATH")}
    env["SPO_CPU_CACHE"] = str(cache)
    command = ["bash", "scripts/compare.sh", "--quick", "--max-steps", "3", "--val-every", "1", "--output-dir", str(work)]
    folder = work / "spo_tree" / "seed0"
    marker = folder / "checkpoints" / "latest_checkpointed_iteration.txt"
    runs = []
    for attempt in range(3):
        log = work.parent / f"study-{attempt}.log"
        started = time.perf_counter()
        with open(log, "w") as out:
            process = subprocess.Popen(command, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT)
            deadline = time.monotonic() + RUN_TIMEOUT_S
            while process.poll() is None and time.monotonic() < deadline:
                logged = [step for step, _ in read_logged_steps(folder / "metrics-attempt1.jsonl")] if attempt == 0 else []
                if attempt == 0 and marker.exists() and marker.read_text().strip() not in ("", "0") and 1 in logged:
                    process.terminate()  # as a scheduler ends a job: SIGTERM, once step 1 is checkpointed and logged
                time.sleep(1)
            if process.poll() is None:
                process.kill()
            process.wait()
        runs.append(Run(process.returncode, log, folder / "metrics.jsonl", time.perf_counter() - started))
    return Study(*runs, folder)


class RunSlots:
    """``SPO_E2E_PARALLEL`` slots shared by the runs. The SmolLM2 run takes two: it needs about twice the
    memory of a tiny-model run, and three runs beside it exceeded this 24 GiB machine (Ray's memory monitor
    killed its workers)."""

    def __init__(self, slots: int):
        self.slots = slots
        self._free = slots
        self._changed = threading.Condition()

    @contextlib.contextmanager
    def take(self, wanted: int):
        wanted = min(wanted, self.slots)
        with self._changed:
            self._changed.wait_for(lambda: self._free >= wanted)
            self._free -= wanted
        try:
            yield
        finally:
            with self._changed:
                self._free += wanted
                self._changed.notify_all()


def _in_slots(slots: RunSlots, wanted: int, run, *args):
    with slots.take(wanted):
        return run(*args)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, smollm2_cache):
    work = tmp_path_factory.mktemp("e2e")
    cache = work / "cpu-tiny"
    cpu_default.build(cache)  # once, before the runs that share it
    slots = RunSlots(PARALLEL_RUNS)
    with ThreadPoolExecutor(max_workers=PARALLEL_RUNS) as pool:
        # The longest run first, so it starts at once and the short ones fill the slots around it.
        readme = pool.submit(_in_slots, slots, 2, _run_readme_command, work / "readme", smollm2_cache["folder"])
        study = pool.submit(_in_slots, slots, 1, _run_study, work / "study", cache)
        futures = {
            case_id: pool.submit(_in_slots, slots, 1, _run_case, case_id, script, algorithm, overrides, first_only,
                                 cache, work / case_id)
            for case_id, script, algorithm, overrides, first_only in CASES
        }
        results = {case_id: future.result() for case_id, future in futures.items()}
        results["readme"] = readme.result()
        results["study"] = study.result()
    summary = {k: round(v.first.seconds if isinstance(v, Case) else
                        sum(r.seconds for r in (v.killed, v.resumed, v.again)) if isinstance(v, Study) else v.seconds)
               for k, v in results.items()}
    print(f"end-to-end run seconds: {json.dumps(summary)}")
    return results


def _finite(value) -> bool:
    return value is not None and math.isfinite(float(value))


def _assert_actor_updated_or_had_nothing_to_train(step: int, data: dict) -> None:
    """verl's actor update ran with a finite loss and gradient, unless SPO-tree had no segment to train
    that step (every tree's leaves agreed: all advantages 0), when the trainer skips the actor pass."""
    if data.get("spo/actor_update_rows") == 0:
        assert "actor/pg_loss" not in data and data["spo/actor_skipped_rows"] > 0, step
        return
    assert _finite(data.get("actor/pg_loss")), f"step {step}: actor/pg_loss={data.get('actor/pg_loss')}"
    assert _finite(data.get("actor/grad_norm")), f"step {step}: actor/grad_norm={data.get('actor/grad_norm')}"


def _assert_packed_training(steps: dict[int, dict], bound: float, checked_first: bool) -> None:
    """Each actor update packed its micro-batches (fewer tokens through the model than the rows hold;
    the old and reference log-probs were packed too), and with ``checked_first`` the first one also
    ran per row and found the same log-probs and loss."""
    updates = [step for step in sorted(steps) if "actor/pg_loss" in steps[step]]
    assert updates, "no actor update"
    for step in updates:
        data = steps[step]
        # Prompts of 40-52 tokens under responses of a few: a prompt and its responses (or a 3-3 tree)
        # pack 3-8x (trial runs: 432 of 3632 row tokens); 2x only if groups or padding rows were scattered.
        assert 0 < 2 * data["spo/packing/packed_tokens"] < data["spo/packing/row_tokens"], (step, data)
        assert data["spo/packing/per_row_micro_batches"] == 0, (step, data)
    checked = [step for step in updates if "spo/packing/check/micro_batches" in steps[step]]
    assert checked == (updates[:1] if checked_first else []), f"per-row check in steps {checked}, updates {updates}"
    if not checked_first:
        return
    first = steps[checked[0]]
    assert first["spo/packing/check/micro_batches"] >= 1
    assert first["spo/packing/check/log_prob_max_abs_diff"] < bound
    # The check's per-row loss uses the packed old log-probs: a log-prob difference d moves each token's
    # ratio by about d, times an advantage of at most 1 in magnitude here (0/1 rewards).
    assert first["spo/packing/check/loss_max_abs_diff"] < bound


def _actor_weights_changed(checkpoints: Path, base_model: Path) -> float:
    """Largest absolute difference between the step-2 actor checkpoint and the base model."""
    from safetensors.torch import load_file

    saved = torch.load(checkpoints / "global_step_2" / "actor" / "model_world_size_1_rank_0.pt", weights_only=False)
    base = load_file(str(base_model / "model.safetensors"))
    return max(
        float((value.full_tensor() if hasattr(value, "full_tensor") else value).float().sub(base[name].float()).abs().max())
        for name, value in saved.items()
    )


@pytest.mark.parametrize("case_id", [case[0] for case in CASES])
def test_trains_validates_checkpoints_and_resumes(runs, case_id):
    case: Case = runs[case_id]
    assert case.first.returncode == 0, case.first.failure()
    steps = case.first.steps()
    assert sorted(steps) == [1, 2], f"steps logged: {sorted(steps)}"
    algorithm = case_id.split("-")[1]

    bf16 = case_id.endswith("-bf16")
    bypass = case_id.startswith("v1-") and not bf16 and "per_row" not in case_id
    for step, data in steps.items():
        _assert_actor_updated_or_had_nothing_to_train(step, data)
        # The rollout and the actor computed the same tokens' probabilities with the same weights
        # (step 2's rollout came from the weights step 1 trained, synced into vLLM).
        gap = _sync_gap(data)
        if gap is not None or "actor/pg_loss" in data:
            assert gap < (BF16_BOUND if bf16 else SYNC_BOUND), (step, gap)
        if bypass:  # no old-log-prob pass: vLLM's log-probs are the old ones (verl still times the copy)
            assert "training/rollout_probs_diff_max" not in data and data["timing_s/old_log_prob"] < 1.0, step
            if "actor/pg_loss" in data:
                # The probability mask from vLLM's probabilities is the actor's (a token within ~1e-5 of
                # the threshold could flip; none is expected in a step of a few hundred tokens).
                assert data["spo/old_log_probs/prob_mask_flips"] <= 0.01 * data["spo/old_log_probs/tokens"], step
        else:
            assert "training/rollout_probs_diff_max" in data, step
    assert any(_sync_gap(data) is not None for data in steps.values())
    # Rewards that differ between samples: some advantage is not zero, so some update is real.
    assert any(data.get("critic/advantages/max", 0) - data.get("critic/advantages/min", 0) > 0 for data in steps.values())
    assert any(data.get("actor/grad_norm", 0) > 0 for data in steps.values())

    # Generated tokens of every algorithm, each tree node once, chains with their MC continuations.
    assert all(data["spo/generated_tokens"] > 0 for data in steps.values())
    assert steps[2]["spo/generated_tokens_cumulative"] == steps[1]["spo/generated_tokens"] + steps[2]["spo/generated_tokens"]
    last = steps[2]
    if algorithm.startswith("spo_tree"):
        assert last["spo/generated_tokens"] == last["spo/tree/generated_tokens"]
        assert last["spo/tree/trees"] == TRAIN_BATCH
        assert 1 <= last["spo/tree/leaves_per_tree"] <= TREE_LEAF_SLOTS
        assert 0 < last["spo/tree/generated_over_independent"] <= 1
        assert any(0 < data["spo/trained_token_fraction"] <= 1 for data in steps.values())
        # The mean segment is the tree's generated tokens over its nodes (every node generated once).
        nodes = last["spo/tree/nodes_per_tree"] * last["spo/tree/trees"]
        assert last["spo/tree/segment_tokens_mean"] == pytest.approx(last["spo/tree/generated_tokens"] / nodes)
    if algorithm == "spo_tree":
        # 3 depth-1 nodes, each either a leaf (early EOS) or the parent of 3 leaves.
        internal = last["spo/tree/nodes_per_tree"] - last["spo/tree/leaves_per_tree"]
        assert last["spo/tree/nodes_per_tree"] >= 3 and 0 <= internal <= 3
        assert last["spo/tree/leaves_per_tree"] == 3 + 2 * internal  # an internal node's 3 leaves replace it
    if algorithm == "spo_tree_cutpoint":
        # 3 responses, each forking at most twice into one continuation: 3-9 paths, one leaf each.
        for data in steps.values():
            assert 3 <= data["spo/tree/paths_per_tree"] == data["spo/tree/leaves_per_tree"] <= TREE_LEAF_SLOTS
            assert 0 <= data["spo/tree/forks_per_response"] <= 2
            assert data["spo/tree/cutpoint_requests"] == 0  # T = 1, top-p 1: the sampler's log-probs decide
        # Answers like "3+4=7" have uncertain digits: some response forks, inside its response.
        assert any(data["spo/tree/forks_per_response"] > 0 for data in steps.values())
        assert all(0 <= data["spo/tree/fork_position_mean"] < 1 for data in steps.values() if "spo/tree/fork_position_mean" in data)
    if algorithm == "spo_chain":
        assert last["spo/chain/boundaries_per_response"] > 0
        assert last["spo/chain/mc_continuations"] > 0 and last["spo/chain/mc_tokens"] > 0
        assert 0 <= last["spo/chain/boundary_value_min"] <= last["spo/chain/boundary_value_max"] <= 1
        assert last["spo/generated_tokens"] > last["spo/chain/mc_tokens"]
    if algorithm in ("spo_tree", "spo_tree_cutpoint", "spo_chain", "grpo_prob_mask"):
        assert all(0 < data["spo/prob_mask/masked_fraction"] < 1 for data in steps.values())
    else:
        # Baselines: token counts, and what the packed forward and the old-log-prob probe report.
        spo_keys = {key for key in last if key.startswith("spo/")}
        other = {key for key in spo_keys if not key.startswith(("spo/packing/", "spo/old_log_probs/"))}
        assert other == {"spo/generated_tokens", "spo/generated_tokens_cumulative"}, spo_keys
    if algorithm == "ppo":
        assert _finite(last.get("critic/vf_loss"))
    if "per_row" in case_id:
        assert not any(key.startswith("spo/packing/") for data in steps.values() for key in data)
    else:
        overrides = next(case[3] for case in CASES if case[0] == case_id)
        _assert_packed_training(steps, BF16_BOUND if bf16 else PACKED_LOG_PROB_BOUND, CHECK[0] in overrides)

    # Validation at step 2 with verl's GSM8K reward on the held-out problems.
    assert "val-core/openai/gsm8k/acc/mean@1" in last
    # The actor's weights moved away from the base model.
    cache_model = Path(case.first.log).parents[1] / "cpu-tiny" / "model"
    assert _actor_weights_changed(case.checkpoints, cache_model) > 0
    # Checkpoint at step 2, and a second run resumed from it to train step 3 only.
    assert (case.checkpoints / "latest_checkpointed_iteration.txt").read_text().strip() == "2"
    assert case.resumed is not None and case.resumed.returncode == 0, case.resumed.failure()
    assert sorted(case.resumed.steps()) == [3]


def test_readme_run_script_trains_the_real_model_on_cpu(runs):
    run: Run = runs["readme"]
    assert run.returncode == 0, run.failure()
    log = run.log.read_text()
    assert "no GPU visible: training the CPU default (SETTING=cpu-smollm2" in log
    assert "checkpoints -> checkpoints/spo/cpu-smollm2-spo_tree" in log
    # The summary the script ends with: a header and one line per step (4 steps by default).
    summary = [line for line in log.splitlines() if line.startswith("spo: ")]
    header = next(i for i, line in enumerate(summary) if line.split()[1:3] == ["step", "score"])
    assert [line.split()[1] for line in summary[header + 1 :]] == ["1", "2", "3", "4"]
    steps = run.steps()
    assert sorted(steps) == [1, 2, 3, 4]
    assert any("actor/pg_loss" in data for data in steps.values()), "no step updated the actor"
    for step, data in steps.items():
        _assert_actor_updated_or_had_nothing_to_train(step, data)
        # SmolLM2's output head is its input embedding: after each update and sync into vLLM, vLLM's
        # probabilities of the sampled tokens are the actor's (a stale tied head would be far off).
        if "actor/pg_loss" in data:
            assert _sync_gap(data) < SYNC_BOUND, (step, _sync_gap(data))
            assert data["spo/packing/packed_tokens"] < 0.5 * data["spo/packing/row_tokens"], step
        assert data["spo/tree/trees"] == 4 and data["spo/generated_tokens"] == data["spo/tree/generated_tokens"] > 0
    assert "val-core/openai/gsm8k/acc/mean@1" in steps[2] and "val-core/openai/gsm8k/acc/mean@1" in steps[4]


def test_study_resumes_a_killed_run_and_skips_a_finished_one(runs):
    study: Study = runs["study"]
    # Stopped (SIGTERM) once its first checkpoint was written: the run stopped with it.
    assert study.killed.returncode != 0, study.killed.failure()
    first = read_logged_steps(study.folder / "metrics-attempt1.jsonl")
    assert first and first[0][0] == 0, "the first attempt validated the base model (step 0)"
    # Run again: resumed from that checkpoint with the tokens spent so far off the budget, finished.
    assert study.resumed.returncode == 0, study.resumed.failure()
    resumed_log = study.resumed.log.read_text()
    # From the last checkpoint whose step was logged (the study was stopped after step 1's checkpoint
    # and its log line; stopped in between, it would resume from the checkpoint before).
    match = re.search(r"compare: spo_tree/seed0: resuming from step (\d+) \(([\d,]+) tokens spent\)", resumed_log)
    assert match, resumed_log[-2000:]
    resumed_from, spent = int(match.group(1)), int(match.group(2).replace(",", ""))
    assert resumed_from >= 1
    attempts = json.loads((study.folder / "attempts.json").read_text())
    assert [a["resumed_from"] for a in attempts] == [0, resumed_from]
    assert all(a["process_group"] > 0 for a in attempts)
    second = dict(read_logged_steps(study.folder / "metrics-attempt2.jsonl"))
    assert min(second) == resumed_from + 1, "the resumed attempt starts after its checkpoint"
    # The merged metrics: every step once, the cumulative count recomputed over the attempts.
    steps = study.resumed.steps()
    assert sorted(steps) == list(range(0, max(steps) + 1)) and max(steps) > resumed_from
    cumulative = 0.0
    for step in sorted(steps)[1:]:
        cumulative += steps[step]["spo/generated_tokens"]
        assert steps[step]["spo/generated_tokens_cumulative"] == pytest.approx(cumulative)
    assert cumulative >= 500 or max(steps) == 3  # the quick budget, or the step bound
    assert spent == pytest.approx(sum(steps[s]["spo/generated_tokens"] for s in range(1, resumed_from + 1)), abs=1)
    done = json.loads((study.folder / "done.json").read_text())
    assert done["steps"] == max(steps) and done["attempts"] == 2
    assert not (study.folder / "checkpoints").exists(), "a finished run keeps no checkpoint"
    # One progress line per step of the resumed attempt, and a line for the finished run.
    progress = {int(m.group(1)) for line in resumed_log.splitlines()
                if (m := re.match(r"compare: spo_tree/seed0 +step +(\d+)", line))}
    assert progress == set(second)
    assert "compare: spo_tree/seed0: done:" in resumed_log
    # The quick study's second algorithm, the tree that forks at cutpoints, after the first.
    assert "compare: spo_tree_cutpoint/seed0: done:" in resumed_log
    cutpoint = json.loads((study.folder.parents[1] / "spo_tree_cutpoint" / "seed0" / "done.json").read_text())
    assert cutpoint["steps"] >= 1 and cutpoint["generated_tokens"] > 0
    # A third time: nothing left to train.
    assert study.again.returncode == 0, study.again.failure()
    again_log = study.again.log.read_text()
    assert "compare: spo_tree/seed0: finished earlier, skipped" in again_log
    assert "compare: spo_tree_cutpoint/seed0: finished earlier, skipped" in again_log
    report = study.folder.parents[1] / "report"
    for name in ("accuracy_vs_step.png", "accuracy_vs_generated_tokens.png", "accuracy_vs_wall_time.png",
                 "reward_vs_step.png", "reward_vs_generated_tokens.png", "reward_vs_wall_time.png", "results.csv",
                 "summary.csv", "groups.csv", "report.html"):
        assert (report / name).stat().st_size > 0, name
    page = (report / "report.html").read_text()
    assert "<svg" in page and "SPO tree" in page and "data:image/png;base64," in page
    assert "Where the credit goes: SPO-tree against GRPO" in page and "GRPO: A " in page


def test_study_help_lists_its_options():
    result = subprocess.run(["bash", "scripts/compare.sh", "--help"], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    for option in ("--setting", "--algorithms", "--seeds", "--token-budget", "--lr", "--val-every", "--max-steps",
                   "--output-dir", "--quick"):
        assert option in result.stdout, option
