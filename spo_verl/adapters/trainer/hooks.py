"""What both SPO trainers do alike in verl's hooks, whichever trainer class they extend: read the run's
settings once, install SPO's actor loss and packed forwards on the workers, and count a step's
generated tokens against the budget."""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from functools import partial
from typing import Any

from spo_verl.core.config import SPOSettings
from spo_verl.adapters.policy_loss import LOSS_NAME, spo_ppo_loss
from spo_verl.adapters.settings import spo_settings
from spo_verl.adapters.trainer.packed_worker import enable_packed_training_on
from spo_verl.adapters.trainer.token_budget import GENERATED_TOKENS, GeneratedTokenBudget


def install_spo_actor_loss(actor_worker_group: Any, config: Any) -> bool:
    """Put ``spo_ppo_loss`` (verl's ``ppo_loss`` plus the reference's masked KL) on the actor workers
    when the ``spo_prob_mask`` loss is selected. Returns whether it was installed."""
    if config.actor_rollout_ref.actor.policy_loss.get("loss_mode", "vanilla") != LOSS_NAME:
        return False
    if config.get("distillation", {}).get("enabled", False):
        return False  # verl's distillation loss wraps ppo_loss itself; keep verl's
    from verl.utils.config import omega_conf_to_dataclass

    actor_config = omega_conf_to_dataclass(config.actor_rollout_ref.actor)
    actor_worker_group.set_loss_fn(partial(spo_ppo_loss, config=actor_config))
    return True


class SPOTrainerHooks:
    """Mixed into the SPO trainers ahead of verl's trainer class. ``spo_settings``: the run's
    ``algorithm.spo``, read once when the trainer is built and handed to every SPO step."""

    spo_settings: SPOSettings

    def init_spo_state(self, config: Any) -> None:
        """The run's settings from the trainer's ``config`` and the generated-token count."""
        self.spo_settings = spo_settings(config.algorithm)
        self._token_budget = GeneratedTokenBudget(self.spo_settings.budget.generated_tokens)

    def install_spo_on_workers(self) -> None:
        """SPO's actor loss, and with ``algorithm.spo.packing.enable`` packed forwards, on the built workers."""
        install_spo_actor_loss(self.actor_rollout_wg, self.config)
        enable_packed_training_on([self.actor_rollout_wg, getattr(self, "ref_policy_wg", None)], self.spo_settings)

    def record_spo_step(self, step_metrics: Mapping[str, float], metrics: MutableMapping[str, float]) -> None:
        """The SPO step's metrics into the step's, and its generated tokens against the budget."""
        metrics.update(step_metrics)
        self._token_budget.record(self, step_metrics[GENERATED_TOKENS], metrics)
