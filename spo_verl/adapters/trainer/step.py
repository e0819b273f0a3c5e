"""SPO's step on a training batch, one for both verl trainers.

Around verl's advantage step (:func:`advantage_inputs`) the SPO estimators see the batch's SPO rows;
after it (:func:`after_advantages`) come the ``spo/*`` metrics, the step's generated tokens, the sample
log, the credit metrics and the response mask narrowed to the segments the estimator chose to train.
Each trainer describes its batch once as a :class:`BatchView` (the default trainer from TransferQueue,
``transfer_queue_batch.py``; the legacy trainer from its DataProto, ``dataproto_batch.py``), records the
tokens against its budget and writes the narrowed mask back its own way.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from spo_verl.core.config import SPOSettings
from spo_verl.core.metadata import SPO_ALGORITHMS
from spo_verl.adapters.advantage_channel import SPOBatchContext, is_padding_uid, provide_spo_rows
from spo_verl.adapters.trainer.step_metrics import batch_metrics, turn_metrics, without_padding
from spo_verl.adapters.trainer.credit_metrics import step_credit_metrics
from spo_verl.adapters.trainer.batch_view import BatchView, SampledResponse
from spo_verl.adapters.trainer.sample_log import log_step
from spo_verl.adapters.trainer.token_budget import GENERATED_TOKENS, step_generated_tokens


@contextlib.contextmanager
def advantage_inputs(view: BatchView, estimator: str, settings: SPOSettings) -> Iterator[SPOBatchContext | None]:
    """Run verl's advantage step inside: the SPO estimators read ``view.rows`` and what they compute
    lands in the yielded context (None for verl's own estimators, which need nothing)."""
    if estimator not in SPO_ALGORITHMS:
        yield None
        return
    with provide_spo_rows(list(view.rows), settings) as context:
        yield context


def after_advantages(view: BatchView, context: SPOBatchContext | None, settings: SPOSettings,
                     trainer: Any) -> tuple[dict[str, float], torch.Tensor | None]:
    """The step after verl's advantage step: its ``spo/*`` metrics (``spo/generated_tokens`` among them),
    the sample log and the credit metrics (which read the ``trainer``'s ``config``, ``tokenizer`` and
    ``global_steps``). Returns the metrics and the response mask narrowed to the trained segments, or
    None where every response token trains."""
    mask, padding = view.response_mask, view.padding
    if context is None:
        metrics = turn_metrics(without_padding(view.episodes, padding))
    else:
        metrics = batch_metrics(context, mask, view.episodes, padding)
    response_tokens = sum(float(row.sum()) for row, pad in zip(mask, padding) if not pad)
    metrics[GENERATED_TOKENS] = step_generated_tokens(response_tokens, metrics)

    fetched: dict[int, SampledResponse] = {}

    def responses(chosen: list[int]) -> list[SampledResponse]:
        """Each row read once, whether the sample log or the credit measure asks first."""
        missing = [i for i in chosen if i not in fetched]
        if missing:
            fetched.update(zip(missing, view.fetch(context, missing)))
        return [fetched[i] for i in chosen]

    if settings.diagnostics.sample_log.dir is not None:
        log_step(trainer.global_steps, trainer.config, trainer.tokenizer, view.uids, [int(row.sum()) for row in mask], responses,
                 settings, rows=context.rows if context is not None else None,
                 tree_nodes=context.tree_nodes if context is not None else None, padding=padding)
    if settings.diagnostics.credit_metrics:
        real = [i for i, pad in enumerate(padding) if not pad]
        metrics.update(step_credit_metrics(responses(real), trainer.tokenizer, settings.prob_mask.threshold))
    if context is None or context.trained_mask is None:
        return metrics, None
    return metrics, mask * context.trained_mask[:, : mask.shape[1]].to(mask.dtype)
