"""SPO on verl's legacy trainer (``trainer.use_v1=false``, ``RayPPOTrainer``).

verl's agent-loop worker turns ``extra_fields["spo"]`` into the ``non_tensor_batch`` column ``spo``,
but ``RayPPOTrainer.fit`` calls the module function ``compute_advantage`` without it. The thinnest
adapter verl allows: while an SPO trainer's ``fit`` runs, that module function is wrapped so the
estimator sees the column, and the loss is narrowed to the trained segments through
``response_mask`` (what the legacy actor update uses as its loss mask); with
``algorithm.spo.sample_log.dir`` set, a few responses of each step go to ``samples.jsonl`` there
(``spo_verl.trainer.sample_log``). ``fit`` itself is verl's.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from unittest import mock

import torch
import verl.trainer.ppo.ray_trainer as ray_trainer_module
from verl.trainer.ppo.ray_trainer import RayPPOTrainer

from spo_verl.batch_context import SPO_FIELD, provide_spo_rows
from spo_verl.config import parse_spo_settings
from spo_verl.trainer.common import SPO_ESTIMATORS, batch_metrics, install_spo_actor_loss, plain_validation
from spo_verl.trainer.packed_worker import enable_packed_training_on, packed_training_settings
from spo_verl.trainer.sample_log import SampledResponse, log_step, sample_log_settings
from spo_verl.trainer.token_budget import GeneratedTokenBudget, step_generated_tokens
from spo_verl.trainer.tree_balance import tree_order
from spo_verl.trainer.v1 import lift_spo_metrics

_verl_compute_advantage = ray_trainer_module.compute_advantage
SPO_METRICS_KEY = "spo_metrics"
GENERATED_TOKENS_KEY = "spo_generated_tokens"


def compute_advantage_with_spo_rows(data, adv_estimator, sample_logger=None, **kwargs):
    """verl's ``compute_advantage`` with the batch's ``spo`` column visible to the SPO estimators.
    ``sample_logger(data, context, response_mask)``, if given, sees the batch after the advantage step
    (``context`` None for other estimators), with the response mask before SPO narrows it."""
    if adv_estimator not in SPO_ESTIMATORS:
        data = _verl_compute_advantage(data, adv_estimator, **kwargs)
        data.meta_info[GENERATED_TOKENS_KEY] = step_generated_tokens(float(data.batch["response_mask"].sum()), {})
        if sample_logger is not None:
            sample_logger(data, None, data.batch["response_mask"])
        return data
    column = data.non_tensor_batch.get(SPO_FIELD)
    rows = list(column) if column is not None else [None] * len(data)
    with provide_spo_rows(rows) as context:
        data = _verl_compute_advantage(data, adv_estimator, **kwargs)
    response_mask = data.batch["response_mask"]
    spo_metrics = batch_metrics(context, response_mask)
    data.meta_info[SPO_METRICS_KEY] = spo_metrics
    data.meta_info[GENERATED_TOKENS_KEY] = step_generated_tokens(float(response_mask.sum()), spo_metrics)
    if sample_logger is not None:
        sample_logger(data, context, response_mask)
    if context.trained_mask is not None:
        data.batch["response_mask"] = response_mask * context.trained_mask.to(response_mask.dtype)
    return data


def log_legacy_samples(trainer, data, context, response_mask) -> None:
    """``algorithm.spo.sample_log`` on the legacy trainer's DataProto (left-padded prompts,
    right-padded responses, both delimited by ``attention_mask``)."""
    uids = data.non_tensor_batch["uid"]
    lengths = response_mask.sum(dim=-1).long().tolist()
    prompt_width = data.batch["prompts"].shape[-1]
    attention = data.batch["attention_mask"].bool()
    trained_mask = context.trained_mask if context is not None else None

    def fetch(chosen):
        responses = []
        for i in chosen:
            length = int(attention[i, prompt_width:].sum())
            mask = response_mask[i, :length]
            trained = mask.bool() if trained_mask is None else mask.bool() & trained_mask[i, :length].bool()
            responses.append(SampledResponse(
                batch_index=i, uid=str(uids[i]), row=context.rows[i] if context is not None else None,
                prompt_ids=data.batch["prompts"][i][attention[i, :prompt_width]].tolist(),
                response_ids=data.batch["responses"][i, :length].tolist(),
                log_probs=data.batch["old_log_probs"][i, :length], response_mask=mask,
                advantages=data.batch["advantages"][i, :length], trained=trained,
                score=float(data.batch["token_level_scores"][i].sum()),
            ))
        return responses

    log_step(
        trainer.global_steps, trainer.config, trainer.tokenizer, uids, lengths, fetch,
        rows=context.rows if context is not None else None,
        tree_nodes=context.tree_nodes if context is not None else None,
    )


@contextlib.contextmanager
def spo_advantage_hook(trainer=None) -> Iterator[None]:
    """While ``fit`` runs, verl's ``compute_advantage`` is ``compute_advantage_with_spo_rows`` (with
    ``trainer``'s sample log when ``algorithm.spo.sample_log.dir`` is set)."""
    hook = compute_advantage_with_spo_rows
    if trainer is not None and sample_log_settings(trainer.config.algorithm).dir is not None:
        hook = functools.partial(compute_advantage_with_spo_rows, sample_logger=functools.partial(log_legacy_samples, trainer))
    with mock.patch.object(ray_trainer_module, "compute_advantage", hook):
        yield


class SPORayPPOTrainer(RayPPOTrainer):
    def _create_dataloader(self, *args, **kwargs):
        super()._create_dataloader(*args, **kwargs)
        plain_validation(self)

    def init_workers(self):
        super().init_workers()
        install_spo_actor_loss(self.actor_rollout_wg, self.config)
        enable_packed_training_on([self.actor_rollout_wg, getattr(self, "ref_policy_wg", None)], self.config)

    def fit(self):
        with spo_advantage_hook(self):
            return super().fit()

    def _balance_batch(self, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
        """With packed training, each uid's rows (a prompt's responses, an SPO tree's leaves) stay on one
        data-parallel rank and next to each other: verl's own group-level balancing, which it applies
        for ``use_prefix_grouper`` (set here for the call only; nothing else reads it in this trainer)."""
        if packed_training_settings(self.config) is None:
            return super()._balance_batch(batch, metrics, logging_prefix=logging_prefix, keep_minibatch=keep_minibatch)
        uids = [str(uid) for uid in batch.non_tensor_batch["uid"]]
        batch.reorder(torch.tensor(tree_order(uids)))  # verl's grouping expects each uid's rows contiguous
        grouping = getattr(self, "use_prefix_grouper", False)
        self.use_prefix_grouper = True
        try:
            return super()._balance_batch(batch, metrics, logging_prefix=logging_prefix, keep_minibatch=keep_minibatch)
        finally:
            self.use_prefix_grouper = grouping

    def _update_actor(self, batch):
        output = super()._update_actor(batch)
        metrics = output.meta_info["metrics"]
        lift_spo_metrics(metrics)
        metrics.update(batch.meta_info.pop(SPO_METRICS_KEY, {}))
        if not hasattr(self, "_token_budget"):
            self._token_budget = GeneratedTokenBudget(parse_spo_settings(self.config.algorithm.get("spo")).generated_token_budget)
        self._token_budget.record(self, batch.meta_info.pop(GENERATED_TOKENS_KEY), metrics)
        return output
