"""SPO on verl's legacy trainer (``trainer.use_v1=false``, ``RayPPOTrainer``).

verl's agent-loop worker turns ``extra_fields["spo"]`` into the ``non_tensor_batch`` column ``spo``,
but ``RayPPOTrainer.fit`` runs its advantage step (the module function ``compute_advantage``) without
it. ``SPORayPPOTrainer`` overrides five methods; the first two carry SPO's advantage step:

* ``fit`` runs verl's ``fit`` unchanged inside ``batch_context.advantages_at_actor_update``: verl's
  advantage step gets zeros from an SPO estimator (nothing reads advantages between that step and the
  actor update when there is no critic, and SPO has none);
* ``_update_actor`` computes the advantages with the batch's ``spo`` column (verl's own
  ``compute_advantage`` with the same arguments ``fit`` uses, the rows in batch order), narrows the
  loss to the trained segments through ``response_mask`` (what the legacy actor update uses as its
  loss mask), logs samples (``algorithm.spo.sample_log.dir``) and the credit metrics
  (``algorithm.spo.credit_metrics``), counts generated tokens (``algorithm.spo.generated_token_budget``)
  and lifts the loss's ``spo/*`` metrics out of verl's ``actor/`` prefix. It changes the batch in
  place, so verl's metrics after the update see the real advantages;
* ``_create_dataloader``: when the rollout uses an SPO agent loop, validation samples plain
  single-turn responses;
* ``init_workers`` installs SPO's actor loss and, with ``algorithm.spo.packed_training``, switches the
  actor/reference engines to packed forwards;
* ``_balance_batch``, with packed training, keeps each uid's rows on one rank and next to each other.
"""

from __future__ import annotations

import contextlib

import torch
from verl.trainer.ppo.ray_trainer import RayPPOTrainer, compute_advantage

from spo_verl.core.batch_context import advantages_at_actor_update, is_padding_uid, provide_spo_rows
from spo_verl.core.metadata import EPISODE_FIELD, SPO_FIELD, episode_from_extra_field
from spo_verl.adapters.trainer.common import (SPO_ESTIMATORS, batch_metrics, install_spo_actor_loss, lift_spo_metrics,
                                              plain_validation, spo_settings_of, turn_metrics, uses_spo_metadata)
from spo_verl.adapters.trainer.credit_step import step_credit_metrics
from spo_verl.adapters.trainer.packed_worker import enable_packed_training_on, packed_training_settings
from spo_verl.adapters.trainer.sample_log import SampledResponse, log_step
from spo_verl.adapters.trainer.token_budget import GeneratedTokenBudget, step_generated_tokens
from spo_verl.adapters.trainer.tree_balance import tree_order


def spo_advantage_step(data, algorithm_config, rollout_n: int, read_batch=None, settings=None) -> dict[str, float]:
    """The SPO advantage step on a legacy batch, in place: verl's ``compute_advantage`` with the
    batch's ``spo`` column visible to the SPO estimators, then ``response_mask`` narrowed to the trained
    segments. Other estimators' advantages (verl's, from ``fit``) are left as they are.
    ``read_batch(data, context, response_mask)``, if given, sees the batch after the advantage step
    (``context`` None for other estimators), with the response mask before SPO narrows it, and returns
    metrics of its own. Returns the step's ``spo/*`` metrics and its generated tokens
    (``spo/generated_tokens``)."""
    response_mask = data.batch["response_mask"]
    column = data.non_tensor_batch.get(EPISODE_FIELD)
    episodes = [episode_from_extra_field(value) for value in column] if column is not None else []
    if algorithm_config.adv_estimator not in SPO_ESTIMATORS:
        read = read_batch(data, None, response_mask) if read_batch is not None else {}
        return {**read, **turn_metrics(episodes),
                "spo/generated_tokens": step_generated_tokens(float(response_mask.sum()), {})}
    column = data.non_tensor_batch.get(SPO_FIELD)
    rows = list(column) if column is not None else [None] * len(data)
    with provide_spo_rows(rows, settings) as context:
        compute_advantage(
            data, adv_estimator=algorithm_config.adv_estimator, gamma=algorithm_config.gamma,
            lam=algorithm_config.lam, num_repeat=rollout_n,
            norm_adv_by_std_in_grpo=algorithm_config.get("norm_adv_by_std_in_grpo", True), config=algorithm_config,
        )
    spo_metrics = batch_metrics(context, response_mask, episodes)
    if read_batch is not None:
        spo_metrics.update(read_batch(data, context, response_mask))
    if context.trained_mask is not None:
        data.batch["response_mask"] = response_mask * context.trained_mask.to(response_mask.dtype)
    return {**spo_metrics, "spo/generated_tokens": step_generated_tokens(float(response_mask.sum()), spo_metrics)}


