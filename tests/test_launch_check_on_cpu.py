"""``--check``: every cluster setting with every algorithm, and every cluster script as docs/CLUSTER.md shows
it, passes everything a launch checks before Ray, with no override; a missing model, data file, GPU or
flash-attn is refused before Ray with one line naming it.

What this machine forces, and only that: ``MODEL_PATH`` and ``DATA_DIR`` (the documented variables) point
at a tiny local model and at problems written by ``scripts/prepare_data.sh``, since no hub is reachable;
the Python running the tests (the set-up's .venv), this machine's only Python with verl, is first on
``PATH``, as an activated environment puts it (a cluster's python3 is its own).
"""

import os
import re
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from omegaconf import OmegaConf

from recipe.spo.checks_before_ray.launch_needs import FLASH_ATTN_INSTALL, check_attention

# The set-up's CPU build reports flash-attn; a CUDA build of torch without flash-attn is refused.
TORCH_IS_A_CUDA_BUILD = torch.version.cuda is not None
REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable  # the set-up's .venv in the suite (a GPU user's torch under scripts/test_gpu_user_versions.sh)
ALGORITHMS = ["spo_tree", "spo_tree_cutpoint", "spo_chain", "grpo", "grpo_prob_mask", "ppo"]
CLUSTER_SETTINGS = ["gsm8k-rhomath-1.1b", "math-r1-1.5b"]
# The scripts as docs/CLUSTER.md shows them, each with its own algorithm and setting.
CLUSTER_SCRIPTS = {"run_spo_tree.sh": ("math-r1-1.5b", "spo_tree"), "run_spo_chain.sh": ("gsm8k-rhomath-1.1b", "spo_chain"),
                   "run_grpo.sh": ("math-r1-1.5b", "grpo"), "run_grpo_gsm8k.sh": ("gsm8k-rhomath-1.1b", "grpo"),
                   "run_spo_tree_math_4k.sh": ("math-r1-1.5b", "spo_tree")}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """Every data set the cluster settings read, from raw records in each source's schema, by the user's
    own ``scripts/prepare_data.sh``."""
    from recipe.spo.rehearsal.build import FAMILIES, prepare, write_raw

    folder = tmp_path_factory.mktemp("data")
    for family in FAMILIES.values():
        write_raw(folder / "raw", family)
        prepare(folder / "raw", folder / "spo", family)
    return folder / "spo"


@pytest.fixture(scope="module")
def setting_models(tmp_path_factory):
    """A model folder per cluster setting in its architecture, its tokenizer trained with the setting's
    prompt template (the rehearsal's, without its fine-tune): the setting's prompts render at a length like
    the real tokenizer's, so verl's overlong-prompt filter keeps them as it would."""
    from recipe.spo.rehearsal.__main__ import compose_shipped
    from recipe.spo.rehearsal.build import FAMILIES, build_model, build_tokenizer

    models = {}
    for setting in CLUSTER_SETTINGS:
        folder = tmp_path_factory.mktemp(setting)
        template = compose_shipped(setting, "grpo").actor_rollout_ref.model.custom_chat_template
        build_model(folder, FAMILIES[setting], build_tokenizer(folder, FAMILIES[setting], template))
        models[setting] = str(folder)
    return models


def activated_path() -> str:
    """``PATH`` with the tests' Python environment first: its ``python3`` is the one the launcher runs."""
    return f"{Path(PYTHON).parent}{os.pathsep}{os.environ.get('PATH', '')}"


def check(script, *args, cwd="/", **env):
    environment = {key: value for key, value in os.environ.items() if key not in ("SETTING", "ALGORITHM", "PYTHON")}
    environment.update(PATH=activated_path(), **env)
    return subprocess.run(["bash", str(REPO / "scripts" / script), *args], env=environment, capture_output=True,
                          text=True, timeout=300, cwd=cwd)


def refusal(result) -> str:
    """The one line a refusal prints (warnings of verl's imports aside)."""
    lines = [line for line in result.stderr.splitlines() if line.startswith("spo: ")]
    assert len(lines) == 1, result.stderr[-3000:]
    return lines[0]


