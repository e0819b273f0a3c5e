"""SPO on verl's legacy trainer (``trainer.use_v1=false``, ``RayPPOTrainer``).

verl's agent-loop worker turns ``extra_fields["spo"]`` into the ``non_tensor_batch`` column ``spo``, but
``fit`` runs its advantage step (the module function ``compute_advantage``) without it, and no method of
the trainer lets the rows reach that call (see ``fit`` below). So ``fit`` runs inside
``advantage_channel.advantages_at_actor_update``, where an SPO estimator gives verl's step zeros (nothing
reads advantages before the actor update when there is no critic, and SPO has none), and
``_update_actor`` runs SPO's step (``step.py``) on the batch (``dataproto_batch.py``) around verl's own
``compute_advantage`` again, now with the rows, narrowing ``response_mask``, the legacy update's loss
mask, in place; verl's metrics after the update see the real advantages. ``_create_dataloader``
validates with plain answers, ``init_workers`` installs SPO's loss and packed forwards, and
``_balance_batch`` keeps each uid's rows together under packed training.
"""

from __future__ import annotations

import contextlib
from functools import partial
from typing import Any

import torch
from verl.trainer.ppo.ray_trainer import RayPPOTrainer, compute_advantage

from spo_verl.core.metadata import SPO_ALGORITHMS
from spo_verl.adapters.advantage_channel import advantages_at_actor_update
from spo_verl.adapters.trainer import dataproto_batch
from spo_verl.adapters.trainer.hooks import SPOTrainerHooks
from spo_verl.adapters.trainer.plain_validation import plain_validation
from spo_verl.adapters.trainer.step import SPOStepResult
from spo_verl.adapters.trainer.step_metrics import lift_spo_metrics
from spo_verl.adapters.trainer.tree_balance import tree_order


def advantages_with_spo_rows(data, config: Any):
    """verl's ``compute_advantage`` on ``data`` with the arguments ``fit`` passes it
    (``verl/trainer/ppo/ray_trainer.py:1667-1675``), for an SPO estimator, which reads the batch's rows
    inside SPO's step. A verl estimator's advantages are left as ``fit``'s own call computed them."""
    algorithm = config.algorithm
    if algorithm.adv_estimator not in SPO_ALGORITHMS:
        return data
    return compute_advantage(
        data, adv_estimator=algorithm.adv_estimator, gamma=algorithm.gamma, lam=algorithm.lam,
        num_repeat=config.actor_rollout_ref.rollout.n,
        norm_adv_by_std_in_grpo=algorithm.get("norm_adv_by_std_in_grpo", True), config=algorithm,
    )


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
        # The advantage step is deferred to the actor update because verl 0.9.1 offers no way to hand it
        # the rows short of patching verl. RayPPOTrainer.fit (verl/trainer/ppo/ray_trainer.py:1405) is one
        # loop body that calls the module function compute_advantage inline (1667-1675), and that function
        # hands a registered estimator token_level_rewards, response_mask, index and config only (the
        # non_tensor_batch goes to GDPO alone, 261-263). No method of the trainer runs on every step between
        # the rollout's batch getting its spo column (1541) and that call: _balance_batch only under
        # trainer.balance_batch (1549), _compute_reward_colocate only with a reward model that did not
        # score the batch (1563-1564), _compute_old_log_prob not in rollout correction's bypass mode
        # (1576-1586), _compute_ref_log_prob and _compute_values only with a reference policy or a critic
        # (1621, 1627). Replacing the module global ray_trainer.compute_advantage, which fit looks up, would
        # reach the call, but it changes verl's function for every trainer in the process and outlives this
        # one, and would stop working without a sound if fit imported the function another way. So inside
        # fit an SPO estimator gives verl's step zeros, and _update_actor computes the real advantages.
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
        step = self._spo_step_in_place(batch)
        output = super()._update_actor(batch)
        lift_spo_metrics(output.meta_info["metrics"])
        self.apply_spo_step(step, output.meta_info["metrics"])
        return output

    def _spo_step_in_place(self, batch) -> SPOStepResult:
        """SPO's step on the batch ``fit`` hands the actor update: the advantages (for an SPO estimator) and
        ``response_mask`` narrowed to the trained segments, in place. Returns the step's result."""
        _, step = self.run_spo_step(dataproto_batch.view_of(batch),
                                    partial(advantages_with_spo_rows, batch, self.config))
        if step.trained_mask is not None:
            batch.batch["response_mask"] = step.trained_mask
        return step
