"""SPO on verl's legacy trainer (``trainer.use_v1=false``, ``RayPPOTrainer``).

verl's agent-loop worker turns ``extra_fields["spo"]`` into the ``non_tensor_batch`` column ``spo``, but
``fit`` runs its advantage step (the module function ``compute_advantage``) without it. So ``fit`` runs
inside ``advantage_channel.advantages_at_actor_update``, where an SPO estimator gives verl's step zeros
(nothing reads advantages before the actor update when there is no critic, and SPO has none), and
``_update_actor`` runs SPO's step (``step.py``) on the batch (``dataproto_batch.py``) with verl's own
``compute_advantage``, narrowing ``response_mask``, the legacy update's loss mask, in place; verl's
metrics after the update see the real advantages. ``_create_dataloader`` validates with plain answers,
``init_workers`` installs SPO's loss and packed forwards, and ``_balance_batch`` keeps each uid's rows
together under packed training.
"""

from __future__ import annotations

import contextlib

import torch
from verl.trainer.ppo.ray_trainer import RayPPOTrainer, compute_advantage

from spo_verl.adapters.advantage_channel import advantages_at_actor_update
from spo_verl.adapters.trainer import dataproto_batch
from spo_verl.core.metadata import SPO_ALGORITHMS
from spo_verl.adapters.trainer.hooks import SPOTrainerHooks
from spo_verl.adapters.trainer.plain_validation import plain_validation
from spo_verl.adapters.trainer.step import advantage_inputs, after_advantages
from spo_verl.adapters.trainer.step_metrics import lift_spo_metrics
from spo_verl.adapters.trainer.tree_balance import tree_order


def spo_advantage_step(data, trainer) -> dict[str, float]:
    """SPO's step on a legacy batch, in place, under the ``trainer``'s settings: for an SPO estimator verl's
    ``compute_advantage`` with the ``spo`` column visible to it (the arguments ``fit`` passes) and
    ``response_mask`` narrowed to the trained segments; other estimators' advantages (verl's, from
    ``fit``) stay. Returns the step's ``spo/*`` metrics, ``spo/generated_tokens`` among them."""
    view = dataproto_batch.view_of(data)
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
        deferred = self.config.algorithm.adv_estimator in SPO_ALGORITHMS
        with advantages_at_actor_update() if deferred else contextlib.nullcontext():
            return super().fit()

    def _balance_batch(self, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
        """Packed training: verl's uid-group balancing, which it applies for ``use_prefix_grouper`` (set for
        the call only; nothing else reads it here), on rows ordered uid by uid as that expects."""
        if self.spo_settings.packing.enable:
            batch.reorder(torch.tensor(tree_order([str(uid) for uid in batch.non_tensor_batch["uid"]])))
        grouping = getattr(self, "use_prefix_grouper", False)
        self.use_prefix_grouper = grouping or self.spo_settings.packing.enable
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