@pytest.mark.parametrize("setting", CLUSTER_SETTINGS)
def test_every_cluster_setting_passes_the_check_with_every_algorithm(setting, setting_models, data_dir, monkeypatch,
                                                                    capsys):
    """The entry point's checks in this process, as ``--check`` runs them after composing (the scripts' own
    path, a process each, below): one Python start instead of twelve."""
    from hydra import compose, initialize_config_dir

    from recipe.spo.checks_before_ray import check_before_ray

    monkeypatch.setenv("DATA_DIR", str(data_dir))
    for algorithm in ALGORITHMS:
        with initialize_config_dir(config_dir=str(REPO / "recipe" / "spo" / "config"), version_base=None):
            config = compose(config_name="spo_trainer", overrides=[f"setting={setting}", f"spo_algorithm={algorithm}",
                                                                   f"actor_rollout_ref.model.path={setting_models[setting]}"])
        if TORCH_IS_A_CUDA_BUILD:  # a GPU user's torch (scripts/test_gpu_user_versions.sh), no flash-attn: refused
            with pytest.raises(SystemExit):
                check_before_ray(config, setting, require_gpu=False)
            assert capsys.readouterr().err.strip().endswith(f"which this Python does not have: {FLASH_ATTN_INSTALL}")
            continue
        report = check_before_ray(config, setting, require_gpu=False)
        found, gpu = report.found, report.gpu
        assert f"actor_rollout_ref.model.path={setting_models[setting]}: model and tokenizer load" in found, algorithm
        train = f"data.train_files: {data_dir}/{'math' if setting.startswith('math') else 'gsm8k'}/train.parquet: 64 rows"
        [counted] = [line for line in found if line.startswith(train)]
        limit = config.data.max_prompt_length
        dropped = re.fullmatch(rf", (\d+) longer than data.max_prompt_length={limit} \(verl's overlong-prompt filter "
                               r"drops them\)", counted[len(train):])
        assert dropped and int(dropped.group(1)) < 64, counted
        # This Python's torch is a CPU build: the GPU and flash-attn are reported, not required.
        [attention] = [line for line in found if line.startswith("attention:")]
        assert "flash_attention_2; flash-attn not checked" in attention and FLASH_ATTN_INSTALL in attention
        assert gpu.startswith(f"SETTING={setting} trains on GPUs") and "CPU-only build" in gpu


def test_data_whose_every_prompt_is_too_long_is_refused_naming_the_shortest(tiny_model, data_dir, monkeypatch, capsys):
    """verl's overlong-prompt filter would leave an empty dataset: refused before Ray, with the numbers."""
    from hydra import compose, initialize_config_dir

    from recipe.spo.checks_before_ray import check_before_ray

    monkeypatch.setenv("DATA_DIR", str(data_dir))
    with initialize_config_dir(config_dir=str(REPO / "recipe" / "spo" / "config"), version_base=None):
        config = compose(config_name="spo_trainer", overrides=["setting=math-r1-1.5b", "spo_algorithm=grpo",
                                                               f"actor_rollout_ref.model.path={tiny_model[0]}",
                                                               "data.max_prompt_length=8"])
    with pytest.raises(SystemExit):
        check_before_ray(config, "math-r1-1.5b", require_gpu=False)
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert re.fullmatch(rf"spo: data.train_files: {data_dir}/math/train.parquet: every prompt is longer than "
                        r"data.max_prompt_length=8 tokens \(the shortest has \d+\): verl's overlong-prompt filter "
                        r"would leave no data", line), line


@pytest.mark.parametrize("script", sorted(CLUSTER_SCRIPTS))
def test_every_cluster_script_passes_the_check_as_documented(script, setting_models, data_dir):
    """No SETTING: ``--check`` checks the script's own cluster setting, on a machine without a GPU too."""
    setting, algorithm = CLUSTER_SCRIPTS[script]
    result = check(script, "--check", MODEL_PATH=setting_models[setting], DATA_DIR=str(data_dir))
    if TORCH_IS_A_CUDA_BUILD:  # as above: flash-attn is missing in a GPU user's environment without it
        assert result.returncode == 2 and FLASH_ATTN_INSTALL in refusal(result)
        return
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    out = result.stdout
    assert f"spo: algorithm={algorithm} setting={setting}" in out
    assert f"spo: check passed: setting={setting}" in out
    assert f"spo: check: actor_rollout_ref.model.path={setting_models[setting]}: model and tokenizer load" in out
    assert "spo: check: attention: flash_attention_2; flash-attn not checked" in out and FLASH_ATTN_INSTALL in out
    assert "spo: check: GPU: SETTING=" in out and "CPU-only build" in out
    assert "Started a local Ray instance" not in out + result.stderr


