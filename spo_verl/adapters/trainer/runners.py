"""verl TaskRunners that train with SPO; ``run_ppo(config, task_runner_class=...)`` starts them.

Importing this module installs SPO's names in verl (``spo_verl.adapters.registration``) in the process
that imports it, the one Ray starts for a runner included. Both runners subclass verl's own. The v1
runner only makes sure the ``spo`` trainer mode is registered in the TaskRunner process (verl looks the
mode up there). verl's legacy ``TaskRunner.run`` builds
``RayPPOTrainer`` by name, with no way to pass another class; the legacy runner's ``run`` takes the
same steps with verl's own functions (worker roles, config validation, tokenizer, resource pools,
datasets, sampler) and builds ``SPORayPPOTrainer`` instead, and with packed training its
``add_actor_rollout_worker`` puts the packed worker in the role mapping.
"""

from __future__ import annotations

import os

import ray
from omegaconf import OmegaConf
from verl.trainer import main_ppo_v0
from verl.trainer.main_ppo import TaskRunnerV1

from spo_verl.adapters import registration

# SPO's estimators, loss and agent loops in this process (the one Ray starts for a runner too, where
# verl's plugins may be turned off), before the trainers below import their verl modules.
registration.install()

from spo_verl.adapters.trainer import v1  # noqa: E402, F401  (registers the 'spo' trainer mode)
from spo_verl.adapters.trainer.legacy import SPORayPPOTrainer  # noqa: E402
from spo_verl.adapters.settings import spo_settings  # noqa: E402
from spo_verl.adapters.trainer.packed_worker import SPOActorRolloutRefWorker, use_packed_worker  # noqa: E402


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
        if use_packed_worker(self.role_worker_mapping, spo_settings(config.algorithm)):
            actor_rollout_cls = SPOActorRolloutRefWorker
        return actor_rollout_cls, worker_group_cls

    def run(self, config):
        from pprint import pprint

        from verl.utils.config import omega_conf_to_dataclass
        from verl.utils.dataset.rl_dataset import collate_fn

        pprint(OmegaConf.to_container(config, resolve=True))  # as verl's run prints it
        OmegaConf.resolve(config)
        actor_rollout_cls, worker_group_cls = self.add_actor_rollout_worker(config)
        self.add_critic_worker(config)
        self.add_reward_model_resource_pool(config)
        self.add_teacher_model_resource_pool(config)
        self.add_ref_policy_worker(config, actor_rollout_cls)
        main_ppo_v0.validate_config(config=config, use_reference_policy=main_ppo_v0.need_reference_policy(config),
                                    use_critic=main_ppo_v0.need_critic(config))
        model_config = omega_conf_to_dataclass(config.actor_rollout_ref.model)
        tokenizer, processor = model_config.tokenizer, model_config.processor
        datasets = {
            split: main_ppo_v0.create_rl_dataset(files, config.data, tokenizer, processor, is_train=split == "train",
                                                 max_samples=config.data.get(f"{split}_max_samples", -1))
            for split, files in (("train", config.data.train_files), ("val", config.data.val_files))
        }
        trainer = SPORayPPOTrainer(
            config=config, tokenizer=tokenizer, processor=processor, role_worker_mapping=self.role_worker_mapping,
            resource_pool_manager=self.init_resource_pool_mgr(config), ray_worker_group_cls=worker_group_cls,
            train_dataset=datasets["train"], val_dataset=datasets["val"], collate_fn=collate_fn,
            train_sampler=main_ppo_v0.create_rl_sampler(config.data, datasets["train"]),
        )
        trainer.init_workers()
        trainer.fit()


SPOTaskRunnerV1 = ray.remote(num_cpus=1)(_SPOTaskRunnerV1)
SPOLegacyTaskRunner = ray.remote(num_cpus=1)(_SPOLegacyTaskRunner)


def task_runner_for(config):
    return SPOTaskRunnerV1 if config.trainer.get("use_v1", True) else SPOLegacyTaskRunner


# Ray's raylet must register with its GCS within a fixed 30 s (``ray._private.node``); on a machine whose
# cores are all busy (several CPU runs at once) it sometimes does not, before anything of the run started.
RAY_STARTUP_TIMEOUT = "timed out during startup"


def run_with_one_restart(run, config, task_runner_class) -> None:
    """``run(config, task_runner_class=...)`` (verl's ``run_ppo``), started once more if Ray itself timed
    out during its start-up: nothing of the run had started, so a second start is safe once the first
    start's processes are stopped."""
    already_running = {process.pid for process in _ray_processes()}
    try:
        run(config, task_runner_class=task_runner_class)
    except Exception as error:
        if RAY_STARTUP_TIMEOUT not in str(error) or ray.is_initialized():
            raise
        stopped = _stop([process for process in _ray_processes() if process.pid not in already_running])
        print(f"spo: Ray did not start in time ({error}); stopped the {stopped} process(es) it had started; "
              f"starting it once more", flush=True)
        run(config, task_runner_class=task_runner_class)


def _ray_processes() -> list:
    """The processes below this one that run Ray's own programs (its GCS, raylet, reaper and monitors),
    found by a path inside the ``ray`` package on their command line. A ``ray.init`` that timed out
    leaves them running until this process exits, and a second start beside them would compete with
    them for the same busy cores."""
    import psutil

    ray_dir = os.path.dirname(os.path.abspath(ray.__file__)) + os.sep
    found = []
    for process in psutil.Process().children(recursive=True):
        try:
            if any(ray_dir in argument for argument in process.cmdline()):
                found.append(process)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _stop(processes: list, grace_s: float = 10.0) -> int:
    """Terminate ``processes``, kill those still alive after ``grace_s``; returns how many."""
    import psutil

    for process in processes:
        try:
            process.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(processes, timeout=grace_s)
    for process in alive:
        try:
            process.kill()
        except psutil.NoSuchProcess:
            pass
    return len(processes)