def legacy_responses(data, context, response_mask, chosen: list[int]) -> list[SampledResponse]:
    """Rows ``chosen`` of the legacy trainer's DataProto (left-padded prompts, right-padded responses,
    both delimited by ``attention_mask``) as plain per-token sequences; ``response_mask`` before SPO
    narrows it."""
    uids = data.non_tensor_batch["uid"]
    prompt_width = data.batch["prompts"].shape[-1]
    attention = data.batch["attention_mask"].bool()
    episodes = data.non_tensor_batch.get(EPISODE_FIELD)
    responses = []
    for i in chosen:
        length = int(attention[i, prompt_width:].sum())
        responses.append(SampledResponse.of_row(
            context, i, str(uids[i]), data.batch["prompts"][i][attention[i, :prompt_width]].tolist(),
            data.batch["responses"][i, :length].tolist(), data.batch["old_log_probs"][i, :length],
            response_mask[i, :length], data.batch["advantages"][i, :length],
            float(data.batch["token_level_scores"][i].sum()), episodes[i] if episodes is not None else None,
        ))
    return responses


def after_legacy_advantages(trainer, data, context, response_mask) -> dict[str, float]:
    """What reads the legacy batch once its advantages are final: ``algorithm.spo.sample_log`` and
    ``algorithm.spo.credit_metrics`` (returned as metrics)."""
    settings = spo_settings_of(trainer)
    uids = data.non_tensor_batch["uid"]
    if settings.sample_log.dir is not None:
        log_step(
            trainer.global_steps, trainer.config, trainer.tokenizer, uids, response_mask.sum(dim=-1).long().tolist(),
            lambda chosen: legacy_responses(data, context, response_mask, chosen),
            rows=context.rows if context is not None else None,
            tree_nodes=context.tree_nodes if context is not None else None, settings=settings,
        )
    if not settings.credit_metrics:
        return {}
    real = [i for i, uid in enumerate(uids) if not is_padding_uid(uid)]
    return step_credit_metrics(legacy_responses(data, context, response_mask, real), trainer.tokenizer,
                               settings.prob_mask.threshold)


class SPORayPPOTrainer(RayPPOTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._token_budget = GeneratedTokenBudget(spo_settings_of(self).generated_token_budget)

    def _create_dataloader(self, *args, **kwargs):
        super()._create_dataloader(*args, **kwargs)
        plain_validation(self)

    def init_workers(self):
        super().init_workers()
        install_spo_actor_loss(self.actor_rollout_wg, self.config)
        enable_packed_training_on([self.actor_rollout_wg, getattr(self, "ref_policy_wg", None)], self.config)

    def fit(self):
        deferred = advantages_at_actor_update() if uses_spo_metadata(self.config) else contextlib.nullcontext()
        with deferred:
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
        settings = spo_settings_of(self)
        read = lambda data, context, mask: after_legacy_advantages(self, data, context, mask)  # noqa: E731
        spo_metrics = spo_advantage_step(batch, self.config.algorithm, self.config.actor_rollout_ref.rollout.n, read,
                                         settings)
        step_tokens = spo_metrics.pop("spo/generated_tokens")
        output = super()._update_actor(batch)
        metrics = output.meta_info["metrics"]
        lift_spo_metrics(metrics)
        metrics.update(spo_metrics)
        self._token_budget.record(self, step_tokens, metrics)
        return output
