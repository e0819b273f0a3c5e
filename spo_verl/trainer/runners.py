"""verl TaskRunners that train with SPO; ``run_ppo(config, task_runner_class=...)`` starts them.

Both are verl's own runners. The v1 runner only makes sure the ``spo`` trainer mode is registered in
the TaskRunner process (verl looks the mode up there); the legacy runner builds ``SPORayPPOTrainer``
where verl's builds ``RayPPOTrainer``.
"""

from __future__ import annotations

from unittest import mock

import ray
from verl.trainer import main_ppo_v0
from verl.trainer.main_ppo import TaskRunnerV1

import spo_verl.register  # noqa: F401  (estimators, loss and agent loop in this process)
from spo_verl.trainer import v1  # noqa: F401  (registers the 'spo' trainer mode)
from spo_verl.trainer.legacy import SPORayPPOTrainer
from spo_verl.trainer.packed_worker import SPOActorRolloutRefWorker, use_packed_worker


class _SPOTaskRunnerV1(TaskRunnerV1.__ray_actor_class__):
    pass


class _SPOLegacyTaskRunner(main_ppo_v0.TaskRunner.__ray_actor_class__):
    def __init__(self):
        # verl's TaskRunner.__init__ is a zero-argument super().__init__(); when Ray ships this
        # subclass to the actor process that call fails ("obj must be an instance or subtype of
        # type"). It only runs BaseTaskRunner.__init__, so call that directly.
        main_ppo_v0.BaseTaskRunner.__init__(self)

    def add_actor_rollout_worker(self, config):
        actor_rollout_cls, worker_group_cls = super().add_actor_rollout_worker(config)
        if use_packed_worker(self.role_worker_mapping, config):
            actor_rollout_cls = SPOActorRolloutRefWorker
        return actor_rollout_cls, worker_group_cls

    def run(self, config):
        with mock.patch.object(main_ppo_v0, "RayPPOTrainer", SPORayPPOTrainer):
            return super().run(config)


SPOTaskRunnerV1 = ray.remote(num_cpus=1)(_SPOTaskRunnerV1)
SPOLegacyTaskRunner = ray.remote(num_cpus=1)(_SPOLegacyTaskRunner)


def task_runner_for(config):
    return SPOTaskRunnerV1 if config.trainer.get("use_v1", True) else SPOLegacyTaskRunner
