"""What the entry point fixes in the driver before Ray (recipe/spo/driver_config.py) and the one-run-per-
checkpoint-folder rule (recipe/spo/resume_guard.py), on the settings as the launcher composes them. The
runs through verl's trainer (a resume refused, two nodes) are in test_end_to_end_on_cpu.py."""

import os
import subprocess
from pathlib import Path

import pytest
import yaml
from omegaconf import OmegaConf

from recipe.spo.driver_config import FORWARDED_VARIABLES, PATH_KEYS, forwarded_variables, prepare_for_ray
from recipe.spo.resume_guard import (FORCE_KEY, NEW_FOLDER, RECORD_FILE, SCHEDULE_LENGTH, checkpoint_to_resume,
                                     comparable, differences, overwrite_problem, record_configuration, resume_problem)
from recipe.spo.run_lock import LOCK_FILE, STALE_AFTER_S, acquire, lock_problem

REPO = Path(__file__).resolve().parents[1]
RECIPE_CONFIG = REPO / "recipe" / "spo" / "config"
ALGORITHMS = sorted(path.stem for path in (RECIPE_CONFIG / "spo_algorithm").glob("*.yaml"))
CLUSTER_SETTINGS = sorted(path.stem for path in (RECIPE_CONFIG / "setting").glob("*.yaml") if not path.stem.startswith("cpu-"))


def every_path(config) -> list[str]:
    paths = []
    for key in PATH_KEYS:
        value = OmegaConf.select(config, key, default=None)
        paths += [] if value is None else list(value) if OmegaConf.is_list(value) else [value]
    return paths


@pytest.mark.parametrize("setting", CLUSTER_SETTINGS)
def test_every_path_a_cluster_setting_reads_is_absolute_in_the_drivers_configuration(setting, tmp_path, monkeypatch, compose_setting):
    """DATA_DIR is read in the driver: a worker on another node, without it, gets the same files."""
    monkeypatch.chdir(tmp_path)
    for algorithm in ALGORITHMS:
        monkeypatch.setenv("DATA_DIR", "shared/data")  # relative: against the driver's directory
        config = compose_setting(setting, algorithm, "trainer.default_local_dir=checkpoints/run",
                                 "trainer.validation_data_dir=validation")
        prepare_for_ray(config, environ={}, cwd=tmp_path)
        monkeypatch.delenv("DATA_DIR")
        paths = every_path(config)
        assert len(paths) >= 4, paths  # train and validation files, checkpoints, validation dumps
        assert all(Path(path).is_absolute() for path in paths), paths
        assert str(config.data.train_files).startswith(f"{tmp_path}/shared/data/")
        assert config.trainer.default_local_dir == f"{tmp_path}/checkpoints/run"
        # Nothing is left for a worker to resolve: no interpolation survives.
        assert "${" not in yaml.safe_dump(OmegaConf.to_container(config))


def test_a_hub_id_stays_a_hub_id_and_a_local_model_folder_becomes_absolute(tmp_path, compose_setting):
    (tmp_path / "models" / "tiny").mkdir(parents=True)
    hub = compose_setting("math-r1-1.5b", "spo_tree")
    local = compose_setting("math-r1-1.5b", "spo_tree", "actor_rollout_ref.model.path=models/tiny")
    for config in (hub, local):
        prepare_for_ray(config, environ={}, cwd=tmp_path)
    assert hub.actor_rollout_ref.model.path == "deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B"
    assert local.actor_rollout_ref.model.path == str(tmp_path / "models" / "tiny")


def test_the_variables_the_workers_read_are_forwarded_and_the_rest_are_not(tmp_path, compose_setting):
    config = compose_setting("cpu-tiny", "spo_tree")
    environ = {"VERL_FILE_LOGGER_PATH": "/logs/m.jsonl", "TENSORBOARD_DIR": "/tb", "VERL_PLATFORM": "spo_cpu",
               "VLLM_TARGET_DEVICE": "cpu", "HF_HUB_OFFLINE": "1", "DATA_DIR": "/data", "SECRET_TOKEN": "x"}
    prepare_for_ray(config, environ=environ, cwd=tmp_path)
    assert forwarded_variables(config) == {key: environ[key] for key in
                                           ("VERL_FILE_LOGGER_PATH", "TENSORBOARD_DIR", "VERL_PLATFORM",
                                            "VLLM_TARGET_DEVICE", "HF_HUB_OFFLINE")}
    assert {"VERL_PLATFORM", "VLLM_CPU_KVCACHE_SPACE", "TENSORBOARD_DIR"} <= set(FORWARDED_VARIABLES)


