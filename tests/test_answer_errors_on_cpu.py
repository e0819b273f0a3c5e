"""The error analysis of the arithmetic tasks: each answer gets the first step that breaks, each
multi-turn dialogue its first wrong turn."""

import json
import random
import re

import pytest

from recipe.spo.cpu_settings import smollm2
from spo_verl.core.credit.answer_errors import (count_kinds, error_kind, expected_steps, first_error, first_error_token,
                                                main, question_of)
from spo_verl.core.credit.dialogue_errors import first_wrong_turn, first_wrong_turn_token, turn_spans


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


QUESTION = "What is 12 + 5 + 6 + 3?"  # three steps: 12 + 5 = 17, 17 + 6 = 23, 23 + 3 = 26
EOS = "<|im_end|>"


def tokens_of(text: str) -> list[str]:
    """A response as a tokenizer might cut it: numbers, operators and words with their leading space, full
    stops, newlines, '####' and the end-of-turn token each one token."""
    tokens = re.findall(r"<\|im_end\|>|\s?\d+|\s?[-+*=]|\s?[a-z]+|\.|\n|####", text)
    assert "".join(tokens) == text
    return tokens


@pytest.mark.parametrize("response, score, kind, token", [
    ("12 + 5 = 17. 17 + 6 = 23. 23 + 3 = 26.\n#### 26" + EOS, 1.0, "right", None),
    # A wrong operand in step 1: its token " 6" (index 2).
    ("12 + 6 = 18. 18 + 6 = 24. 24 + 3 = 27.\n#### 27" + EOS, 0.0, "step 1: wrong numbers", 2),
    # Right operands, wrong result: the result " 16" (index 4).
    ("12 + 5 = 16. 16 + 6 = 22. 22 + 3 = 25.\n#### 25" + EOS, 0.0, "step 1: wrong arithmetic", 4),
    # Wrong at the last step: six tokens a step, its result is token 16.
    ("12 + 5 = 17. 17 + 6 = 23. 23 + 3 = 25.\n#### 25" + EOS, 0.0, "step 3+: wrong", 16),
    # A missing step: '####' (index 13) stands where "23 + 3 = 26." should.
    ("12 + 5 = 17. 17 + 6 = 23.\n#### 23" + EOS, 0.0, "steps missing", 13),
    # Every step right, no final line: the end-of-turn token (index 18) stands where '####' should.
    ("12 + 5 = 17. 17 + 6 = 23. 23 + 3 = 26." + EOS, 0.0, "no final answer", 18),
    # The same cut off by the length limit: nothing written where the final line should be.
    ("12 + 5 = 17. 17 + 6 = 23. 23 + 3 = 26.", 0.0, "no final answer", None),
    # No final line and a wrong step: counted as no final answer, placed at the wrong step.
    ("12 + 5 = 17. 17 + 7 = 24." + EOS, 0.0, "no final answer", 8),
    # Every step right, a wrong final line: its number " 28" (index 20).
    ("12 + 5 = 17. 17 + 6 = 23. 23 + 3 = 26.\n#### 28" + EOS, 0.0, "final answer differs from the worked result", 20),
    # Right steps and answer, yet scored wrong: not placed, counted as other.
    ("12 + 5 = 17. 17 + 6 = 23. 23 + 3 = 26.\n#### 26 and more", 0.0, "other", None),
])
def test_the_first_wrong_step_as_a_token(response, score, kind, token):
    assert first_error_token(QUESTION, tokens_of(response), score) == (kind, token)


def test_a_token_that_starts_right_and_goes_wrong_is_the_first_wrong_token():
    # One token " 16." holds a right space and a wrong digit: it is the first wrong one.
    tokens = ["12", " +", " 5", " =", " 16.", " 16 + 6 = 22.", " 22 + 3 = 25.", "\n#### 25"]
    assert first_error_token(QUESTION, tokens, 0.0) == ("step 1: wrong arithmetic", 4)


@pytest.mark.parametrize("steps", list(smollm2.HORIZON_STEPS))
def test_each_horizon_task_works_its_examples_in_k_right_steps(steps):
    task = smollm2.TASKS[f"steps{steps}"]
    for question, answer in task.examples:
        assert len(expected_steps(question)) == steps
        assert first_error(question, answer, 0.0) == ("other", None)  # every step and the answer right
    question, answer = smollm2.problem(random.Random(1), f"steps{steps}")
    assert len(expected_steps(question)) == steps and expected_steps(question)[-1][3] == answer


# A multi-turn arithmetic dialogue: the worked dialogue in the prompt, then the one the model plays.
DIALOGUE_PROMPT = ("user\nStart with 3. Add 4 to that.\nassistant\n3 + 4 = 7\nuser\nSubtract 2 from that.\nassistant\n"
                   "7 - 2 = 5\nuser\nStart with 16. Subtract 9 from that.\nassistant\n")
REPLY = "|\nuser\nAdd 4 to that.\nassistant\n"  # the environment's, after the model's end of turn "|"


@pytest.mark.parametrize(("turns", "wrong"), [
    (["16 - 9 = 7", "7 + 4 = 11"], None),
    (["16 - 9 = 7", "7 + 4 = 12"], 1),
    (["16 - 9 = 8", "8 + 4 = 12"], 0),  # turn 2 is right from turn 1's number, but the dialogue went wrong at turn 1
    (["seven", "7 + 4 = 11"], 0),  # no number: the environment reads none
    (["16 - 9 = 7, then 7"], None),  # its last number is the one read; the episode ended before turn 2
])
def test_the_first_wrong_turn_of_a_dialogue(turns, wrong):
    assert first_wrong_turn(DIALOGUE_PROMPT, turns, [REPLY] * (len(turns) - 1)) == wrong


def test_a_dialogue_that_cannot_be_read_is_refused():
    with pytest.raises(ValueError, match="no arithmetic dialogue"):
        first_wrong_turn("What is 3 + 4?", ["7"], [])
    with pytest.raises(ValueError, match="0 operations"):
        first_wrong_turn(DIALOGUE_PROMPT, ["16 - 9 = 7", "11"], ["|\nuser\nWell done.\n"])


def test_the_first_wrong_turn_as_a_token():
    """A character a token; the environment's reply flagged: turn 2 starts after the reply."""
    response = "16 - 9 = 7" + REPLY + "7 + 4 = 12|"
    environment = [False] * 10 + [True] * len(REPLY) + [False] * 11
    tokens = list(response)
    assert turn_spans(environment) == ([range(0, 10), range(10 + len(REPLY), len(response))],
                                       [range(10, 10 + len(REPLY))])
    assert turn_spans([]) == ([], [])
    assert first_wrong_turn_token(DIALOGUE_PROMPT, tokens, environment, 0.0) == (2, 10 + len(REPLY))
    assert first_wrong_turn_token(DIALOGUE_PROMPT, tokens, environment, 1.0) is None  # right: nothing to place
    wrong_first = "16 - 9 = 6" + REPLY + "6 + 4 = 10|"
    assert first_wrong_turn_token(DIALOGUE_PROMPT, list(wrong_first), environment, 0.0) == (1, 0)
    # Cut by the length limit inside the reply: turn 1 was right and no turn 2 was played.
    cut = len("16 - 9 = 7") + 5
    assert first_wrong_turn_token(DIALOGUE_PROMPT, tokens[:cut], environment[:cut], 0.0) is None
    with pytest.raises(ValueError, match="environment flags"):
        first_wrong_turn_token(DIALOGUE_PROMPT, tokens, environment[:-1], 0.0)
