"""The cluster settings' prompts are the SPO reference's text: a problem written by
recipe/spo/data/prepare.py, read by verl's RLHFDataset with the setting's ``data`` config, rendered by
the chat template verl's model config installs (``actor_rollout_ref.model.custom_chat_template``) and
tokenised by the Continuous Token builder verl's agent loops use, is exactly the prompt the reference
builds for that model (its prompt library, BOS included where it prepends one).

The real tokenizers are on the model hub, which the tests cannot reach: a local tokenizer stands in,
with the real one's BOS token and its model type (which picks verl's token builder)."""

import json
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf
from verl.utils.dataset.rl_dataset import RLHFDataset
from verl.utils.tokenizer.continuous_token_wiring import create_continuous_token_builder
from verl.workers.config.model import HFModelConfig

from recipe.spo.cpu_settings.tiny_model import build_tiny_qwen2, build_tiny_tokenizer
from recipe.spo.data.prepare import DATASETS
from recipe.spo.data.prepare import main as prepare

REPO = Path(__file__).resolve().parents[1]

# The reference's prompts, as its configs write them (AIFrameResearch/SPO): for RhoMath on GSM8K,
# configs/prompt_library/generic_GSM8K_step_by_step.jsonnet after the BOS its math episode generator
# prepends (append_bos_to_query); for R1-Distill-Qwen on MATH, configs/prompt_library/qwen_MATH.jsonnet,
# which writes R1's BOS itself (append_bos_to_query false).
R1_INSTRUCTION = ("Solve the following math problem efficiently and clearly.  The last line of your response should "
                  "be of the following format: 'Therefore, the final answer is: $\\boxed{ANSWER}$. I hope it is "
                  "correct' (without quotes) where ANSWER is just the final number or expression that solves the "
                  "problem. Think step by step before answering.")
SETTINGS = {
    # setting: (prompt format, dataset, raw record, the model's BOS, its model type, the reference's prompt)
    "gsm8k-rhomath-1.1b": ("rho_math_task", "gsm8k",
                           {"question": "Tom has 3 apples and buys 4 more. How many now?", "answer": "3+4=7\n#### 7"},
                           "<s>", "llama", "<s>[MATH_TASK] Problem:\n{problem}\n\nSolution:"),
    "math-r1-1.5b": ("r1_math", "math",
                     {"problem": "What is 2 + 3?", "solution": "It is $\\boxed{5}$."},
                     "<｜begin▁of▁sentence｜>", "qwen2",
                     "<｜begin▁of▁sentence｜><｜User｜>" + R1_INSTRUCTION + "\n\n{problem}<｜Assistant｜><think>\n"),
}


def _recipe_config(prompt_format: str):
    with initialize_config_dir(config_dir=str(REPO / "recipe" / "spo" / "config"), version_base=None):
        return compose(config_name="spo_trainer", overrides=[f"prompt_format={prompt_format}",
                                                              "data.filter_overlong_prompts=true"])


@pytest.mark.parametrize("setting", SETTINGS)
def test_the_first_training_prompt_is_the_references(setting, tmp_path):
    prompt_format, dataset, record, bos, model_type, reference = SETTINGS[setting]
    raw = tmp_path / "raw" / dataset
    raw.mkdir(parents=True)
    for split in DATASETS[dataset].splits:
        (raw / f"{split.split}.jsonl").write_text(json.dumps(record) + "\n")
    assert prepare(["--input-dir", str(tmp_path / "raw"), "--output-dir", str(tmp_path / "data"), "--datasets", dataset]) == 0

    tokenizer = build_tiny_tokenizer(tmp_path / "model")
    tokenizer.add_special_tokens({"bos_token": bos})
    build_tiny_qwen2(tmp_path / "model", tokenizer)
    config = _recipe_config(prompt_format)
    model = HFModelConfig(path=str(tmp_path / "model"), custom_chat_template=config.actor_rollout_ref.model.custom_chat_template)
    # With overlong prompts filtered, verl's dataset renders every prompt through the template once already.
    rows = RLHFDataset([str(tmp_path / "data" / dataset / "train.parquet")], model.tokenizer, config.data)
    messages = list(rows[0]["raw_prompt"])
    problem = record.get("question", record.get("problem"))
    assert messages == [{"role": "user", "content": problem}]

    expected = reference.replace("{problem}", problem)
    text = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                               **config.data.apply_chat_template_kwargs)
    assert text == expected
    builder = create_continuous_token_builder(model.tokenizer, hf_model_type=model_type,
                                              chat_template_kwargs=config.data.apply_chat_template_kwargs)
    ids = builder.build_initial_tokens(messages)
    assert ids == model.tokenizer.encode(expected, add_special_tokens=False)
    assert ids[0] == model.tokenizer.convert_tokens_to_ids(bos) and ids.count(ids[0]) == 1  # the BOS, once


def test_the_cpu_settings_keep_the_models_own_chat_template():
    config = _recipe_config("chat")
    assert config.data.prompt_key == "prompt" and config.actor_rollout_ref.model.custom_chat_template is None
    default = OmegaConf.load(REPO / "recipe" / "spo" / "config" / "spo_trainer.yaml").defaults
    assert {"prompt_format": "chat"} in default
