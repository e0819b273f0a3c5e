"""The error analysis of the arithmetic tasks: each answer gets the first step that breaks."""

import json

import pytest

from spo_verl.cpu_settings import smollm2
from spo_verl.cpu_settings.answer_errors import count_kinds, error_kind, expected_steps, main, question_of


def test_the_steps_of_a_problem_left_to_right():
    assert expected_steps("What is 12 + 5 - 6?") == [(12, "+", 5, 17), (17, "-", 6, 11)]
    assert expected_steps("What is 3 * 4 + 2 + 6?") == [(3, "*", 4, 12), (12, "+", 2, 14), (14, "+", 6, 20)]
    with pytest.raises(ValueError, match="not a generated arithmetic problem"):
        expected_steps("How many apples?")


@pytest.mark.parametrize("response, score, kind", [
    ("12 + 5 = 17. 17 - 6 = 11.\n#### 11", 1.0, "right"),
    ("12 + 5 = 17. 17 - 6 = 11.", 0.0, "no final answer"),
    ("12 + 6 = 18. 18 - 6 = 12.\n#### 12", 0.0, "step 1: wrong numbers"),
    ("12 + 5 = 16. 16 - 6 = 10.\n#### 10", 0.0, "step 1: wrong arithmetic"),
    ("12 + 5 = 17. 17 - 5 = 12.\n#### 12", 0.0, "step 2: wrong numbers"),
    ("12 + 5 = 17. 17 - 6 = 12.\n#### 12", 0.0, "step 2: wrong arithmetic"),
    ("12 + 5 = 17.\n#### 17", 0.0, "steps missing"),
    ("12 + 5 = 17. 17 - 6 = 11.\n#### 13", 0.0, "final answer differs from the worked result"),
    ("12 + 5 = 17. 17 - 6 = 11.\n#### 11 and more", 0.0, "other"),
])
def test_the_first_thing_that_goes_wrong(response, score, kind):
    assert error_kind("What is 12 + 5 - 6?", response, score) == kind


def test_a_validation_dump_is_counted_by_kind(tmp_path, capsys):
    # The prompt as verl's dump has it: the worked examples' questions first, the problem last.
    messages = smollm2.messages("What is 12 + 5 - 6?")
    prompt = " ".join(turn["content"] for turn in messages)
    assert question_of(prompt) == "What is 12 + 5 - 6?"
    dump = tmp_path / "0.jsonl"
    answers = [("12 + 5 = 17. 17 - 6 = 11.\n#### 11", 1.0), ("12 + 5 = 16. 16 - 6 = 10.\n#### 10", 0.0),
               ("12 + 5 = 17. 17 - 6 = 11.\n#### 11", 1.0), ("no idea", 0.0)]
    dump.write_text("".join(json.dumps({"input": prompt, "output": o, "score": s, "step": 0}) + "\n" for o, s in answers))
    assert count_kinds(dump) == {"right": 2, "step 1: wrong arithmetic": 1, "no final answer": 1}
    assert main([str(dump)]) == 0
    row = capsys.readouterr().out.splitlines()[2]
    assert row.startswith(f"| {dump} | 4 | 0.500 | 0.250 | 0.000 | 0.250 |")
