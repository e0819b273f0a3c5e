"""verl adapters: the ``spo_prob_mask`` policy loss and its configuration.

``spo_prob_mask`` is PPO-clip restricted to the probability-masked tokens. It works
with any advantage estimator, ``grpo`` included. Its settings are ``algorithm.spo.prob_mask.*``;
the SPO recipe hands them to the actor through ``SPOPolicyLossConfig`` (``policy_loss.spo``), and
without that the paper's defaults apply.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Optional

import torch
from verl.trainer.ppo.core_algos import compute_policy_loss_vanilla, register_policy_loss
from verl.workers.config import PolicyLossConfig
from verl.workers.utils.losses import ppo_loss
from verl.workers.utils.padding import no_padding_2_padding

from spo_verl.core.algorithms.masked_loss import (
    probability_mask,
    ratio_too_high,
    reference_kl_term,
    reference_policy_loss,
    unless_ratio_too_high,
)
from spo_verl.core.config import ProbMaskSettings
from spo_verl.adapters.settings import spo_section_settings

LOSS_NAME = "spo_prob_mask"


@dataclass
class SPOPolicyLossConfig(PolicyLossConfig):
    """verl's ``PolicyLossConfig`` plus ``spo`` (the ``algorithm.spo`` mapping), validated when verl
    builds the actor config, i.e. in the driver's config validation before any worker starts."""

    spo: Optional[dict] = None

    def __post_init__(self):
        spo_section_settings(self.spo)  # refuses a bad setting where the config is built


def prob_mask_settings(actor_config: Any) -> ProbMaskSettings:
    """``algorithm.spo.prob_mask`` as the recipe hands it to the actor (``policy_loss.spo``); the paper's
    defaults without it."""
    policy_loss = actor_config.get("policy_loss", None) if actor_config is not None else None
    return spo_section_settings(policy_loss.get("spo", None) if policy_loss is not None else None).prob_mask


def _micro_batch_share(response_mask: torch.Tensor, global_batch_info: dict) -> torch.Tensor | float:
    """This micro-batch's weight in verl's gradient accumulation: its share of the mini-batch's
    response tokens (times dp_size, which the data-parallel gradient average divides out)."""
    batch_num_tokens = global_batch_info.get("batch_num_tokens")
    if batch_num_tokens is None:
        return 1.0
    if batch_num_tokens == 0:  # nothing to train in the whole mini-batch (e.g. every advantage 0)
        return 0.0
    return response_mask.sum() / batch_num_tokens * global_batch_info.get("dp_size", 1)


@register_policy_loss(LOSS_NAME)
def compute_policy_loss_spo_prob_mask(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    loss_agg_mode: str = "token-mean",
    config: Any = None,
    rollout_is_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, Any]]:
    """PPO-clip on the tokens with ``p_old < algorithm.spo.prob_mask.threshold``.

    ``normalization: reference`` follows the SPO reference per micro-batch (whitened advantages, mean
    over masked-in tokens, loss 0 when the mean ratio over them exceeds 10); ``verl`` is verl's
    ``vanilla`` loss with the advantage of masked-out tokens set to 0.
    """
    settings = prob_mask_settings(config)
    mask = probability_mask(old_log_prob, response_mask, settings.threshold)
    masked_fraction = mask.sum() / response_mask.sum().clamp(min=1)  # the mask lies inside response_mask
    if config.global_batch_info.get("batch_num_tokens") == 0:
        # Nothing to train in the whole mini-batch (e.g. every segment advantage 0): verl's token-mean
        # would divide 0 by 0. A zero loss still connected to the graph keeps backward() valid.
        return (log_prob * 0.0).sum(), {"spo/prob_mask/masked_fraction": masked_fraction.item()}
    if settings.normalization == "verl":
        # Zero advantage outside the mask, keep verl's loss mask: the masked-out tokens add nothing to
        # the sum and verl's aggregation keeps its own denominator (the global response-token count).
        loss, vanilla_metrics = compute_policy_loss_vanilla(
            old_log_prob, log_prob, advantages.masked_fill(~mask, 0.0), response_mask, loss_agg_mode, config,
            rollout_is_weights
        )
        return loss, {**vanilla_metrics, "spo/prob_mask/masked_fraction": masked_fraction.item()}

    clip_low = config.clip_ratio_low if config.clip_ratio_low is not None else config.clip_ratio
    clip_high = config.clip_ratio_high if config.clip_ratio_high is not None else config.clip_ratio
    terms = reference_policy_loss(log_prob, old_log_prob, advantages, mask, clip_low, clip_high, rollout_is_weights)
    loss = terms.loss * _micro_batch_share(response_mask, config.global_batch_info)
    # One device-to-host copy for every metric: each .item() would wait for the GPU on its own.
    values = torch.stack([masked_fraction, terms.clipped_fraction, terms.approx_kl.float(), terms.skipped.float()])
    masked_fraction, clipped_fraction, approx_kl, skipped = values.tolist()
    return loss, {
        "spo/prob_mask/masked_fraction": masked_fraction,
        "actor/pg_clipfrac": clipped_fraction,
        "actor/ppo_kl": approx_kl,
        "spo/prob_mask/high_ratio_skipped": skipped,
    }


def _without_kl_loss(config: Any) -> Any:
    # ActorConfig is frozen; a shallow copy keeps the shared global_batch_info that ppo_loss fills.
    quiet = copy.copy(config)
    object.__setattr__(quiet, "use_kl_loss", False)
    return quiet


def spo_ppo_loss(config: Any, model_output: dict, data: Any, dp_group=None):
    """verl's actor loss (``verl.workers.utils.losses.ppo_loss``) with the reference's masked KL.

    With ``spo_prob_mask`` in ``reference`` normalisation and ``actor.use_kl_loss`` on, the KL to the
    reference model is k3 summed over the probability-masked tokens of each sequence and averaged
    over sequences, times ``actor.kl_loss_coef``; everything else is verl's ``ppo_loss``.
    The SPO trainer installs this on the actor workers with ``set_loss_fn``.
    """
    loss_mode = config.policy_loss.get("loss_mode", "vanilla")
    settings = prob_mask_settings(config)
    if loss_mode != LOSS_NAME or settings.normalization != "reference" or not config.use_kl_loss:
        return ppo_loss(config, model_output, data, dp_group)
    log_prob = no_padding_2_padding(model_output["log_probs"], data)
    padded = data.select("response_mask", "old_log_probs", "ref_log_prob").to_padded_tensor()
    loss, metrics = ppo_loss(_without_kl_loss(config), model_output, data, dp_group)
    response_mask = padded["response_mask"].bool()
    mask = probability_mask(padded["old_log_probs"], response_mask, settings.threshold)
    kl = reference_kl_term(log_prob, padded["ref_log_prob"], mask)
    loss = loss + config.kl_loss_coef * kl * _micro_batch_share(response_mask, config.global_batch_info)
    # The reference drops the KL term with the policy term.
    loss = unless_ratio_too_high(loss, ratio_too_high(log_prob, padded["old_log_probs"], mask))
    metrics["kl_loss"] = kl.detach().item()
    metrics["kl_coef"] = config.kl_loss_coef
    return loss, metrics
