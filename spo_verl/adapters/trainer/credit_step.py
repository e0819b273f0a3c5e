"""``algorithm.spo.credit_metrics``: each step's batch read as the credit measures read a rollout
(``spo_verl.tools.credit``), logged as ``spo/credit/*``. The problem comes from the prompt (its last
"What is ...?"; earlier ones are worked examples), the first wrong step from the answer's tokens (in a
multi-turn arithmetic dialogue, the first token of its first wrong turn), the
probability mask from the batch's old log-probs, and ``spo/credit/seconds`` says what it cost."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Sequence

from spo_verl.core.algorithms.masked_loss import probability_mask
from spo_verl.core.credit.answer_errors import first_error_token, question_of
from spo_verl.core.credit.blame import Response
from spo_verl.core.credit.dialogue_errors import first_wrong_turn_token
from spo_verl.core.credit.online import PREFIX, credit_metrics
from spo_verl.adapters.trainer.sample_log import SampledResponse


def _first_error(tokenizer, response: SampledResponse) -> tuple[int | None, int | None]:
    """The first wrong token of a wrong answer, and for a multi-turn episode the turn it starts (from 1)."""
    try:
        prompt = tokenizer.decode(response.prompt_ids, skip_special_tokens=True)
        texts = tokenizer.batch_decode([[token] for token in response.response_ids])
        if response.episode is not None:
            environment = (response.response_mask[: len(texts)] == 0).tolist()
            placed = first_wrong_turn_token(prompt, texts, environment, response.score)
            return (None, None) if placed is None else (placed[1], placed[0])
        return first_error_token(question_of(prompt), texts, response.score)[1], None
    except ValueError:  # not a worked-sum problem or a dialogue, or steps it cannot read: counted as not placed
        return None, None


def step_credit_metrics(responses: Sequence[SampledResponse], tokenizer, threshold: float) -> dict[str, float]:
    """``spo/credit/*`` of the step's responses (every real row of the batch), and for multi-turn episodes
    ``spo/turns/first_wrong_turnK``: the share of the placed wrong episodes that first go wrong in turn K."""
    started = time.perf_counter()
    measured, wrong_turns = [], Counter()
    # A stand-in row fills a tree's unused leaf slot with a copy of a real leaf (it trains nothing):
    # counted, it would be one answer twice.
    for r in (r for r in responses if getattr(r.row, "trains", True)):
        length = len(r.response_ids)
        mask = r.response_mask[:length]
        first_error, wrong_turn = _first_error(tokenizer, r)
        if wrong_turn is not None:
            wrong_turns[wrong_turn] += 1
        # An episode is measured on the model's tokens: the environment's replies are no step of its answer.
        kept = [t for t, in_response in enumerate(mask.tolist()) if r.episode is None or in_response]
        advantages, trained = r.advantages[:length].tolist(), r.trained[:length].tolist()
        in_loss = probability_mask(r.log_probs[:length].float(), mask, threshold).tolist()
        measured.append(Response(
            prompt_uid=r.uid, response_id=str(r.batch_index), reward=r.score,
            tokens=tuple(r.response_ids[t] for t in kept), advantages=tuple(float(advantages[t]) for t in kept),
            in_loss=tuple(bool(in_loss[t]) for t in kept), trained=tuple(bool(trained[t]) for t in kept),
            first_error=None if first_error is None else kept.index(first_error)))
    metrics = credit_metrics(measured)
    placed = sum(wrong_turns.values())
    for turn in range(1, max(wrong_turns, default=0) + 1):
        metrics[f"spo/turns/first_wrong_turn{turn}"] = wrong_turns[turn] / placed
    metrics[PREFIX + "seconds"] = time.perf_counter() - started
    return metrics
