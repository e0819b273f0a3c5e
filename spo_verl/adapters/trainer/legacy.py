"""SPO on verl's legacy trainer (``trainer.use_v1=false``, ``RayPPOTrainer``).

verl's agent-loop worker turns ``extra_fields["spo"]`` into the ``non_tensor_batch`` column ``spo``,
but ``RayPPOTrainer.fit`` runs its advantage step (the module function ``compute_advantage``) without
it. ``SPORayPPOTrainer`` overrides five methods; the first two carry SPO's advantage step:

* ``fit`` runs verl's ``fit`` unchanged inside ``advantage_channel.advantages_at_actor_update``: verl's
  advantage step gets zeros from an SPO estimator (nothing reads advantages between that step and the
  actor update when there is no critic, and SPO has none);
* ``_update_actor`` runs SPO's step (``spo_verl.adapters.trainer.step``, the same as the default
  trainer's): the advantages with the batch's ``spo`` column (verl's own ``compute_advantage`` with the
  same arguments ``fit`` uses, the rows in batch order), the loss narrowed to the trained segments
  through ``response_mask`` (what the legacy actor update uses as its loss mask), the ``spo/*`` metrics,
  the sample log, the credit metrics and the generated tokens against
  ``algorithm.spo.generated_token_budget``; it lifts the loss's ``spo/*`` metrics out of verl's ``actor/``
  prefix. It changes the batch in place, so verl's metrics after the update see the real advantages;
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

from spo_verl.core.metadata import EPISODE_FIELD, SPO_FIELD, episode_from_extra_field
from spo_verl.adapters.advantage_channel import advantages_at_actor_update
from spo_verl.adapters.trainer.common import plain_validation, uses_spo_metadata
from spo_verl.adapters.trainer.hooks import SPOTrainerHooks
from spo_verl.adapters.trainer.sample_log import SampledResponse
from spo_verl.adapters.trainer.step import BatchView, advantage_inputs, after_advantages
from spo_verl.adapters.trainer.step_metrics import lift_spo_metrics
from spo_verl.adapters.trainer.tree_balance import tree_order


def spo_advantage_step(data, trainer) -> dict[str, float]:
    """SPO's step (``spo_verl.adapters.trainer.step``) on a legacy batch, in place: for an SPO estimator
    verl's ``compute_advantage`` with the batch's ``spo`` column visible to it and ``response_mask``
    narrowed to the trained segments; other estimators' advantages (verl's, from ``fit``) are left as
    they are, under the ``trainer``'s settings. Returns the step's ``spo/*`` metrics, ``spo/generated_tokens``
    among them."""
    uids = [str(uid) for uid in data.non_tensor_batch["uid"]]
    column = data.non_tensor_batch.get(SPO_FIELD)
    episodes = data.non_tensor_batch.get(EPISODE_FIELD)
    response_mask = data.batch["response_mask"]
    view = BatchView(rows=list(column) if column is not None else [None] * len(data),
                     episodes=[episode_from_extra_field(e) for e in episodes] if episodes is not None else [None] * len(data),
                     uids=uids, response_mask=response_mask,
                     fetch=lambda context, chosen: legacy_responses(data, context, response_mask, chosen))
    algorithm = trainer.config.algorithm
    with advantage_inputs(view, algorithm.adv_estimator, trainer.spo_settings) as context:
        if context is not None:
            compute_advantage(
                data, adv_estimator=algorithm.adv_estimator, gamma=algorithm.gamma, lam=algorithm.lam,
                num_repeat=trainer.config.actor_rollout_ref.rollout.n,
                norm_adv_by_std_in_grpo=algorithm.get("norm_adv_by_std_in_grpo", True), config=algorithm,
            )
    metrics, trained = after_advantages(view, context, trainer.spo_settings, trainer)
    if trained is not None:
        data.batch["response_mask"] = trained
    return metrics


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


class SPORayPPOTrainer(SPOTrainerHooks, RayPPOTrainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.init_spo_state(self.config)

    def _create_dataloader(self, *args, **kwargs):
        super()._create_dataloader(*args, **kwargs)
        plain_validation(self)

    def init_workers(self):
        super().init_workers()
        self.install_spo_on_workers()

    def fit(self):
        deferred = advantages_at_actor_update() if uses_spo_metadata(self.config) else contextlib.nullcontext()
        with deferred:
            return super().fit()

    def _balance_batch(self, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
        """With packed training, each uid's rows (a prompt's responses, an SPO tree's leaves) stay on one
        data-parallel rank and next to each other: verl's own group-level balancing, which it applies
        for ``use_prefix_grouper`` (set here for the call only; nothing else reads it in this trainer)."""
        if not self.spo_settings.packed_training:
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
        spo_metrics = spo_advantage_step(batch, self)
        output = super()._update_actor(batch)
        lift_spo_metrics(output.meta_info["metrics"])
        self.record_spo_step(spo_metrics, output.meta_info["metrics"])
        return output
