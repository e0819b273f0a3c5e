"""SPO on verl 0.9.1's default trainer (``trainer.use_v1=true``, data in TransferQueue).

``SPOTrainer`` is verl's synchronous trainer with these overrides:
* ``_compute_advantage`` reads each trajectory's ``extra_fields["spo"]`` from TransferQueue and runs
  verl's own advantage step inside SPO's step (``spo_verl.adapters.trainer.step``, the same for the
  legacy trainer): the ``spo/*`` metrics, the generated tokens against
  ``algorithm.spo.generated_token_budget``, the sample log and the credit metrics; it restricts the loss
  to the segments the estimator chose to train (``response_mask``/``loss_mask`` in TransferQueue, as
  verl's rollout correction does);
* ``init`` installs SPO's actor loss (verl's ``ppo_loss`` plus the reference's masked KL);
* ``_init_dataloader`` refuses a ``__rollout_n__`` data column under ``spo_tree`` and, when the rollout
  uses an SPO agent loop, has validation sample plain single-turn responses;
* ``_build_replay_buffer``: the replay buffer looks for finished rollouts every ``ROLLOUT_POLL_S``
  instead of every 2 s;
* with ``algorithm.spo.packed_training``, ``_init_resource_pool_mgr`` puts the packed worker in the
  role mapping and ``init`` switches the actor/reference engines to packed forwards
  (``spo_verl.adapters.trainer.packed_worker``), and ``_balance_batch`` keeps each prompt's rows together
  (``spo_verl.adapters.trainer.tree_balance``);
* ``_update_actor`` sends only the trajectories that train at least one token to the actor (leaves
  whose segments are all trained elsewhere or all zero cost no forward/backward), padded and
  balanced by ``_balance_batch``; it lifts the loss's ``spo/*`` metrics out of verl's ``actor/`` prefix.

Registered as the v1 trainer mode ``spo`` (``trainer.v1.trainer_mode=spo``); it behaves as verl's
``sync`` mode in everything else, so verl's own checks on the literal mode name still hold.
"""

from __future__ import annotations

import torch
import transfer_queue as tq
from omegaconf import open_dict
from tensordict import TensorDict
from transfer_queue import KVBatchMeta
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync
from verl.workers.utils.padding import response_to_nested

from spo_verl.core.metadata import EPISODE_FIELD, SPO_FIELD
from spo_verl.adapters.trainer.common import (
    TRAINER_MODE, check_no_per_row_rollout_n, episodes_from_extra_fields, extra_field_values, plain_validation,
)
from spo_verl.adapters.trainer.hooks import SPOTrainerHooks
from spo_verl.adapters.trainer.packed_worker import use_packed_worker
from spo_verl.adapters.trainer.sample_log import SampledResponse
from spo_verl.adapters.trainer.step import BatchView, advantage_inputs, after_advantages
from spo_verl.adapters.trainer.step_metrics import lift_spo_metrics
from spo_verl.adapters.trainer.tree_balance import balance_keeping_trees

# verl's sync replay buffer checks for finished rollouts every 2 s (its built-in default, not a setting),
# which rounds every step's generation up to the next 2 s: about 1 s a step lost on average, 7 % of a
# packed CPU step. A check costs one metadata read from TransferQueue.
ROLLOUT_POLL_S = 0.25
#: Per-response-token fields written after the rollout (the advantage step, old and reference
#: log-probs, values, rollout-correction weights). verl's padding rows copy every field of a real row
#: and reset only the rollout's own to one token; padded this late, the rest keep that row's length.
LATE_TOKEN_FIELDS = ("old_log_probs", "advantages", "returns", "ref_log_prob", "values", "rollout_is_weights")