def test_joining_a_running_cluster_drops_the_local_rays_logical_resources(tmp_path, compose_setting):
    """Ray refuses num_cpus / num_gpus when it connects to a cluster; the CPU settings set them for the
    Ray a launch starts itself."""
    alone, joining = compose_setting("cpu-tiny", "spo_tree"), compose_setting("cpu-tiny", "spo_tree")
    assert prepare_for_ray(alone, environ={}, cwd=tmp_path) == []
    assert (alone.ray_kwargs.ray_init.num_gpus, alone.ray_kwargs.ray_init.num_cpus) == (1, 16)
    notes = prepare_for_ray(joining, environ={"RAY_ADDRESS": "10.0.0.1:6379"}, cwd=tmp_path)
    assert "num_gpus" not in joining.ray_kwargs.ray_init and "num_cpus" not in joining.ray_kwargs.ray_init
    assert len(notes) == 1 and "10.0.0.1:6379" in notes[0] and "num_cpus, num_gpus" in notes[0]


def checkpointed(folder: Path, step: int = 2) -> None:
    (folder / f"global_step_{step}").mkdir(parents=True)
    (folder / "latest_checkpointed_iteration.txt").write_text(str(step))


@pytest.fixture
def prepared(tmp_path, compose_setting):
    """The cpu-tiny setting resuming automatically from ``tmp_path/run``, as the driver hands it to Ray."""

    def prepare(*overrides):
        config = compose_setting("cpu-tiny", "spo_tree", f"trainer.default_local_dir={tmp_path / 'run'}",
                                 "trainer.resume_mode=auto", *overrides)
        prepare_for_ray(config, environ={}, cwd=tmp_path)
        return config

    return prepare


def test_a_changed_configuration_is_refused_naming_each_change_and_both_ways_out(tmp_path, prepared):
    record_configuration(prepared())
    checkpointed(tmp_path / "run")
    refusal, _ = resume_problem(prepared("actor_rollout_ref.actor.optim.lr=3e-4",
                                         "algorithm.spo.tree.branching=[2,2]"))
    assert refusal.startswith(f"{tmp_path / 'run' / 'global_step_2'} was written under another configuration")
    assert "actor_rollout_ref.actor.optim.lr: 0.0002 -> 0.0003" in refusal
    assert "algorithm.spo.tree.branching: [3, 3] -> [2, 2]" in refusal
    # The way to a new run names a folder of its own (resume_mode=disable there would be refused below).
    assert NEW_FOLDER in refusal and "resume_mode=disable" not in refusal
    assert f"{FORCE_KEY}=true" in refusal
    forced, resuming = resume_problem(prepared("actor_rollout_ref.actor.optim.lr=3e-4",
                                               f"{FORCE_KEY}=true"))
    assert forced is None and "despite 1 changed setting(s)" in resuming


def test_what_may_change_between_the_parts_of_one_run_resumes(tmp_path, prepared):
    record_configuration(prepared())
    checkpointed(tmp_path / "run")
    # cpu-tiny's learning rate is constant: the step count says only where the run stops.
    same = prepared("trainer.total_training_steps=9", "trainer.save_freq=3", "trainer.test_freq=-1",
                    "trainer.experiment_name=renamed", "actor_rollout_ref.rollout.trace.experiment_name=renamed",
                    "algorithm.spo.budget.generated_tokens=5000",
                    "actor_rollout_ref.rollout.val_kwargs.n=4", "trainer.val_only=true",
                    "+ray_kwargs.ray_init.runtime_env.env_vars.VERL_FILE_LOGGER_PATH=/elsewhere.jsonl")
    assert resume_problem(same) == (None, f"resuming {tmp_path / 'run' / 'global_step_2'}, written under this same "
                                          "configuration")


