"""SPO's step on a training batch, one call for both verl trainers: :func:`spo_step`.

A trainer hands it its batch as a :class:`BatchView` (the default trainer from TransferQueue,
``transfer_queue_batch.py``; the legacy trainer from its DataProto, ``dataproto_batch.py``), verl's
advantage step as a callable (each trainer calls verl's its own way), and what the step reads of the run
by value: the settings, the estimator's and the loss's names, the tokenizer, the training step and the
last one, and the token budget. The step runs verl's advantage step with the batch's SPO rows visible to
the SPO estimators (``advantage_channel.py``), then computes the ``spo/*`` metrics, counts the step's
generated tokens against the budget, writes the sample log and the credit metrics, and narrows the
response mask to the segments the estimator chose to train. It changes nothing of the trainer: the
trainer applies the :class:`SPOStepResult` it returns, writing the narrowed mask back its own way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from spo_verl.core.config import SPOSettings
from spo_verl.core.metadata import SPO_ALGORITHMS
from spo_verl.adapters.advantage_channel import SPOBatchContext, provide_spo_rows
from spo_verl.adapters.trainer.batch_view import BatchView, SampledResponse
from spo_verl.adapters.trainer.credit_metrics import step_credit_metrics
from spo_verl.adapters.trainer.sample_log import log_step
from spo_verl.adapters.trainer.step_metrics import batch_metrics, turn_metrics, without_padding
from spo_verl.adapters.trainer.token_budget import GeneratedTokenBudget, step_generated_tokens

Advantaged = TypeVar("Advantaged")


@dataclass(frozen=True)
class SPOStepResult:
    """What the trainer applies after SPO's step: ``metrics``, the step's ``spo/*`` (its generated tokens
    and their count since training started among them), into the step's metrics; ``trained_mask``, the
    response mask narrowed to the trained segments (rows x response width), or None where every response
    token trains; ``last_training_step``, the step the token budget now makes the last, or None to keep
    the trainer's ``total_training_steps``."""

    metrics: dict[str, float]
    trained_mask: torch.Tensor | None
    last_training_step: int | None


def spo_step(view: BatchView, verl_advantage_step: Callable[[], Advantaged], *, settings: SPOSettings,
             estimator: str, loss_mode: str, tokenizer: Any, training_step: int, last_training_step: int,
             budget: GeneratedTokenBudget) -> tuple[Advantaged, SPOStepResult]:
    """SPO's step on the batch ``view`` describes, around ``verl_advantage_step`` (called once, with the SPO
    rows visible to an SPO ``estimator``; verl's own estimators need nothing). ``settings``: the run's
    ``algorithm.spo``; ``loss_mode`` and ``tokenizer``: for the sample log and the credit metrics;
    ``training_step``, ``last_training_step``: verl's ``global_steps`` and ``total_training_steps``, for the
    sample log and the ``budget``. Returns what ``verl_advantage_step`` returned, and the step's result."""
    spo_rows = provide_spo_rows(list(view.rows), settings) if estimator in SPO_ALGORITHMS else contextlib.nullcontext()
    with spo_rows as context:
        advantaged = verl_advantage_step()

    mask, padding = view.response_mask, view.padding
    if context is None:
        metrics = turn_metrics(without_padding(view.episodes, padding))
    else:
        metrics = batch_metrics(context, mask, view.episodes, padding)
    response_tokens = sum(float(row.sum()) for row, pad in zip(mask, padding) if not pad)
    last_step = budget.record(step_generated_tokens(response_tokens, metrics), training_step, last_training_step, metrics)

    responses = _fetched_once(view, context)
    if settings.diagnostics.sample_log.dir is not None:
        log_step(training_step, estimator, loss_mode, tokenizer, view.uids, [int(row.sum()) for row in mask], responses,
                 settings, rows=context.rows if context is not None else None,
                 tree_nodes=context.tree_nodes if context is not None else None, padding=padding)
    if settings.diagnostics.credit_metrics:
        real = [i for i, pad in enumerate(padding) if not pad]
        metrics.update(step_credit_metrics(responses(real), tokenizer, settings.prob_mask.threshold))
    trained = None
    if context is not None and context.trained_mask is not None:
        trained = mask * context.trained_mask[:, : mask.shape[1]].to(mask.dtype)
    return advantaged, SPOStepResult(metrics, trained, last_step)


def _fetched_once(view: BatchView, context: SPOBatchContext | None) -> Callable[[list[int]], list[SampledResponse]]:
    """``view.fetch`` of chosen rows, each row read once, whether the sample log or the credit measure asks first."""
    fetched: dict[int, SampledResponse] = {}

    def responses(chosen: list[int]) -> list[SampledResponse]:
        missing = [i for i in chosen if i not in fetched]
        if missing:
            fetched.update(zip(missing, view.fetch(context, missing)))
        return [fetched[i] for i in chosen]

    return responses
