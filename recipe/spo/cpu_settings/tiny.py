"""SETTING=cpu-tiny: a tiny model and a small, rule-checked arithmetic data set, built locally (nothing
is downloaded) into a cache folder.

* Data: "What is a + b?" for single digits, in verl's parquet layout with ``data_source``
  ``openai/gsm8k`` and the answer as ground truth, so verl's own GSM8K reward scores it (1 for
  ``#### <answer>``, else 0). 80 problems train, 20 held out for validation. Beside them, two-turn
  arithmetic dialogues for the multi-turn environment ``arithmetic_dialogue``
  (``data/dialogue_{train,val}.parquet``, :mod:`recipe.spo.cpu_settings.dialogue`; the tiny model
  is not tuned on them: they exercise the episode's path, not learning).
* Model: the tiny Qwen2 of :mod:`recipe.spo.cpu_settings.tiny_model` (2 layers, character tokenizer),
  briefly fine-tuned on worked answers ("3+4=7\\n#### 7") so that, sampled at temperature 1, it is
  right some of the time but not mostly: rewards differ between samples, so GRPO and SPO
  advantages are not all zero.

    python -m recipe.spo.cpu_settings.tiny --output-dir ~/.cache/spo-verl/cpu-default   # prints the paths
"""

from __future__ import annotations

import random
from pathlib import Path

from recipe.spo.cpu_settings.cache import cached_build, run_cli
from recipe.spo.cpu_settings.dialogue import write_dialogues

DATA_SOURCE = "openai/gsm8k"
INSTRUCTION = "Answer after ####."
VERSION = 2  # bump when the recipe below changes, so caches are rebuilt
FINE_TUNE_STEPS = 95
SEED = 0
DIALOGUE_OPERATIONS = 2  # two turns of the model, one reply of the environment between them


def problems() -> list[tuple[int, int]]:
    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(SEED).shuffle(pairs)
    return pairs


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}? {INSTRUCTION}"


def worked_answer(a: int, b: int) -> str:
    return f"{a}+{b}={a + b}\n#### {a + b}"


def row(a: int, b: int, split: str, index: int) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": [{"role": "user", "content": question(a, b)}],
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(a + b)},
        "extra_info": {"split": split, "index": index, "question": question(a, b), "answer": worked_answer(a, b)},
    }


def write_data(directory: Path) -> tuple[Path, Path]:
    from recipe.spo.data.prepare import write_rows

    pairs = problems()
    train, val = pairs[:80], pairs[80:]
    train_path, val_path = directory / "train.parquet", directory / "val.parquet"
    write_rows([row(a, b, "train", i) for i, (a, b) in enumerate(train)], train_path)
    write_rows([row(a, b, "test", i) for i, (a, b) in enumerate(val)], val_path)
    write_dialogues(directory, operations=DIALOGUE_OPERATIONS, train=80, held_out=20, seed=SEED)
    return train_path, val_path


def fine_tune(model_dir: Path, steps: int = FINE_TUNE_STEPS) -> None:
    """Teacher-forced training on the train problems' worked answers (loss on the answer tokens)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from recipe.spo.cpu_settings.tiny_model import train_on_answers

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    torch.manual_seed(SEED)
    sequences = []
    for a, b in problems()[:80]:
        prompt = tokenizer.apply_chat_template(
            [{"role": "user", "content": question(a, b)}], add_generation_prompt=True, tokenize=True
        )
        prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
        answer = tokenizer.encode(worked_answer(a, b), add_special_tokens=False) + [tokenizer.eos_token_id]
        sequences.append((prompt, answer))
    train_on_answers(model, sequences, tokenizer.pad_token_id, steps)
    model.save_pretrained(str(model_dir), safe_serialization=True)


def build(output_dir: str | Path) -> dict[str, str]:
    """Build (or reuse) the model and data under ``output_dir``; returns their paths."""
    return cached_build(output_dir, VERSION, _make)


def _make(output_dir: Path) -> None:
    from recipe.spo.cpu_settings.tiny_model import build_tiny_qwen2, build_tiny_tokenizer

    model_dir = output_dir / "model"
    tokenizer = build_tiny_tokenizer(model_dir)
    build_tiny_qwen2(model_dir, tokenizer, seed=SEED)
    fine_tune(model_dir)
    write_data(output_dir / "data")


if __name__ == "__main__":
    raise SystemExit(run_cli(build, __doc__))
