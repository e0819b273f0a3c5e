"""Configuration-time checks of an SPO run, before Ray or any GPU is touched."""

from __future__ import annotations

from typing import Any

from verl.experimental.agent_loop.agent_loop import _agent_loop_registry

import spo_verl.register  # noqa: F401  (agent loops registered before they are looked up)
from spo_verl.agent_loops.tree_agent_loop import check_tree_fits
from spo_verl.config import parse_spo_settings, tree_segment_budgets
from spo_verl.trainer.common import SPO_AGENT_LOOPS, SPO_ESTIMATORS
from spo_verl.trainer.v1 import TRAINER_MODE


def validate_spo_run(config: Any) -> None:
    """Raise ``ValueError`` naming the setting to change if the configuration cannot run SPO."""
    settings = parse_spo_settings(config.algorithm.get("spo"))
    estimator = config.algorithm.adv_estimator
    rollout = config.actor_rollout_ref.rollout
    agent_loop = rollout.agent.default_agent_loop
    if agent_loop not in _agent_loop_registry:
        raise ValueError(
            f"actor_rollout_ref.rollout.agent.default_agent_loop={agent_loop} is not a registered agent loop; "
            f"registered: {sorted(_agent_loop_registry)}"
        )
    if estimator in SPO_ESTIMATORS:
        if agent_loop != estimator:
            raise ValueError(
                f"algorithm.adv_estimator={estimator} needs actor_rollout_ref.rollout.agent.default_agent_loop="
                f"{estimator} (got {agent_loop}): only that agent loop produces the segment metadata"
            )
        if config.trainer.get("use_v1", True) and config.trainer.v1.trainer_mode != TRAINER_MODE:
            raise ValueError(
                f"algorithm.adv_estimator={estimator} needs trainer.v1.trainer_mode={TRAINER_MODE} (got "
                f"{config.trainer.v1.trainer_mode}): that trainer hands the segment metadata to the estimator"
            )
    if agent_loop in SPO_AGENT_LOOPS and not config.trainer.get("use_v1", True):
        # verl's legacy agent-loop manager splits the repeated batch into num_workers equal chunks; a
        # prompt's sessions (one tree, or one shared Monte Carlo cache) must land in one chunk.
        prompts = config.data.get("gen_batch_size", None) or config.data.train_batch_size
        workers = rollout.agent.num_workers
        if prompts % workers:
            raise ValueError(
                f"actor_rollout_ref.rollout.agent.default_agent_loop={agent_loop} on the legacy trainer needs "
                f"data.train_batch_size ({prompts}) to be a multiple of actor_rollout_ref.rollout.agent.num_workers "
                f"({workers}): verl splits each batch into that many equal chunks and a prompt's sessions must stay in one"
            )
    if estimator == "spo_tree":
        check_tree_fits(settings.tree.branching, tree_segment_budgets(settings.tree), rollout.response_length, rollout.n)