def test_a_missing_data_file_or_model_or_an_ignored_setting_is_refused_before_ray_naming_it(tiny_model, data_dir, tmp_path):
    empty = tmp_path / "no-data"
    result = check("run_spo_chain.sh", "--check", MODEL_PATH=tiny_model[0], DATA_DIR=str(empty))
    assert result.returncode == 2
    assert refusal(result) == (f"spo: data.train_files: {empty}/gsm8k/train.parquet: no such file (scripts/prepare_data.sh "
                               f"writes the cluster settings' data under DATA_DIR, default ~/data/spo; DATA_DIR={empty})")
    assert "Started a local Ray instance" not in result.stdout + result.stderr  # refused before Ray

    # A setting the chosen algorithm would ignore: a multi-turn environment for a single-turn chain.
    result = check("run_spo_chain.sh", "--check", "algorithm.spo.turns.environment=nonexistent_env",
                   MODEL_PATH=tiny_model[0], DATA_DIR=str(data_dir))
    assert result.returncode == 2
    assert refusal(result).startswith("spo: algorithm.spo.turns.environment=nonexistent_env would be ignored: only "
                                      "multi-turn episodes use it")
    assert "Started a local Ray instance" not in result.stdout + result.stderr

    result = check("run_spo_tree.sh", "--check", MODEL_PATH=str(tmp_path / "model"), DATA_DIR=str(data_dir))
    assert result.returncode == 2
    assert refusal(result).startswith(f"spo: actor_rollout_ref.model.path={tmp_path / 'model'}: no such model folder")

    # The setting's own hub model, on a machine that cannot reach the hub and has not cached it.
    result = check("run_spo_tree.sh", "--check", DATA_DIR=str(data_dir), HF_HUB_OFFLINE="1",
                      HF_HOME=str(tmp_path / "hf"))
    assert result.returncode == 2
    assert refusal(result).startswith("spo: actor_rollout_ref.model.path=deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B is a hub "
                                      "model that is not in this machine's Hugging Face cache")


def test_the_settings_own_hub_model_once_cached_is_checked_as_a_local_folder(setting_models, data_dir, tmp_path):
    """``SETTING=gsm8k-rhomath-1.1b bash scripts/run_spo_tree.sh --check`` as shipped, its hub model in the
    Hugging Face cache: its tokenizer loads and renders the setting's prompts, and the data's overlong
    prompts are counted with it, as for a local folder. Nothing can be downloaded here, so the cache (the
    layout a download leaves) holds a model of the setting's architecture, built by the test."""
    import shutil

    name, revision = "realtreetune/rho-1b-sft-GSM8K", "0" * 40
    repository = tmp_path / "hf" / "hub" / "models--realtreetune--rho-1b-sft-GSM8K"
    shutil.copytree(setting_models["gsm8k-rhomath-1.1b"], repository / "snapshots" / revision)
    (repository / "refs").mkdir()
    (repository / "refs" / "main").write_text(revision)
    result = check("run_spo_tree.sh", "--check", SETTING="gsm8k-rhomath-1.1b", DATA_DIR=str(data_dir),
                   HF_HOME=str(tmp_path / "hf"))
    assert result.returncode == 0, result.stderr[-2000:]
    assert (f"spo: check: actor_rollout_ref.model.path={name}: in this machine's Hugging Face cache; model and "
            f"tokenizer load") in result.stdout
    assert "longer than data.max_prompt_length=1023 (verl's overlong-prompt filter drops them)" in result.stdout
    assert "prompt lengths not counted" not in result.stdout


def test_ppo_with_a_hub_critic_the_hub_does_not_answer_is_refused_in_seconds(data_dir, tmp_path):
    """PPO as a user launches it where no hub answers: verl's configuration check would read the critic's hub
    model in the driver, retry for about a minute and end in a traceback; the launch says so in one line
    first, with the hub switched off (HF_HUB_OFFLINE=1) and with a hub endpoint that does not answer (a
    mirror that is down: a closed port, so that the test means the same on a machine that reaches
    huggingface.co). HF_HOME is the test's, so that no model a developer cached counts."""
    for offline, endpoint, reason in (("1", None, "and HF_HUB_OFFLINE is set"),
                                      ("0", "http://127.0.0.1:9", "and the hub (http://127.0.0.1:9) did not answer within 5 s")):
        started = time.perf_counter()
        result = check("run_grpo.sh", "--check", SETTING="gsm8k-rhomath-1.1b", ALGORITHM="ppo", DATA_DIR=str(data_dir),
                       HF_HOME=str(tmp_path / "hf"), HF_HUB_OFFLINE=offline, **({"HF_ENDPOINT": endpoint} if endpoint else {}))
        assert result.returncode == 2
        assert refusal(result).startswith("spo: critic.model.path=realtreetune/rho-1b-sft-GSM8K is a hub model that is "
                                          f"not in this machine's Hugging Face cache, {reason}")
        assert time.perf_counter() - started < 50  # the retries took about 60 s before
        assert "Traceback" not in result.stderr and "Started a local Ray instance" not in result.stdout + result.stderr


