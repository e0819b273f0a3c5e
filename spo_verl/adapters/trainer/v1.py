"""SPO on verl 0.9.1's default trainer (``trainer.use_v1=true``, data in TransferQueue).

``SPOTrainer`` is verl's synchronous trainer with these overrides:
* ``_compute_advantage`` reads each trajectory's ``extra_fields["spo"]`` from TransferQueue and runs
  verl's own advantage step with those rows visible to the SPO estimators; then it restricts the loss
  to the segments the estimator chose to train (``response_mask``/``loss_mask`` in TransferQueue, as
  verl's rollout correction does) and logs ``spo/*`` metrics. For every algorithm it counts the step's
  generated tokens (``spo/generated_tokens``, ``algorithm.spo.generated_token_budget``:
  ``spo_verl.adapters.trainer.token_budget``); with ``algorithm.spo.sample_log.dir`` set it also appends a few
  of the step's responses (segments, probabilities, advantages; one whole tree for spo_tree) to
  ``samples.jsonl`` there (``spo_verl.adapters.trainer.sample_log``), and with ``algorithm.spo.credit_metrics``
  it logs where the step's advantages put the blame (``spo/credit/*``, ``spo_verl.adapters.trainer.credit_step``);
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

from spo_verl.core.batch_context import provide_spo_rows
from spo_verl.core.metadata import EPISODE_FIELD, SPO_FIELD
from spo_verl.adapters.trainer.common import (
    TRAINER_MODE,
    batch_metrics,
    check_no_per_row_rollout_n,
    episodes_from_extra_fields,
    extra_field_values,
    install_spo_actor_loss,
    lift_spo_metrics,
    plain_validation,
    spo_settings_of,
    turn_metrics,
    uses_spo_metadata,
    without_padding,
)
from spo_verl.adapters.trainer.credit_step import step_credit_metrics
from spo_verl.adapters.trainer.packed_worker import (
    enable_packed_training_on, packed_training_settings, use_packed_worker,
)
from spo_verl.adapters.trainer.sample_log import SampledResponse, log_step
from spo_verl.adapters.trainer.token_budget import GeneratedTokenBudget, step_generated_tokens
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
class SPOTrainer(PPOTrainerSync):
    def __init__(self, config):
        with open_dict(config):
            config.trainer.v1.trainer_mode = "sync"
        super().__init__(config)
        self.init_spo_state()

    def init_spo_state(self) -> None:
        """What SPO keeps across a run's hooks: the token budget, and the rows whose trained mask is not
        empty, from a step's advantage step to its actor update."""
        self._token_budget = GeneratedTokenBudget(spo_settings_of(self).generated_token_budget)
        self._spo_rows_to_train = None

    def init(self):
        super().init()
        install_spo_actor_loss(self.actor_rollout_wg, self.config)
        enable_packed_training_on([self.actor_rollout_wg, getattr(self, "ref_policy_wg", None)], self.config)

    def _build_replay_buffer(self):
        buffer = super()._build_replay_buffer()
        if hasattr(buffer, "poll_interval"):
            buffer.poll_interval = min(buffer.poll_interval, ROLLOUT_POLL_S)
        return buffer

    def _init_resource_pool_mgr(self):
        super()._init_resource_pool_mgr()
        use_packed_worker(self.role_worker_mapping, self.config)

    def _balance_batch(self, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
        if packed_training_settings(self.config) is None:
            return super()._balance_batch(batch, metrics, logging_prefix=logging_prefix, keep_minibatch=keep_minibatch)
        return balance_keeping_trees(self, batch, metrics, logging_prefix)

    def _init_dataloader(self):
        super()._init_dataloader()
        check_no_per_row_rollout_n(self.config, self.train_dataset)
        plain_validation(self)

    def _compute_advantage(self, batch, metrics: dict):
        if not uses_spo_metadata(self.config):
            batch = super()._compute_advantage(batch, metrics)
            stored = tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                                     select_fields=["uid", "response_mask", "extra_fields"])
            episodes = episodes_from_extra_fields(list(stored["extra_fields"]))
            metrics.update(turn_metrics(without_padding(episodes, padding_rows(batch))))
            self._count_generated_tokens(batch, stored["response_mask"], metrics)
            self._log_and_measure(batch, stored, None, metrics)
            return batch
        stored = tq.kv_batch_get(
            keys=batch.keys, partition_id=batch.partition_id, select_fields=["extra_fields", "response_mask", "uid"]
        )
        rows = extra_field_values(list(stored["extra_fields"]), SPO_FIELD)
        with provide_spo_rows(rows, spo_settings_of(self)) as context:
            batch = super()._compute_advantage(batch, metrics)
        response_mask = stored["response_mask"]
        padded_mask = response_mask.to_padded_tensor(0)
        metrics.update(batch_metrics(context, padded_mask, episodes_from_extra_fields(list(stored["extra_fields"])),
                                     padding_rows(batch)))
        self._spo_rows_to_train = None
        if context.trained_mask is not None:
            trained = padded_mask * context.trained_mask[:, : padded_mask.shape[1]].to(padded_mask.dtype)
            self._spo_rows_to_train = trained.sum(dim=1) > 0
            nested = response_to_nested(trained, response_mask)
            batch = tq.kv_batch_put(
                keys=batch.keys,
                partition_id=batch.partition_id,
                fields=TensorDict({"response_mask": nested, "loss_mask": nested}, batch_size=len(batch)),
            )
        self._count_generated_tokens(batch, response_mask, metrics)
        self._log_and_measure(batch, stored, context, metrics)
        return batch

    def _count_generated_tokens(self, batch, response_mask, metrics: dict) -> None:
        """``spo/generated_tokens`` of this step (padding rows excluded) and the token budget's stop."""
        response_tokens = sum(float(mask.sum()) for mask, padding in zip(response_mask.unbind(), padding_rows(batch))
                              if not padding)
        self._token_budget.record(self, step_generated_tokens(response_tokens, metrics), metrics)

    def _log_and_measure(self, batch, stored, context, metrics: dict) -> None:
        """The sample log and the credit metrics of the step, each row they read fetched once."""
        fetched: dict[int, SampledResponse] = {}

        def responses(chosen: list[int]) -> list[SampledResponse]:
            missing = [i for i in chosen if i not in fetched]
            if missing:
                fetched.update(zip(missing, self._fetch_responses(batch, stored, context, missing)))
            return [fetched[i] for i in chosen]

        self._log_samples(batch, stored, context, responses)
        self._credit_metrics(batch, responses, metrics)

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

    def _credit_metrics(self, batch, responses, metrics: dict) -> None:
        """``algorithm.spo.credit_metrics``: ``spo/credit/*`` over every real row of the step."""
        settings = spo_settings_of(self)
        if not settings.credit_metrics:
            return
        real = [i for i, padding in enumerate(padding_rows(batch)) if not padding]
        metrics.update(step_credit_metrics(responses(real), self.tokenizer,
                                           settings.prob_mask.threshold))

    def _log_samples(self, batch, stored, context, responses) -> None:
        """``algorithm.spo.sample_log``: fetch only the chosen rows from TransferQueue and append them."""
        if spo_settings_of(self).sample_log.dir is None:
            return
        uids = _stored_uids(stored)
        log_step(
            self.global_steps, self.config, self.tokenizer, uids, [int(m.sum()) for m in stored["response_mask"].unbind()],
            responses,
            rows=context.rows if context is not None else None,
            tree_nodes=context.tree_nodes if context is not None else None,
            padding=padding_rows(batch), settings=spo_settings_of(self),
        )

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


def padding_rows(batch: KVBatchMeta) -> list[bool]:
    """Which rows of the batch are verl's padding (``upsample_batch_to_divisible_size`` tags them)."""
    return [bool(tag.get("is_padding", False)) for tag in batch.tags]


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
