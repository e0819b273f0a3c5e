"""SPO on verl 0.9.1's default trainer (``trainer.use_v1=true``, data in TransferQueue), registered as
the v1 trainer mode ``spo`` (``TRAINER_MODE``); it runs as verl's ``sync`` mode in everything else, so verl's checks on the
literal mode name still hold. Over verl's ``PPOTrainerSync``:

* ``_compute_advantage`` runs SPO's step (``step.py``) around verl's own ``_compute_advantage`` on the
  batch read from TransferQueue (``transfer_queue_batch.py``), applies its result and writes the loss
  mask narrowed to the trained segments back;
* ``_update_actor`` sends the actor only the rows that train a token (none: no forward/backward);
* ``_balance_batch`` keeps each prompt's rows together under packed training (``tree_balance.py``),
  ``_init_resource_pool_mgr`` maps the packed worker, ``init`` installs SPO's loss and packed forwards;
* ``_init_dataloader`` refuses ``__rollout_n__`` under ``spo_tree`` (:func:`check_no_per_row_rollout_n`)
  and validates with plain answers (``plain_validation.py``);
* ``_build_replay_buffer`` polls for finished rollouts every ``ROLLOUT_POLL_S`` instead of every 2 s.
"""

from __future__ import annotations

from functools import partial
from typing import Any

from omegaconf import open_dict
from verl.trainer.ppo.v1.trainer_base import register_trainer
from verl.trainer.ppo.v1.trainer_sync import PPOTrainerSync

from spo_verl.adapters.trainer import transfer_queue_batch as stored_batch
from spo_verl.adapters.trainer.hooks import SPOTrainerHooks
from spo_verl.adapters.trainer.packed_worker import use_packed_worker
from spo_verl.adapters.trainer.plain_validation import plain_validation
from spo_verl.adapters.trainer.step_metrics import lift_spo_metrics
from spo_verl.adapters.trainer.tree_balance import balance_keeping_trees

# The v1 trainer mode that hands SPO metadata to the estimators.
TRAINER_MODE = "spo"
# verl's sync replay buffer checks for finished rollouts every 2 s (its built-in default, not a setting),
# which rounds every step's generation up to the next 2 s: about 1 s a step lost on average, 7 % of a
# packed CPU step. A check costs one metadata read from TransferQueue.
ROLLOUT_POLL_S = 0.25


def check_no_per_row_rollout_n(config: Any, dataset: Any) -> None:
    """verl's default trainer lets a dataset column ``__rollout_n__`` change the number of sessions of
    a prompt; the ``spo_tree`` loop needs exactly one session per leaf slot."""
    columns = getattr(getattr(dataset, "dataframe", None), "column_names", None) or []
    if config.actor_rollout_ref.rollout.agent.default_agent_loop == "spo_tree" and "__rollout_n__" in columns:
        raise ValueError(
            "the training data has a __rollout_n__ column, which changes the number of sessions per prompt; "
            "spo_tree needs actor_rollout_ref.rollout.n (the tree's leaf slots) for every prompt: drop the column"
        )


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
        if not self.spo_settings.packing.enable:
            return super()._balance_batch(batch, metrics, logging_prefix=logging_prefix, keep_minibatch=keep_minibatch)
        return balance_keeping_trees(self, batch, metrics, logging_prefix)

    def _init_dataloader(self):
        super()._init_dataloader()
        check_no_per_row_rollout_n(self.config, self.train_dataset)
        plain_validation(self)

    def _compute_advantage(self, batch, metrics: dict):
        stored = stored_batch.read_stored(batch)
        batch, step = self.run_spo_step(stored_batch.view_of(batch, stored),
                                        partial(super()._compute_advantage, batch, metrics))
        self.apply_spo_step(step, metrics)
        trained = step.trained_mask
        self._spo_rows_to_train = None if trained is None else trained.sum(dim=1) > 0
        return batch if trained is None else stored_batch.write_trained_mask(batch, stored, trained)

    def _update_actor(self, batch, metrics: dict):
        rows, self._spo_rows_to_train = self._spo_rows_to_train, None
        if rows is None or bool(rows.all()):
            batch = super()._update_actor(batch, metrics)
            lift_spo_metrics(metrics)
            return batch
        kept = [i for i, keep in enumerate(rows.tolist()) if keep]
        metrics["spo/actor_update_rows"] = float(len(kept))
        metrics["spo/actor_skipped_rows"] = float(len(rows) - len(kept))
        if not kept:
            return batch
        update = self._balance_batch(stored_batch.rows_of(batch, kept), metrics, logging_prefix="spo/actor_update_seqlen")
        stored_batch.fit_padding_rows(update, known=set(batch.keys))
        update = super()._update_actor(update, metrics)
        lift_spo_metrics(metrics)
        return stored_batch.with_padding_of(batch, update)
