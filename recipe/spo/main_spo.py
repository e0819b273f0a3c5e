"""Entry point of the SPO recipe: ``python -m recipe.spo.main_spo [hydra overrides]`` from the repo root.

Composes verl 0.9.1's ``ppo_trainer`` configuration with ``config/spo_trainer.yaml``, validates the
SPO settings and verl's own settings before anything starts, then runs verl's ``run_ppo`` with a
TaskRunner that trains with SPO (default v1 trainer, or the legacy one with ``trainer.use_v1=false``),
once more if Ray itself timed out starting.
"""

import hydra
from verl.trainer.main_ppo import run_ppo
from verl.trainer.ppo.utils import need_critic, need_reference_policy
from verl.utils.config import validate_config
from verl.utils.device import auto_set_device

from spo_verl.trainer.runners import run_with_one_restart, task_runner_for
from spo_verl.trainer.validation import validate_spo_run


@hydra.main(config_path="config", config_name="spo_trainer", version_base=None)
def main(config):
    auto_set_device(config)
    validate_spo_run(config)
    validate_config(config=config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config))
    run_with_one_restart(run_ppo, config, task_runner_for(config))


if __name__ == "__main__":
    main()
