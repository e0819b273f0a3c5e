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

OPERATION_WORDS = {"+": "Add {} to that.", "-": "Subtract {} from that."}
NUMBER = re.compile(r"-?\d+")


def operation_message(operation: str, number: int) -> str:
    return OPERATION_WORDS[operation].format(number)


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
        numbers = NUMBER.findall(turn)
        return EnvironmentReply(done=True, reward=float(bool(numbers) and int(numbers[-1]) == self.answer))
