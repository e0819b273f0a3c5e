"""``algorithm.spo.credit_metrics``: each step's batch read as the credit measures read a rollout
(``spo_verl.tools.credit``), logged as ``spo/credit/*``. The problem comes from the prompt (its last
"What is ...?"; earlier ones are worked examples), the first wrong step from the answer's tokens, the
probability mask from the batch's old log-probs, and ``spo/credit/seconds`` says what it cost."""

from __future__ import annotations

import time
from collections.abc import Sequence

from spo_verl.core.algorithms.masked_loss import probability_mask
from spo_verl.core.credit.answer_errors import first_error_token, question_of
from spo_verl.core.credit.blame import Response
from spo_verl.core.credit.online import PREFIX, credit_metrics
from spo_verl.adapters.trainer.sample_log import SampledResponse


def _first_error(tokenizer, response: SampledResponse) -> int | None:
    try:
        question = question_of(tokenizer.decode(response.prompt_ids, skip_special_tokens=True))
        texts = tokenizer.batch_decode([[token] for token in response.response_ids])
        return first_error_token(question, texts, response.score)[1]
    except ValueError:  # not a worked-sum problem, or steps it cannot read: counted as not placed
        return None


def step_credit_metrics(responses: Sequence[SampledResponse], tokenizer, threshold: float) -> dict[str, float]:
    """``spo/credit/*`` of the step's responses (every real row of the batch)."""
    started = time.perf_counter()
    measured = []
    # A stand-in row fills a tree's unused leaf slot with a copy of a real leaf (it trains nothing):
    # counted, it would be one answer twice.
    for r in (r for r in responses if getattr(r.row, "trains", True)):
        length = len(r.response_ids)
        mask = r.response_mask[:length]
        measured.append(Response(
            prompt_uid=r.uid, response_id=str(r.batch_index), reward=r.score, tokens=tuple(r.response_ids),
            advantages=tuple(float(a) for a in r.advantages[:length].tolist()),
            in_loss=tuple(probability_mask(r.log_probs[:length].float(), mask, threshold).tolist()),
            trained=tuple(bool(t) for t in r.trained[:length].tolist()),
            first_error=_first_error(tokenizer, r)))
    metrics = credit_metrics(measured)
    metrics[PREFIX + "seconds"] = time.perf_counter() - started
    return metrics