@register_trainer(TRAINER_MODE)
class SPOTrainer(SPOTrainerHooks, PPOTrainerSync):
    def __init__(self, config):
        with open_dict(config):
            config.trainer.v1.trainer_mode = "sync"
        self.init_spo_state(config)  # verl's constructor already builds the role mapping (packed worker)
        super().__init__(config)

    #: The rows whose trained mask is not empty, from a step's advantage step to its actor update.
    _spo_rows_to_train = None

    def init(self):
        super().init()
        self.install_spo_on_workers()

    def _build_replay_buffer(self):
        buffer = super()._build_replay_buffer()
        if hasattr(buffer, "poll_interval"):
            buffer.poll_interval = min(buffer.poll_interval, ROLLOUT_POLL_S)
        return buffer

    def _init_resource_pool_mgr(self):
        super()._init_resource_pool_mgr()
        use_packed_worker(self.role_worker_mapping, self.spo_settings)

    def _balance_batch(self, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
        if not self.spo_settings.packed_training:
            return super()._balance_batch(batch, metrics, logging_prefix=logging_prefix, keep_minibatch=keep_minibatch)
        return balance_keeping_trees(self, batch, metrics, logging_prefix)

    def _init_dataloader(self):
        super()._init_dataloader()
        check_no_per_row_rollout_n(self.config, self.train_dataset)
        plain_validation(self)

    def _compute_advantage(self, batch, metrics: dict):
        stored = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                                 select_fields=["extra_fields", "response_mask", "uid"])
        extra_fields = list(stored["extra_fields"])
        view = BatchView(rows=extra_field_values(extra_fields, SPO_FIELD), episodes=episodes_from_extra_fields(extra_fields),
                         uids=_stored_uids(stored), response_mask=stored["response_mask"].to_padded_tensor(0),
                         fetch=lambda context, chosen: self._fetch_responses(batch, stored, context, chosen))
        with advantage_inputs(view, self.config.algorithm.adv_estimator, self.spo_settings) as context:
            batch = super()._compute_advantage(batch, metrics)
        step_metrics, trained = after_advantages(view, context, self.spo_settings, self)
        self.record_spo_step(step_metrics, metrics)
        self._spo_rows_to_train = None
        if trained is not None:  # the loss narrowed to the trained segments, as verl's rollout correction masks
            self._spo_rows_to_train = trained.sum(dim=1) > 0
            nested = response_to_nested(trained, stored["response_mask"])
            batch = tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id,
                                    fields=TensorDict({"response_mask": nested, "loss_mask": nested}, batch_size=len(batch)))
        return batch

    def _fetch_responses(self, batch, stored, context, chosen: list[int]) -> list[SampledResponse]:
        """Rows ``chosen`` of the step's batch from TransferQueue, as plain per-token sequences.
        ``stored`` holds the batch's uids, extra fields and response_mask before SPO narrowed it."""
        data = tq.kv_batch_get(
            keys=[batch.keys[i] for i in chosen], partition_id=batch.partition_id,
            select_fields=["prompts", "responses", "advantages", "old_log_probs", "rm_scores"],
        )
        fields = {name: list(data[name].unbind()) for name in data.keys()}
        masks = list(stored["response_mask"].unbind())
        uids = _stored_uids(stored)
        episodes = extra_field_values(list(stored["extra_fields"]), EPISODE_FIELD)
        return [SampledResponse.of_row(context, i, uids[i], fields["prompts"][j].tolist(), fields["responses"][j].tolist(),
                                       fields["old_log_probs"][j], masks[i], fields["advantages"][j],
                                       float(fields["rm_scores"][j].sum()), episodes[i])
                for j, i in enumerate(chosen)]

    def _update_actor(self, batch, metrics: dict):
        rows = self._spo_rows_to_train
        self._spo_rows_to_train = None
        if rows is None or bool(rows.all()):
            batch = super()._update_actor(batch, metrics)
            lift_spo_metrics(metrics)
            return batch
        kept = [i for i, keep in enumerate(rows.tolist()) if keep]
        metrics["spo/actor_update_rows"] = float(len(kept))
        metrics["spo/actor_skipped_rows"] = float(len(rows) - len(kept))
        if not kept:
            return batch  # nothing to train this step: no actor forward/backward at all
        update = KVBatchMeta(
            partition_id=batch.partition_id,
            keys=[batch.keys[i] for i in kept],
            tags=[batch.tags[i] for i in kept],
            extra_info=dict(batch.extra_info),
        )
        update = self._balance_batch(update, metrics, logging_prefix="spo/actor_update_seqlen")
        _fit_padding_rows(update, known=set(batch.keys))
        update = super()._update_actor(update, metrics)
        lift_spo_metrics(metrics)
        # Padding rows added for the update live in TransferQueue too: hand them back for cleanup.
        known = set(batch.keys)
        added = [(key, tag) for key, tag in zip(update.keys, update.tags) if key not in known]
        return KVBatchMeta(
            partition_id=batch.partition_id,
            keys=batch.keys + [key for key, _ in added],
            tags=batch.tags + [tag for _, tag in added],
            extra_info=batch.extra_info,
        )


def _stored_uids(stored) -> list[str]:
    """The batch's uids as TransferQueue returns them (a list of strings, a NonTensorStack once padded)."""
    uids = stored["uid"]
    return [str(uid) for uid in (uids.tolist() if hasattr(uids, "tolist") else uids)]


def _fit_padding_rows(update: KVBatchMeta, known: set) -> None:
    """Give the padding rows verl added to ``update`` one token of each late per-token field (zeros,
    as verl's padding does for the rollout's fields), so that a micro-batch's fields pad to one width."""
    added = [key for key, tag in zip(update.keys, update.tags) if key not in known and tag.get("is_padding", False)]
    if not added:
        return
    sample = tq.kv_batch_get(keys=added[:1], partition_id=update.partition_id)[0]
    present = [name for name in LATE_TOKEN_FIELDS if name in sample.keys()]
    if not present:
        return
    fields = {name: torch.nested.as_nested_tensor([torch.zeros(1, dtype=sample[name].dtype)] * len(added),
                                                  layout=torch.jagged) for name in present}
    tq.kv_batch_put(keys=added, partition_id=update.partition_id, fields=TensorDict(fields, batch_size=len(added)))