def test_a_launch_of_a_gpu_setting_without_a_gpu_stops_at_once_through_the_python_entry_point(tiny_model, data_dir):
    """The recipe README's way, ``python -m recipe.spo.main_spo setting=...``, refuses as the scripts do."""
    result = subprocess.run([PYTHON, "-m", "recipe.spo.main_spo", "setting=math-r1-1.5b",
                             f"actor_rollout_ref.model.path={tiny_model[0]}"], cwd=REPO, capture_output=True, text=True,
                            timeout=300, env={**os.environ, "DATA_DIR": str(data_dir)})
    assert result.returncode == 2
    line = refusal(result)
    assert line.startswith("spo: SETTING=math-r1-1.5b trains on GPUs, but")
    assert ("sees no GPU" if TORCH_IS_A_CUDA_BUILD else "CPU-only build") in line
    assert "Started a local Ray instance" not in result.stdout + result.stderr


def attention_config(attention="flash_attention_2", remove_padding=True, device="cuda"):
    return OmegaConf.create({"trainer": {"device": device}, "actor_rollout_ref": {"model": {
        "use_remove_padding": remove_padding, "override_config": {"attn_implementation": attention}}}})


def cuda_torch(cuda="13.0"):
    """A torch built with CUDA: none is installed here (the real check of a CPU build runs above)."""
    return SimpleNamespace(__version__="2.11.0", version=SimpleNamespace(cuda=cuda))


def test_flash_attention_is_required_where_torch_is_a_cuda_build(monkeypatch):
    import importlib.util

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "flash_attn" else real_find_spec(name, *a))
    with pytest.raises(ValueError) as refused:
        check_attention(attention_config(), cuda_torch())
    assert str(refused.value) == ("actor_rollout_ref.model.override_config.attn_implementation=flash_attention_2 needs "
                                  f"flash-attn, which this Python does not have: {FLASH_ATTN_INSTALL}")
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "flash_attn" else real_find_spec(name, *a))
    monkeypatch.setitem(sys.modules, "flash_attn", SimpleNamespace())  # a flash-attn that imports
    assert check_attention(attention_config(), cuda_torch()) == ["attention: flash_attention_2 (flash-attn imports)"]
    # A CPU build of torch cannot have flash-attn: reported, with what the GPU Python needs.
    [line] = check_attention(attention_config(), cuda_torch(cuda=None))
    assert "flash-attn not checked" in line and FLASH_ATTN_INSTALL in line


def test_rows_without_padding_are_refused_with_an_attention_that_would_mix_them():
    with pytest.raises(ValueError, match="use_remove_padding=true needs attn_implementation=flash_attention_2"):
        check_attention(attention_config("sdpa"), cuda_torch())
    assert check_attention(attention_config("sdpa", remove_padding=False), cuda_torch()) == ["attention: sdpa"]
    assert check_attention(attention_config("sdpa", device="cpu"), cuda_torch()) == ["attention: sdpa"]


def test_sdpa_lets_packed_rows_attend_to_each_other_which_is_why_remove_padding_needs_flash_attention(tiny_model):
    """The measurement behind the refusal above: two rows packed into one sequence (verl's remove-padding
    layout, positions restarting at each row) under transformers' sdpa are not the rows computed alone."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model[0], attn_implementation="sdpa").eval()
    first, second = torch.arange(3, 10)[None], torch.arange(20, 25)[None]
    with torch.no_grad():
        alone = model(second).logits[0]
        packed = model(torch.cat([first, second], 1), position_ids=torch.cat([torch.arange(7), torch.arange(5)])[None]).logits[0]
    assert (packed[7:] - alone).abs().max() > 1e-2


# --- one run per checkpoint folder, through the launcher and the entry point ------------------------------

# Run A's own settings: cpu-tiny (a CPU setting: no GPU needed here) resuming automatically, as the cluster
# settings do, under a cosine schedule, as they do, so that the step count sets the learning-rate schedule.
RUN_A = ("trainer.resume_mode=auto", "actor_rollout_ref.actor.optim.lr_scheduler_type=cosine")
# A launch whose training is replaced by what verl's trainer leaves in the folder (a checkpoint and verl's
# tracker, in seconds; tests/test_end_to_end_on_cpu.py trains for real), and which, while it "trains",
# launches a second run into the same folder with --check, as a second user would. The rest is the entry
# point's own: the checks, the lock, the record of the configuration.
STUBBED_LAUNCH = """
import json, os, runpy, subprocess, sys
from pathlib import Path
import spo_verl.adapters.trainer.runners as runners

def train(run, config, runner):
    folder = Path(config.trainer.default_local_dir)
    (folder / "global_step_2").mkdir()
    (folder / "latest_checkpointed_iteration.txt").write_text("2")
    second = subprocess.run(json.loads(os.environ["SECOND_LAUNCH"]), capture_output=True, text=True)
    Path(os.environ["SECOND_LAUNCH_OUT"]).write_text(json.dumps([second.returncode, second.stdout, second.stderr]))