def test_nothing_to_resume_trains_from_the_base_model_and_records_the_configuration(tmp_path, prepared):
    config = prepared()
    assert checkpoint_to_resume(config) is None
    assert resume_problem(config) == (None, "training from the base model (no checkpoint to resume)")
    record = record_configuration(config)
    assert record == tmp_path / "run" / RECORD_FILE
    assert yaml.safe_load(record.read_text()) == comparable(config)
    # resume_mode=disable ignores a checkpoint; resume_path names its own, compared with its folder's record.
    checkpointed(tmp_path / "run")
    assert checkpoint_to_resume(prepared("trainer.resume_mode=disable")) is None
    named = prepared("trainer.resume_mode=resume_path",
                     f"trainer.resume_from_path={tmp_path / 'run' / 'global_step_2'}", "data.seed=12345")
    refusal, _ = resume_problem(named)
    assert f"data.seed: {prepared().data.seed!r} -> 12345" in refusal


def test_a_checkpoint_without_a_record_is_resumed_and_said_to_be_unchecked(tmp_path, prepared):
    checkpointed(tmp_path / "run")
    refusal, resuming = resume_problem(prepared())
    assert refusal is None and f"has no record of the run's configuration ({RECORD_FILE})" in resuming


def test_differences_name_added_removed_and_changed_keys_in_order():
    assert differences({"a": 1, "b": [1, 2], "c": "x"}, {"a": 1, "b": [1, 3], "d": None}) == [
        "b: [1, 2] -> [1, 3]", "c: 'x' -> '(unset)'", "d: '(unset)' -> None"]


def test_an_experiment_named_to_hydra_gets_its_own_checkpoint_folder(tmp_path):
    """CLUSTER.md's tracking example names the experiment with trainer.experiment_name: the checkpoints
    (and logs) move with it, so the next launch of the setting does not resume it."""
    environment = {key: value for key, value in os.environ.items() if key not in ("PYTHON", "EXPERIMENT_NAME")}
    result = subprocess.run(["bash", str(REPO / "scripts" / "run_spo_tree.sh"), "trainer.experiment_name=lr3e-6",
                             "--cfg", "job"], env={**environment, "SETTING": "math-r1-1.5b"},
                            capture_output=True, text=True, timeout=300, cwd="/")
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"checkpoints -> {REPO}/checkpoints/spo/lr3e-6" in result.stdout
    assert f"default_local_dir: {REPO}/checkpoints/spo/lr3e-6" in result.stdout


def test_a_step_count_that_reshapes_the_learning_rate_schedule_is_refused(tmp_path, prepared):
    """A cosine decay (the cluster settings') or a warm-up by share spans trainer.total_training_steps: a
    resumed run under another count would jump to another point of the curve."""
    cosine = ("actor_rollout_ref.actor.optim.lr_scheduler_type=cosine",)
    record_configuration(prepared(*cosine, "trainer.total_training_steps=4"))
    checkpointed(tmp_path / "run")
    refusal, _ = resume_problem(prepared(*cosine, "trainer.total_training_steps=1000"))
    assert f"(1 setting(s) differ: {SCHEDULE_LENGTH}: 4 -> 1000)" in refusal
    assert resume_problem(prepared(*cosine, "trainer.total_training_steps=4", "trainer.save_freq=1"))[0] is None
    warm_up = ("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1",)
    record_configuration(prepared(*warm_up, "trainer.total_training_steps=4"))
    assert SCHEDULE_LENGTH in resume_problem(prepared(*warm_up, "trainer.total_training_steps=5"))[0]
    # A warm-up of a set number of steps does not depend on the total.
    fixed = ("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.1", "actor_rollout_ref.actor.optim.lr_warmup_steps=2")
    record_configuration(prepared(*fixed, "trainer.total_training_steps=4"))
    assert resume_problem(prepared(*fixed, "trainer.total_training_steps=5"))[0] is None


def test_a_record_of_an_earlier_guard_is_compared_on_what_both_sides_hold(tmp_path, prepared):
    """Records written before the schedule's length was recorded, with keys since allowed to change."""
    record = comparable(prepared("actor_rollout_ref.actor.optim.lr_scheduler_type=cosine"))
    del record[SCHEDULE_LENGTH]
    record["trainer.default_local_dir"] = "/elsewhere"
    checkpointed(tmp_path / "run")
    (tmp_path / "run" / RECORD_FILE).write_text(yaml.safe_dump(record))
    assert resume_problem(prepared("actor_rollout_ref.actor.optim.lr_scheduler_type=cosine"))[0] is None


