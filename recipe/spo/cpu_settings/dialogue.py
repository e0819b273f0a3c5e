"""Arithmetic dialogues for the multi-turn environment ``arithmetic_dialogue``
(:mod:`spo_verl.core.episodes.arithmetic`), as rows of verl's RL dataset.

A dialogue starts from a number and works one operation a turn: the prompt gives the number and the
first operation ("Start with 7. Add 3 to that."), the model answers with the new number, the
environment gives the next operation, and the reward is whether the last number of the model's last
turn is the result. A row's ``extra_info`` holds what the environment needs (``start``,
``operations`` as "+3"/"-2", ``answer``); ``reward_model.ground_truth`` is the answer too, for readers
of the data, though the episode's own reward is what verl is handed.

Worked example dialogues (``examples``) open the prompt as earlier chat turns, the way the
single-turn CPU tasks show their answer format.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

from spo_verl.core.episodes.arithmetic import opening_message, operation_message

DATA_SOURCE = "arithmetic_dialogue"
INSTRUCTION = "Answer with the number only."


def draw(rng: random.Random, operations: int) -> tuple[int, list[str], int]:
    """A start (2-20) and ``operations`` single-digit additions or subtractions that never go below 1;
    returns the start, the operations ("+3", "-2", ...) and the result."""
    if operations < 1:
        raise ValueError(f"a dialogue needs at least one operation, got {operations}")
    value = start = rng.randint(2, 20)
    worked = []
    for _ in range(operations):
        number = rng.randint(2, 9)
        if value > number and rng.random() < 0.5:
            worked.append(f"-{number}")
            value -= number
        else:
            worked.append(f"+{number}")
            value += number
    return start, worked, value


def opening(start: int, operation: str, show_work: bool = False) -> str:
    """The prompt's turn; it asks for the number alone unless the worked dialogues show their sums."""
    words = opening_message(start, operation[0], int(operation[1:]))
    return words if show_work else f"{words} {INSTRUCTION}"


def worked_answer(value: int, operation: str, show_work: bool) -> str:
    """A turn's answer to ``operation`` on ``value``: the result, or with ``show_work`` the sum that gives
    it ("16 - 9 = 7"; the environment reads the last number)."""
    result = value + int(operation)
    return f"{value} {operation[0]} {operation[1:]} = {result}" if show_work else str(result)


def example_turns(start: int, operations: Sequence[str], show_work: bool = False) -> list[dict]:
    """A worked dialogue as chat turns: the opening, then each answer and the next operation."""
    turns, value = [{"role": "user", "content": opening(start, operations[0], show_work)}], start
    for k, operation in enumerate(operations):
        turns.append({"role": "assistant", "content": worked_answer(value, operation, show_work)})
        value += int(operation)
        if k + 1 < len(operations):
            following = operations[k + 1]
            turns.append({"role": "user", "content": operation_message(following[0], int(following[1:]))})
    return turns


def row(start: int, operations: Sequence[str], answer: int, split: str, index: int,
        examples: Sequence[tuple[int, Sequence[str]]] = (), show_work: bool = False) -> dict:
    prompt = [turn for example in examples for turn in example_turns(*example, show_work)]
    return {
        "data_source": DATA_SOURCE,
        "prompt": [*prompt, {"role": "user", "content": opening(start, operations[0], show_work)}],
        "ability": "arithmetic",
        "reward_model": {"style": "rule", "ground_truth": str(answer)},
        "extra_info": {"split": split, "index": index, "start": start, "operations": list(operations), "answer": answer},
    }


def dialogues(operations: int, counts: Sequence[int], seed: int) -> list[list[tuple[int, list[str], int]]]:
    """Distinct dialogues (by start and operations) of ``operations`` turns, ``counts[k]`` of them in
    group k, none in two groups: e.g. train, held-out and tuning problems."""
    rng, seen, drawn, wanted = random.Random(seed), set(), [], sum(counts)
    for _ in range(100 * wanted):
        start, worked, answer = draw(rng, operations)
        if (start, *worked) not in seen:
            seen.add((start, *worked))
            drawn.append((start, worked, answer))
        if len(drawn) == wanted:
            break
    else:
        raise ValueError(f"fewer than {wanted} distinct dialogues of {operations} operations")
    groups, offset = [], 0
    for count in counts:
        groups.append(drawn[offset:offset + count])
        offset += count
    return groups


def write_dialogues(directory: Path, operations: int, train: int, held_out: int, seed: int,
                    examples: Sequence[tuple[int, Sequence[str]]] = ()) -> tuple[Path, Path]:
    """``dialogue_train.parquet`` and ``dialogue_val.parquet`` under ``directory``: ``train`` and
    ``held_out`` distinct dialogues of ``operations`` turns."""
    from recipe.spo.data.prepare import write_rows

    trained, kept = dialogues(operations, (train, held_out), seed)
    train_path, val_path = directory / "dialogue_train.parquet", directory / "dialogue_val.parquet"
    write_rows([row(*d, "train", i, examples) for i, d in enumerate(trained)], train_path)
    write_rows([row(*d, "test", i, examples) for i, d in enumerate(kept)], val_path)
    return train_path, val_path
