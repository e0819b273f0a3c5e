"""What both SPO trainers do alike in verl's hooks, whichever trainer class they extend: read the run's
settings once, install SPO's actor loss (:func:`install_spo_actor_loss`) and packed forwards on the
workers, hand SPO's step (``step.py``) what it reads of the trainer, and apply the step's result to
the trainer."""

from __future__ import annotations

from collections.abc import Callable, MutableMapping
from functools import partial
from typing import Any

from spo_verl.core.config import SPOSettings
from spo_verl.adapters.policy_loss import LOSS_NAME, spo_ppo_loss
from spo_verl.adapters.settings import spo_settings
from spo_verl.adapters.trainer.batch_view import BatchView
from spo_verl.adapters.trainer.packed_worker import enable_packed_training_on
from spo_verl.adapters.trainer.step import Advantaged, SPOStepResult, spo_step
from spo_verl.adapters.trainer.token_budget import GeneratedTokenBudget


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


def _loss_mode(config: Any) -> str:
    """The actor's ``policy_loss.loss_mode``, verl's ``vanilla`` where the configuration names none."""
    return config.get("actor_rollout_ref", {}).get("actor", {}).get("policy_loss", {}).get("loss_mode", "vanilla")


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

    def run_spo_step(self, view: BatchView,
                     verl_advantage_step: Callable[[], Advantaged]) -> tuple[Advantaged, SPOStepResult]:
        """SPO's step on the batch ``view`` describes, around ``verl_advantage_step``, with what it reads of
        this trainer: the settings, the estimator and loss names (``config``), ``tokenizer``,
        ``global_steps``, ``total_training_steps`` and the token budget."""
        return spo_step(view, verl_advantage_step, settings=self.spo_settings,
                        estimator=self.config.algorithm.adv_estimator, loss_mode=_loss_mode(self.config),
                        tokenizer=self.tokenizer, training_step=self.global_steps,
                        last_training_step=self.total_training_steps, budget=self._token_budget)

    def apply_spo_step(self, result: SPOStepResult, metrics: MutableMapping[str, float]) -> None:
        """The SPO step's metrics into the step's ``metrics``, and the last step the budget chose."""
        metrics.update(result.metrics)
        if result.last_training_step is not None:
            self.total_training_steps = result.last_training_step
