"""The SPO reference's reward rule as a verl custom reward function (docs/FIDELITY.md, item 7).

Select it with ``reward.custom_reward_function.path=pkg://spo_verl.adapters.rewards`` and
``reward.custom_reward_function.name=compute_score``. Rule of the reference's math reward function:

* -2 for a response that writes the answer marker ``####`` two or more times;
* 0 for a response without an answer it can read (and, in the reference, for a truncated one: here
  that is ``algorithm.spo.truncated_response_score``, applied by SPO's estimators, since a reward
  function does not see whether its text was cut);
* 1 for a correct answer, 0 for a wrong one.

GSM8K (``data_source`` ``openai/gsm8k``): the answer is everything after the last ``####``, stripped,
compared to the ground truth with commas removed and case ignored, as the reference's GSM8K task does.
MATH-style sources (verl's MATH keys and ``aime*``): the answer is the last ``\\boxed{}``, compared with
verl's MATH equivalence (``verl.utils.reward_score.math_reward.is_equiv``), not the reference's own MATH
grader. The result is ``{"score", "acc"}``: verl logs ``acc`` (1 for a correct answer) as the
validation accuracy, so a -2 penalty does not count as a negative accuracy. With the rollout's stop
strings (``stop``), only the text before the first of them is scored.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from verl.utils.reward_score.math_reward import is_equiv, last_boxed_only_string, remove_boxed

ANSWER_MARKER = "####"
MULTIPLE_ANSWERS_SCORE = -2.0
GSM8K_SOURCES = ("openai/gsm8k",)
MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")


def _gsm8k_correct(solution_str: str, ground_truth: str) -> bool:
    if ANSWER_MARKER not in solution_str:
        return False
    answer = solution_str.split(ANSWER_MARKER)[-1].strip()
    return answer.replace(",", "").lower() == str(ground_truth).strip().lower()


def _math_correct(solution_str: str, ground_truth: str) -> bool:
    boxed = last_boxed_only_string(solution_str)
    if boxed is None:
        return False
    try:
        answer = remove_boxed(boxed)
    except AssertionError:  # "\boxed" with no braces or closing brace: no answer to read
        return False
    return is_equiv(answer, str(ground_truth))


def before_stop_string(text: str, stop: Sequence[str] | None) -> str:
    """``text`` up to the first of the stop strings in it (the rollout's token ids, which verl decodes,
    end with the stop string's tokens; the reference scores the text before it)."""
    cuts = [text.find(marker) for marker in (stop or ()) if marker and marker in text]
    return text[: min(cuts)] if cuts else text


def compute_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None,
                  stop: Sequence[str] | None = None, **kwargs) -> dict[str, float]:
    """verl's custom reward signature; see the module docstring for the rule. ``stop``: the rollout's
    stop strings (the settings pass ``rollout.custom.stop`` through ``custom_reward_function.reward_kwargs``)."""
    solution_str = before_stop_string(solution_str, stop)
    if data_source in GSM8K_SOURCES:
        correct = _gsm8k_correct
    elif data_source in MATH_SOURCES or str(data_source).startswith("aime"):
        correct = _math_correct
    else:
        raise ValueError(
            f"spo_verl.adapters.rewards.compute_score scores data_source {list(GSM8K_SOURCES)} (GSM8K) and "
            f"{list(MATH_SOURCES)} or 'aime*' (MATH-style); got {data_source!r}"
        )
    if solution_str.count(ANSWER_MARKER) >= 2:
        return {"score": MULTIPLE_ANSWERS_SCORE, "acc": 0.0}
    acc = float(correct(solution_str, ground_truth))
    return {"score": acc, "acc": acc}
