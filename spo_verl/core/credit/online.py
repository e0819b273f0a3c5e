"""The credit measures of one training step, as ``spo/credit/*`` metrics (no verl, no torch): the
responses of the step's batch as its estimator hands them to the loss, grouped by prompt."""

from __future__ import annotations

from collections.abc import Sequence

from spo_verl.core.credit.blame import Response, groups_of, summarise

PREFIX = "spo/credit/"


def credit_metrics(responses: Sequence[Response]) -> dict[str, float]:
    """Counts of the step's answers (right, wrong with the first wrong step placed, wrong and not
    placed), and the blame measures (``spo_verl.core.credit.blame``) over every token, over the probability
    mask's tokens and over the net advantage per unique token; a measure with nothing to measure this
    step (no blamed wrong answer, no right answer) is left out rather than logged as 0."""
    groups = groups_of(list(responses))
    every, masked, net = (summarise(groups, view) for view in ("all tokens", "in loss", "net"))
    metrics = {"right_answers": every.right, "wrong_answers_placed": every.wrong_placed,
               "wrong_answers_not_placed": every.wrong_not_placed, "wrong_answers_blamed": every.blamed,
               "blame_on_error": every.on_error, "blame_on_error_masked": masked.on_error,
               "blame_on_error_net": net.on_error, "right_steps_advantage_mean": every.right_steps_mean,
               "right_steps_negative_fraction": every.right_steps_negative_share,
               "right_answers_negative_fraction": every.right_with_negative_share}
    return {PREFIX + name: float(value) for name, value in metrics.items() if value is not None}