runners.run_with_one_restart = train
sys.argv = ["recipe/spo/main_spo.py", *sys.argv[1:]]
runpy.run_module("recipe.spo.main_spo", run_name="__main__", alter_sys=True)  # as python -m runs it
"""


def cpu_tiny_launch(cache, *args, **env):
    """``bash scripts/run_spo_tree.sh`` on cpu-tiny as a user runs it (the launcher picks the checkout's .venv);
    only the cache of the setting's model and data is the test's."""
    environment = {key: value for key, value in os.environ.items() if key not in ("ALGORITHM", "PYTHON", "CHECKPOINT_DIR")}
    environment.update(SETTING="cpu-tiny", SPO_CPU_CACHE=str(cache), **env)
    return subprocess.run(["bash", str(REPO / "scripts" / "run_spo_tree.sh"), *args], env=environment,
                          capture_output=True, text=True, timeout=300, cwd="/")


def one_line(result) -> str:
    """The refusal of a CPU setting's launch, which sends stdout and stderr through one console filter."""
    lines = [line for line in (result.stdout + result.stderr).splitlines() if line.startswith("spo: ")]
    return lines[-1]


def test_one_run_per_checkpoint_folder_through_the_launcher_and_the_entry_point(cpu_tiny_cache, tmp_path):
    import json

    folder = tmp_path / "run-a"
    second_out = tmp_path / "second.json"
    second = ["bash", str(REPO / "scripts" / "run_spo_tree.sh"), "--check", *RUN_A]
    environment = {key: value for key, value in os.environ.items() if key not in ("ALGORITHM", "PYTHON")}
    environment.update(SETTING="cpu-tiny", SPO_CPU_CACHE=str(cpu_tiny_cache), CHECKPOINT_DIR=str(folder),
                       SECOND_LAUNCH=json.dumps(second), SECOND_LAUNCH_OUT=str(second_out))
    launched_a = {**environment, "VERL_PLATFORM": "spo_cpu", "VERL_ENGINE_DEVICE": "cuda"}
    # Run A, launched with the arguments and the platform variables the launcher passes for cpu-tiny into
    # CHECKPOINT_DIR.
    data = cpu_tiny_cache / "data"
    first = subprocess.run([PYTHON, "-c", STUBBED_LAUNCH, "setting=cpu-tiny", "spo_algorithm=spo_tree",
                            f"actor_rollout_ref.model.path={cpu_tiny_cache / 'model'}",
                            f"data.train_files={data / 'train.parquet'}", f"data.val_files={data / 'val.parquet'}",
                            f"trainer.default_local_dir={folder}", *RUN_A],
                           env=launched_a, capture_output=True, text=True, timeout=300, cwd=REPO)
    assert first.returncode == 0, first.stderr[-3000:]
    # While A trained, a second launch into its folder was refused by --check in one line, naming A.
    returncode, stdout, stderr = json.loads(second_out.read_text())
    assert returncode == 2, stdout[-2000:] + stderr[-2000:]
    refusal = [line for line in (stdout + stderr).splitlines() if line.startswith("spo: ")][-1]
    assert refusal.startswith(f"spo: trainer.default_local_dir={folder} is in use by another run: "
                              f"{folder / 'spo_run.lock'} names pid {first_pid(first)} on host "), refusal
    assert ", started 20" in refusal and "wait for that run to end" in refusal
    assert not (folder / "spo_run.lock").exists()  # A released it when it ended
    record = (folder / "spo_run_config.yaml").read_text()

    # A restarted as it was: resumes, under a new experiment name too (names and trace names may change).
    for env in ({}, {"EXPERIMENT_NAME": "renamed"}):
        result = cpu_tiny_launch(cpu_tiny_cache, "--check", *RUN_A, CHECKPOINT_DIR=str(folder), **env)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
        assert f"spo: check: checkpoints: resuming {folder / 'global_step_2'}, written under this same configuration" in result.stdout

    # Another learning rate, or a step count that reshapes the cosine schedule, into A's folder: refused.
    changed = cpu_tiny_launch(cpu_tiny_cache, "--check", *RUN_A, "actor_rollout_ref.actor.optim.lr=3e-4",
                              CHECKPOINT_DIR=str(folder))
    assert changed.returncode == 2
    assert "was written under another configuration (1 setting(s) differ: actor_rollout_ref.actor.optim.lr: " in one_line(changed)
    longer = cpu_tiny_launch(cpu_tiny_cache, "--check", *RUN_A, CHECKPOINT_DIR=str(folder), TOTAL_TRAINING_STEPS="9")
    assert longer.returncode == 2
    assert "(1 setting(s) differ: trainer.total_training_steps (the learning-rate schedule's length): 4 -> 9)" in one_line(longer)

    # Resume off into A's folder, by --check and by a launch: refused before Ray, A's record untouched.
    for check in (["--check"], []):
        fresh = cpu_tiny_launch(cpu_tiny_cache, *check, *RUN_A, "trainer.resume_mode=disable",
                                "actor_rollout_ref.actor.optim.lr=3e-4", CHECKPOINT_DIR=str(folder),
                                VERL_FILE_LOGGER_PATH=str(tmp_path / "b.jsonl"), TENSORBOARD_DIR=str(tmp_path / "tb"))
        assert fresh.returncode == 2, fresh.stdout[-3000:]
        assert one_line(fresh).startswith(f"spo: trainer.default_local_dir={folder} holds another run's checkpoints "
                                          "(global_step_2, latest_checkpointed_iteration.txt), and this launch "
                                          "(trainer.resume_mode=disable) trains from the base model")
        assert "Started a local Ray instance" not in fresh.stdout + fresh.stderr
    assert (folder / "spo_run_config.yaml").read_text() == record
    assert sorted(path.name for path in folder.iterdir()) == ["global_step_2", "latest_checkpointed_iteration.txt",
                                                              "spo_run_config.yaml"]
    # The refusals' way to a new run leads somewhere: a folder of its own.
    own = cpu_tiny_launch(cpu_tiny_cache, "--check", *RUN_A, "actor_rollout_ref.actor.optim.lr=3e-4",
                          CHECKPOINT_DIR=str(tmp_path / "run-b"))
    assert own.returncode == 0 and "spo: check: checkpoints: training from the base model" in own.stdout


def first_pid(result) -> int:
    """The pid run A's lock named: the record of its launch, printed by the stub's entry point."""
    import re

    return int(re.search(r"^spo: checkpoints: lock taken by pid (\d+)", result.stdout, re.MULTILINE).group(1))


def test_check_holds_nodes_and_gpus_against_the_ray_cluster_it_joins(cpu_tiny_cache, tmp_path):
    """A running two-node Ray cluster (tests/ray_two_nodes.py: two raylets, one logical GPU each), joined as
    CLUSTER.md launches it: ``--check`` with NNODES=2 finds both nodes; NNODES=3 is refused in one line
    naming what the cluster has, before any run of it starts."""
    import contextlib

    cluster = subprocess.Popen([sys.executable, str(REPO / "tests" / "ray_two_nodes.py")], stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=tmp_path)
    with contextlib.ExitStack() as stack:
        stack.callback(cluster.wait, timeout=120)
        stack.callback(cluster.stdin.close)
        line = cluster.stdout.readline()
        assert line.startswith("address "), line
        join = f"+ray_kwargs.ray_init.address={line.split()[1]}"
        found = cpu_tiny_launch(cpu_tiny_cache, "--check", join, NNODES="2", CHECKPOINT_DIR=str(tmp_path / "a"))
        assert found.returncode == 0, found.stderr[-2000:]
        assert f"spo: check: Ray cluster at {line.split()[1]}: 2 alive node(s), GPUs per node [1, 1]: enough for 2 x 1" \
            in found.stdout
        refused = cpu_tiny_launch(cpu_tiny_cache, "--check", join, NNODES="3", CHECKPOINT_DIR=str(tmp_path / "b"))
        assert refused.returncode == 2
        assert one_line(refused).startswith(f"spo: trainer.nnodes=3 (NNODES) x trainer.n_gpus_per_node=1 (GPUS_PER_NODE): "
                                            f"the Ray cluster at {line.split()[1]} has 2 alive node(s) with [1, 1] GPUs")


def test_the_cpu_default_starts_again_and_again_each_run_in_a_folder_of_its_own(cpu_tiny_cache):
    """The README's ``bash scripts/run_spo_tree.sh``, twice: a CPU setting trains from the base model at each
    launch, so the launcher gives each launch a folder of its own; ``trainer.resume_mode=auto`` continues the
    newest. (cpu-tiny, the quick CPU setting, with a name of its own so as not to meet a user's runs here.)"""
    import shutil

    experiment = REPO / "checkpoints" / "spo" / "test-cpu-default-twice"
    earlier = experiment / "20260101-000000"
    (earlier / "global_step_4").mkdir(parents=True)
    (earlier / "latest_checkpointed_iteration.txt").write_text("4")
    try:
        again = cpu_tiny_launch(cpu_tiny_cache, "--check", EXPERIMENT_NAME=experiment.name)
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
        folder = re.search(r"checkpoints -> (\S+)$", again.stdout, re.MULTILINE).group(1)
        assert Path(folder).parent == experiment and Path(folder) != earlier
        assert "spo: check: checkpoints: training from the base model" in again.stdout
        resumed = cpu_tiny_launch(cpu_tiny_cache, "--check", "trainer.resume_mode=auto", EXPERIMENT_NAME=experiment.name)
        assert resumed.returncode == 0, resumed.stdout[-3000:]
        assert f"checkpoints -> {earlier}\n" in resumed.stdout
        assert f"spo: check: checkpoints: resuming {earlier / 'global_step_4'}" in resumed.stdout
    finally:
        shutil.rmtree(experiment)


def test_a_flash_attn_that_is_installed_but_does_not_import_is_refused(tmp_path, monkeypatch):
    """A build against another torch fails when its kernels load: found by find_spec, refused by the import."""
    package = tmp_path / "flash_attn"
    package.mkdir()
    (package / "__init__.py").write_text('raise ImportError("flash_attn_2_cuda.so: undefined symbol: _ZN3c104cuda9SetDevice")\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "flash_attn", raising=False)
    with pytest.raises(ValueError) as refused:
        check_attention(attention_config(), cuda_torch())
    assert str(refused.value) == (
        "actor_rollout_ref.model.override_config.attn_implementation=flash_attention_2 needs flash-attn, which is "
        "installed but does not import in this Python (ImportError: flash_attn_2_cuda.so: undefined symbol: "
        f"_ZN3c104cuda9SetDevice); rebuild it against this torch: pip uninstall -y flash-attn && {FLASH_ATTN_INSTALL}")


def test_more_gpus_per_node_than_the_node_sees_is_refused_where_it_sees_any():
    """A CUDA torch seeing 4 GPUs (none here: a stand-in, as above) and a login node seeing none."""
    from recipe.spo.checks_before_ray.launch_needs import check_gpu_count

    def seeing(count):
        torch_module = cuda_torch()
        torch_module.cuda = SimpleNamespace(device_count=lambda: count)
        return torch_module

    config = OmegaConf.create({"trainer": {"device": "cuda", "n_gpus_per_node": 8}})
    with pytest.raises(ValueError) as refused:
        check_gpu_count(config, seeing(4))
    assert str(refused.value).startswith("trainer.n_gpus_per_node=8 (GPUS_PER_NODE) but this node sees 4 GPU(s) "
                                         "(CUDA_VISIBLE_DEVICES=")
    assert str(refused.value).endswith("set GPUS_PER_NODE to at most 4, or launch on a node with 8")
    assert check_gpu_count(config, seeing(8)) == ["GPUs per node: trainer.n_gpus_per_node=8, this node sees 8"]
    assert check_gpu_count(config, seeing(0)) == ["GPUs per node: not checked (this node sees no GPU)"]


def test_mis_launches_that_would_fail_on_the_cluster_are_refused_by_check_in_one_line(data_dir, setting_models, tmp_path):
    """Each through the script as a user runs it, refused before Ray with one line and exit status 2."""
    # Several nodes without a cluster to join, by the variable or by Hydra.
    expected = "spo: trainer.nnodes=2 (NNODES) needs a running Ray cluster of 2 nodes to join, and this launch names none"
    for args, env in (((), {"NNODES": "2"}), (("trainer.nnodes=2",), {})):
        result = check("run_spo_tree.sh", "--check", *args, DATA_DIR=str(data_dir), **env)
        assert result.returncode == 2 and refusal(result).startswith(expected), result.stderr[-2000:]
        assert "+ray_kwargs.ray_init.address=auto" in refusal(result)
    # Naming a cluster to join, that check passes (the model and data are checked next). At an address no
    # cluster answers at (port 1), so that the Ray clusters other tests start on this machine stay out of it:
    # the cluster's own nodes and GPUs are checked against a running two-node cluster in this file.
    joined = check("run_spo_tree.sh", "--check", "+ray_kwargs.ray_init.address=127.0.0.1:1", NNODES="2",
                   MODEL_PATH=setting_models["math-r1-1.5b"], DATA_DIR=str(data_dir))
    if not TORCH_IS_A_CUDA_BUILD:
        assert joined.returncode == 0, joined.stderr[-3000:]
        assert "nodes=2" in joined.stdout and "spo: check passed: setting=math-r1-1.5b" in joined.stdout
        assert "spo: check: Ray cluster at 127.0.0.1:1: none answers from here" in joined.stdout

    def gsm8k_check(*args, **env):
        result = check("run_grpo.sh", "--check", *args, SETTING="gsm8k-rhomath-1.1b", DATA_DIR=str(data_dir), **env)
        assert result.returncode == 2 and "Traceback" not in result.stderr
        return refusal(result)

    # verl's own batch rule, which it asserts: GSM8K's 64 x 8 rows a step over 3 GPUs.
    assert gsm8k_check(GPUS_PER_NODE="3", ALGORITHM="grpo") == (
        "spo: verl's configuration check (verl.utils.config.validate_config) refused it: data.train_batch_size=64 x "
        "actor_rollout_ref.rollout.n=8 = 512 rows a step must divide evenly over the trainer.n_gpus_per_node=3 "
        "(GPUS_PER_NODE) x trainer.nnodes=1 (NNODES) = 3 GPUs; GPU counts up to 64 that divide 512: 1, 2, 4, 8, 16, "
        "32, 64 (or change data.train_batch_size)")
    # GSM8K's fixed micro-batches of 8 rows (the reference's whitening groups) on 16 GPUs: 4 rows a GPU.
    assert gsm8k_check(GPUS_PER_NODE="16", ALGORITHM="grpo_prob_mask") == (
        "spo: actor_rollout_ref.actor.ppo_mini_batch_size=8 x actor_rollout_ref.rollout.n=8 = 64 rows an optimizer step "
        "over trainer.n_gpus_per_node=16 (GPUS_PER_NODE) x trainer.nnodes=1 (NNODES) = 16 GPUs is not a whole number of "
        "micro-batches of actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8 rows on each: GPU counts that are: "
        "1, 2, 4, 8")
    # verl's other refusals name the keys its message is about.
    line = gsm8k_check("actor_rollout_ref.actor.use_dynamic_bsz=false", "actor_rollout_ref.actor.ppo_mini_batch_size=128",
                       ALGORITHM="grpo")
    assert line.startswith("spo: verl's configuration check (verl.utils.config.validate_config) refused it: ")
    assert "data.train_batch_size=64" in line and "actor_rollout_ref.actor.ppo_mini_batch_size=" in line, line

    # A relative MODEL_PATH is read from where the user launches; one that exists nowhere is no hub id.
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "r1").symlink_to(setting_models["math-r1-1.5b"])
    found = check("run_spo_tree.sh", "--check", MODEL_PATH="models/r1", DATA_DIR=str(data_dir), cwd=tmp_path)
    if not TORCH_IS_A_CUDA_BUILD:
        assert found.returncode == 0, found.stderr[-3000:]
        assert f"spo: check: actor_rollout_ref.model.path={tmp_path}/models/r1: model and tokenizer load" in found.stdout
    missing = check("run_spo_tree.sh", "--check", MODEL_PATH="recipe/r1-sft", DATA_DIR=str(data_dir), cwd=tmp_path)
    assert missing.returncode == 2
    assert refusal(missing).startswith(f"spo: actor_rollout_ref.model.path=recipe/r1-sft: no such model folder (read from "
                                       f"the working directory: {REPO}/recipe/r1-sft)")


def test_a_python_without_verl_first_on_path_is_named_with_the_install_line(tmp_path):
    """A cluster user's python3 without verl (here: this machine's Python, isolated from every site-packages)."""
    shim = tmp_path / "bin" / "python3"
    shim.parent.mkdir()
    shim.write_text(f"#!/bin/sh\nexec {sys._base_executable} -I -S \"$@\"\n")
    shim.chmod(0o755)
    environment = {key: value for key, value in os.environ.items() if key not in ("SETTING", "ALGORITHM", "PYTHON")}
    environment["PATH"] = f"{shim.parent}{os.pathsep}{environment.get('PATH', '')}"
    result = subprocess.run(["bash", str(REPO / "scripts" / "run_spo_tree.sh"), "--check"], env=environment,
                            capture_output=True, text=True, timeout=60, cwd="/")
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        f"spo: PYTHON=python3 ({shim}) has no verl: install it and spo-verl into that Python (pip install "
        f"'verl[vllm]==0.9.1' && pip install -e {REPO}; docs/CLUSTER.md, \"Install next to your verl\"), or set "
        "PYTHON to the Python that has them"]


def test_overrides_compose_before_and_after_cfg_job_and_check():
    environment = {key: value for key, value in os.environ.items() if key not in ("ALGORITHM", "PYTHON", "EXPERIMENT_NAME")}
    environment.update(SETTING="math-r1-1.5b", PATH=activated_path())
    for args in (("--cfg", "job", "trainer.experiment_name=after"), ("trainer.experiment_name=after", "--cfg", "job")):
        result = subprocess.run(["bash", str(REPO / "scripts" / "run_spo_tree.sh"), *args], env=environment,
                                capture_output=True, text=True, timeout=300, cwd="/")
        assert result.returncode == 0, result.stderr[-2000:]
        assert f"default_local_dir: {REPO}/checkpoints/spo/after" in result.stdout, args
