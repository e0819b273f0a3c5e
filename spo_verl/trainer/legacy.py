"""SPO on verl's legacy trainer (``trainer.use_v1=false``, ``RayPPOTrainer``).

verl's agent-loop worker turns ``extra_fields["spo"]`` into the ``non_tensor_batch`` column ``spo``,
but ``RayPPOTrainer.fit`` calls the module function ``compute_advantage`` without it. The thinnest
adapter verl allows: while an SPO trainer's ``fit`` runs, that module function is wrapped so the
estimator sees the column, and the loss is narrowed to the trained segments through
``response_mask`` (what the legacy actor update uses as its loss mask). ``fit`` itself is verl's.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from unittest import mock

import verl.trainer.ppo.ray_trainer as ray_trainer_module
from verl.trainer.ppo.ray_trainer import RayPPOTrainer

from spo_verl.batch_context import SPO_FIELD, provide_spo_rows
from spo_verl.trainer.common import SPO_ESTIMATORS, batch_metrics, install_spo_actor_loss, plain_validation
from spo_verl.trainer.v1 import lift_spo_metrics

_verl_compute_advantage = ray_trainer_module.compute_advantage
SPO_METRICS_KEY = "spo_metrics"


def compute_advantage_with_spo_rows(data, adv_estimator, **kwargs):
    """verl's ``compute_advantage`` with the batch's ``spo`` column visible to the SPO estimators."""
    if adv_estimator not in SPO_ESTIMATORS:
        return _verl_compute_advantage(data, adv_estimator, **kwargs)
    column = data.non_tensor_batch.get(SPO_FIELD)
    rows = list(column) if column is not None else [None] * len(data)
    with provide_spo_rows(rows) as context:
        data = _verl_compute_advantage(data, adv_estimator, **kwargs)
    response_mask = data.batch["response_mask"]
    data.meta_info[SPO_METRICS_KEY] = batch_metrics(context, response_mask)
    if context.trained_mask is not None:
        data.batch["response_mask"] = response_mask * context.trained_mask.to(response_mask.dtype)
    return data


@contextlib.contextmanager
def spo_advantage_hook() -> Iterator[None]:
    with mock.patch.object(ray_trainer_module, "compute_advantage", compute_advantage_with_spo_rows):
        yield


class SPORayPPOTrainer(RayPPOTrainer):
    def _create_dataloader(self, *args, **kwargs):
        super()._create_dataloader(*args, **kwargs)
        plain_validation(self)

    def init_workers(self):
        super().init_workers()
        install_spo_actor_loss(self.actor_rollout_wg, self.config)

    def fit(self):
        with spo_advantage_hook():
            return super().fit()

    def _update_actor(self, batch):
        output = super()._update_actor(batch)
        metrics = output.meta_info["metrics"]
        lift_spo_metrics(metrics)
        metrics.update(batch.meta_info.pop(SPO_METRICS_KEY, {}))
        return output
