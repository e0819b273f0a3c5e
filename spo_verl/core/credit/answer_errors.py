"""What went wrong in an answer to a generated arithmetic problem ("What is a + b - c?"): the first
step that breaks, read from the worked equations the answer writes before ``#### result``.

    python -m spo_verl.core.credit.answer_errors RUN_FOLDER/validation/0.jsonl [MORE.jsonl ...]

reads verl's validation dumps (``trainer.validation_data_dir``: one JSON line per answer with its
``input``, ``output`` and ``score``; the study keeps them for every run) and prints one table row per
file: how many answers fall in each kind (``KINDS``), in shares of all answers.

The problem is evaluated left to right (the tasks' operators make that the usual order): step k is
``(result of step k-1) op_k (number k+1)``. An answer's k-th equation ``x op y = z`` is compared
with step k: other operands than the problem's (or the previous result) are "wrong numbers", the
right operands with another result "wrong arithmetic".
"""

from __future__ import annotations

import argparse
import json
import operator
import re
from collections import Counter
from pathlib import Path

KINDS = ("right", "no final answer", "step 1: wrong numbers", "step 1: wrong arithmetic", "step 2: wrong numbers",
         "step 2: wrong arithmetic", "step 3+: wrong", "steps missing", "final answer differs from the worked result",
         "other")
_OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul}
_QUESTION = re.compile(r"What is ((?:\d+ [-+*] )+\d+)\?")
_EQUATION = re.compile(r"(-?\d+)\s*([-+*])\s*(-?\d+)\s*=\s*(-?\d+)")
_FINAL = re.compile(r"####\s*(-?\d+)")


def expected_steps(question: str) -> list[tuple[int, str, int, int]]:
    """``(left, op, right, result)`` of each step of the problem, left to right."""
    match = _QUESTION.search(question)
    if match is None:
        raise ValueError(f"not a generated arithmetic problem: {question!r}")
    parts = match.group(1).split()
    value, steps = int(parts[0]), []
    for op, number in zip(parts[1::2], parts[2::2]):
        result = _OPERATIONS[op](value, int(number))
        steps.append((value, op, int(number), result))
        value = result
    return steps


def error_kind(question: str, response: str, score: float) -> str:
    """The first thing that goes wrong in ``response`` (one of ``KINDS``)."""
    return first_error(question, response, score)[0]


def first_error(question: str, response: str, score: float) -> tuple[str, int | None]:
    """The kind of the first thing that goes wrong (one of ``KINDS``; an answer without a final line
    counts as "no final answer" whatever else is wrong) and the offset in ``response`` of the first
    character that differs from what a right step at that place would write: a wrong operand,
    operator or result, or, for a missing step or final line, the first thing written in its place.
    The offset is ``None`` for a right answer and for one whose error cannot be placed ("other")."""
    if score >= 1:
        return "right", None
    steps = expected_steps(question)
    final = _FINAL.search(response)
    kind, char = _first_wrong_step(steps, list(_EQUATION.finditer(response[: final.start()] if final else response)),
                                   response)
    if final is None:
        return "no final answer", char
    if kind is not None:
        return kind, char
    if int(final.group(1)) != steps[-1][3]:
        return "final answer differs from the worked result", final.start(1)
    return "other", None  # every step and the answer right, yet scored wrong (e.g. text after the answer)


def _first_wrong_step(steps, equations, response: str) -> tuple[str | None, int]:
    """The kind and offset of the first step written wrong or missing; ``(None, offset)`` when every
    step is right, the offset then being where the final line should start."""
    right_until = 0  # the end of the last right step
    for k, step in enumerate(steps):
        name = f"step {k + 1}" if k < 2 else "step 3+"
        if k >= len(equations):
            return "steps missing", _next_written(response, right_until)
        equation = equations[k]
        written = (int(equation[1]), equation[2], int(equation[3]))
        for group, (got, wanted) in enumerate(zip(written, step[:3]), start=1):
            if got != wanted:
                return (f"{name}: wrong numbers" if k < 2 else "step 3+: wrong"), equation.start(group)
        if int(equation[4]) != step[3]:
            return (f"{name}: wrong arithmetic" if k < 2 else "step 3+: wrong"), equation.start(4)
        right_until = equation.end()
    return None, _next_written(response, right_until)


def _next_written(response: str, start: int) -> int:
    """The first character from ``start`` on that is not the end of a step (a full stop or white
    space); ``len(response)`` if the response ends there."""
    rest = response[start:]
    return start + (len(rest) - len(rest.lstrip(". \n\t")))


def first_error_token(question: str, tokens: list[str], score: float) -> tuple[str, int | None]:
    """:func:`first_error` on a response given as its tokens' texts (an end-of-sequence token's text
    included, if the response has one): the index of the token that holds the first wrong character.
    ``None`` also where nothing is written in the wrong step's place (a response cut off by the length
    limit after its last right step)."""
    kind, char = first_error(question, "".join(tokens), score)
    end = 0
    for index, token in enumerate(tokens):
        end += len(token)
        if char is not None and char < end:
            return kind, index
    return kind, None


def question_of(prompt: str) -> str:
    """The problem of a validation input: the last "What is ...?" in the chat (earlier ones are the worked examples)."""
    matches = _QUESTION.findall(prompt)
    if not matches:
        raise ValueError("no generated arithmetic problem in the prompt")
    return f"What is {matches[-1]}?"


def count_kinds(path: str | Path) -> Counter:
    kinds: Counter = Counter()
    for line in Path(path).read_text(encoding="utf-8").splitlines():
        if line.strip():
            record = json.loads(line)
            kinds[error_kind(question_of(record["input"]), record["output"], float(record["score"]))] += 1
    return kinds


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m spo_verl.core.credit.answer_errors",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("dumps", nargs="+", help="verl validation dumps (<step>.jsonl)")
    args = parser.parse_args(argv)
    print("| file | answers | " + " | ".join(KINDS) + " |")
    print("|---|---|" + "---|" * len(KINDS))
    for dump in args.dumps:
        kinds = count_kinds(dump)
        total = sum(kinds.values())
        print(f"| {dump} | {total} | " + " | ".join(f"{kinds[k] / total:.3f}" for k in KINDS) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
