"""``arithmetic_dialogue``: a number worked on one operation a turn.

The prompt gives the starting number and the first operation; the model answers with the new number;
the environment gives the next operation, and after the last one ends the episode: reward 1 if the
last number of the model's last turn is the result, else 0. The row's ``extra_info`` holds
``operations`` ("+3", "-2", ...: the first is the prompt's) and ``answer``."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from spo_verl.core.episodes.environment import CopiedEnvironment, EnvironmentReply, register_environment

START_WORDS = "Start with {}."
OPERATION_WORDS = {"+": "Add {} to that.", "-": "Subtract {} from that."}
NUMBER = re.compile(r"-?\d+")
# Each operation's words with its number as a group, to read the messages back.
_OPERATION_PATTERNS = {operator: re.compile(r"(\d+)".join(map(re.escape, words.split("{}"))))
                       for operator, words in OPERATION_WORDS.items()}
_START = re.compile(r"(-?\d+)".join(map(re.escape, START_WORDS.split("{}"))))


def operation_message(operation: str, number: int) -> str:
    return OPERATION_WORDS[operation].format(number)


def opening_message(start: int, operation: str, number: int) -> str:
    """The prompt's turn: the start and the first operation."""
    return f"{START_WORDS.format(start)} {operation_message(operation, number)}"


def operations_in(text: str) -> list[tuple[str, int]]:
    """Every operation message in ``text``, in order, as ``(operator, number)``."""
    found = [(match.start(), operator, int(match.group(1)))
             for operator, pattern in _OPERATION_PATTERNS.items() for match in pattern.finditer(text)]
    return [(operator, number) for _, operator, number in sorted(found)]


def last_opening(prompt: str) -> tuple[int, tuple[str, int]]:
    """The start and first operation of the dialogue a prompt opens: its last "Start with N. <operation>"
    (earlier ones belong to the worked dialogues)."""
    starts = list(_START.finditer(prompt))
    if not starts:
        raise ValueError("no arithmetic dialogue in the prompt")
    operations = operations_in(prompt[starts[-1].end():])
    if not operations:
        raise ValueError("the dialogue's opening has no operation")
    return int(starts[-1].group(1)), operations[0]


def last_number(turn: str) -> int | None:
    """The number a turn answers with, as the environment reads it: its last."""
    numbers = NUMBER.findall(turn)
    return int(numbers[-1]) if numbers else None


@register_environment("arithmetic_dialogue")
class ArithmeticDialogue(CopiedEnvironment):
    def reset(self, data: Mapping[str, Any]) -> None:
        info = data.get("extra_info") or {}
        if "operations" not in info or "answer" not in info:
            raise ValueError("arithmetic_dialogue needs extra_info with 'operations' and 'answer' in each row")
        self.operations = [(str(op)[0], int(str(op)[1:])) for op in info["operations"]]
        self.answer = int(info["answer"])
        self.answered = 0  # the prompt holds the first operation

    async def step(self, turn: str) -> EnvironmentReply:
        self.answered += 1
        if self.answered < len(self.operations):
            return EnvironmentReply(operation_message(*self.operations[self.answered]))
        return EnvironmentReply(done=True, reward=float(last_number(turn) == self.answer))