def test_a_launch_that_does_not_resume_a_folders_checkpoints_may_not_write_over_them(tmp_path, prepared):
    folder = tmp_path / "run"
    assert overwrite_problem(prepared("trainer.resume_mode=disable")) is None  # nothing there yet
    record_configuration(prepared())
    assert overwrite_problem(prepared("trainer.resume_mode=disable")) is None  # a record alone is no checkpoint
    checkpointed(folder, step=4)
    refusal = overwrite_problem(prepared("trainer.resume_mode=disable"))
    assert refusal == (f"trainer.default_local_dir={folder} holds another run's checkpoints (global_step_4, "
                       "latest_checkpointed_iteration.txt), and this launch (trainer.resume_mode=disable) trains from the "
                       "base model: it would write its own checkpoints over them. To continue that run, launch it again "
                       f"with trainer.resume_mode=auto and its settings; to start a new run, {NEW_FOLDER}; or move "
                       f"{folder} away first")
    assert overwrite_problem(prepared()) is None  # auto resumes them
    assert overwrite_problem(prepared("trainer.resume_mode=resume_path",
                                      f"trainer.resume_from_path={folder / 'global_step_4'}")) is None
    elsewhere = tmp_path / "other" / "global_step_9"
    assert f"resumes {elsewhere}, outside that folder" in overwrite_problem(
        prepared("trainer.resume_mode=resume_path", f"trainer.resume_from_path={elsewhere}"))
    (folder / "latest_checkpointed_iteration.txt").unlink()  # steps without verl's tracker: auto would start over
    assert "finds no latest_checkpointed_iteration.txt there to resume from, so it trains from the base model" in (
        overwrite_problem(prepared()))


def test_a_folder_another_running_launch_holds_is_refused_naming_it_and_a_dead_holders_lock_is_taken_over(tmp_path):
    folder = tmp_path / "run"
    lock, note = acquire(folder, command="python -m recipe.spo.main_spo setting=cpu-tiny")
    assert note is None
    refusal, _ = lock_problem(folder)
    assert refusal.startswith(f"trainer.default_local_dir={folder} is in use by another run: {folder / LOCK_FILE} names "
                              f"pid {os.getpid()} on host {lock.holder['host']}, started {lock.holder['started']}; "
                              "process")
    # The lock file names the command too, for whoever opens it.
    assert yaml.safe_load((folder / LOCK_FILE).read_text())["command"] == "python -m recipe.spo.main_spo setting=cpu-tiny"
    assert refusal.endswith(f"wait for that run to end, or, for a new run, {NEW_FOLDER}; if that run is gone, delete "
                            f"{folder / LOCK_FILE}")
    with pytest.raises(ValueError, match="is in use by another run"):
        acquire(folder)
    lock.release()
    assert not (folder / LOCK_FILE).exists() and lock_problem(folder)[0] is None

    # A holder on this host whose process has ended (a driver killed with SIGKILL).
    dead = subprocess.Popen(["true"])
    dead.wait()
    (folder / LOCK_FILE).write_text(yaml.safe_dump({"pid": dead.pid, "host": lock.holder["host"], "started": "then"}))
    refusal, found = lock_problem(folder)
    assert refusal is None and f"process {dead.pid} no longer runs on this host" in found
    taken, note = acquire(folder)
    assert "a stale lock" in note and yaml.safe_load((folder / LOCK_FILE).read_text())["pid"] == os.getpid()
    taken.release()

    # Another host's lock (a shared file system): live while its driver refreshes it.
    (folder / LOCK_FILE).write_text(yaml.safe_dump({"pid": 1, "host": "node-7", "started": "then"}))
    refusal, _ = lock_problem(folder)
    assert "names pid 1 on host node-7, started then; refreshed" in refusal
    old = (folder / LOCK_FILE).stat().st_mtime - STALE_AFTER_S - 1
    os.utime(folder / LOCK_FILE, (old, old))
    assert lock_problem(folder)[0] is None
