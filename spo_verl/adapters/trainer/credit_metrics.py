"""``algorithm.spo.diagnostics.credit_metrics``: each step's batch read as the credit measures read a rollout
(``spo_workbench.credit``), logged as ``spo/credit/*``. The problem comes from the prompt (its last
"What is ...?"; earlier ones are worked examples), the first wrong step from the answer's tokens (in a
multi-turn arithmetic dialogue, the first token of its first wrong turn), the
probability mask from the batch's old log-probs, and ``spo/credit/seconds`` says what it cost."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace

from spo_verl.core.algorithms.masked_loss import probability_mask
from spo_verl.core.credit.answer_errors import first_error_token, question_of
from spo_verl.core.credit.blame import Response
from spo_verl.core.credit.dialogue_errors import first_wrong_turn_token
from spo_verl.core.credit.online import PREFIX, credit_metrics
from spo_verl.adapters.trainer.batch_view import SampledResponse


def _first_error(tokenizer, response: SampledResponse) -> tuple[int | None, int | None]:
    """The first wrong token of a wrong answer, and for a multi-turn episode the turn it starts (from 1)."""
    try:
        prompt = tokenizer.decode(response.prompt_ids, skip_special_tokens=True)
        question = None if response.episode is not None else question_of(prompt)  # before decoding each token
        texts = tokenizer.batch_decode([[token] for token in response.response_ids])
        if question is not None:
            return first_error_token(question, texts, response.score)[1], None
        environment = (response.response_mask[: len(texts)] == 0).tolist()
        placed = first_wrong_turn_token(prompt, texts, environment, response.score)
        return (None, None) if placed is None else (placed[1], placed[0])
    except ValueError:  # not a worked-sum problem or a dialogue, or steps it cannot read: counted as not placed
        return None, None


def step_credit_metrics(responses: Sequence[SampledResponse], tokenizer, threshold: float) -> dict[str, float]:
    """``spo/credit/*`` of the step's responses (every real row of the batch), and for multi-turn episodes
    where they first go wrong and the blame of those wrong after a right turn (:func:`_turn_metrics`)."""
    started = time.perf_counter()
    measured, first_wrong_turns = [], []
    # A stand-in row fills a tree's unused leaf slot with a copy of a real leaf (it trains nothing):
    # counted, it would be one answer twice.
    for r in (r for r in responses if getattr(r.row, "trains", True)):
        length = len(r.response_ids)
        mask = r.response_mask[:length]
        first_error, wrong_turn = _first_error(tokenizer, r)
        first_wrong_turns.append(wrong_turn)
        # An episode is measured on the model's tokens: the environment's replies are no step of its answer.
        kept = [t for t, in_response in enumerate(mask.tolist()) if r.episode is None or in_response]
        advantages, trained = r.advantages[:length].tolist(), r.trained[:length].tolist()
        in_loss = probability_mask(r.log_probs[:length].float(), mask, threshold).tolist()
        measured.append(Response(
            prompt_uid=r.uid, response_id=str(r.batch_index), reward=r.score,
            tokens=tuple(r.response_ids[t] for t in kept), advantages=tuple(float(advantages[t]) for t in kept),
            in_loss=tuple(bool(in_loss[t]) for t in kept), trained=tuple(bool(trained[t]) for t in kept),
            first_error=None if first_error is None else kept.index(first_error)))
    metrics = {**credit_metrics(measured), **_turn_metrics(measured, first_wrong_turns)}
    metrics[PREFIX + "seconds"] = time.perf_counter() - started
    return metrics


# The blame measures over the wrong episodes whose first turn was right, under their own names: an
# episode wrong from turn 1 has all its blame "on the error" under any estimator.
AFTER_RIGHT_TURNS = {"blame_on_error": "blame_on_wrong_turn", "blame_on_error_masked": "blame_on_wrong_turn_masked",
                     "blame_on_error_net": "blame_on_wrong_turn_net", "right_steps_advantage_mean": "right_turns_advantage_mean"}


def _turn_metrics(measured: Sequence[Response], first_wrong_turns: Sequence[int | None]) -> dict[str, float]:
    """``spo/turns/first_wrong_turnK`` (the share of the placed wrong episodes that first go wrong in turn
    K) and, over the episodes first wrong after turn 1, the ``AFTER_RIGHT_TURNS`` measures."""
    placed = [turn for turn in first_wrong_turns if turn is not None]
    if not placed:
        return {}
    metrics = {f"spo/turns/first_wrong_turn{k}": placed.count(k) / len(placed) for k in range(1, max(placed) + 1)}
    # The episodes wrong from turn 1 left unplaced, the right ones kept: the net view sums over each group.
    later = credit_metrics([replace(r, first_error=None) if turn == 1 else r for r, turn in zip(measured, first_wrong_turns)])
    for name, renamed in AFTER_RIGHT_TURNS.items():
        if PREFIX + name in later:
            metrics[f"spo/turns/{renamed}"] = later[PREFIX + name]
    return metrics
