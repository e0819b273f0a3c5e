"""The probability mask and the reference SPO policy loss (docs/FIDELITY.md), in plain torch."""

from __future__ import annotations

from typing import NamedTuple

import torch

from spo_verl.core.config import check_probability

LOG_RATIO_CLAMP = 10.0
WHITEN_EPS = 1e-8
# The reference trains nothing on a micro-batch whose mean ratio over the masked tokens exceeds this.
RATIO_SKIP_THRESHOLD = 10.0


def probability_mask(old_log_probs: torch.Tensor, response_mask: torch.Tensor,
                     threshold: float | None = 0.9) -> torch.Tensor:
    """``response_mask AND p_old < threshold``: the tokens where the sampling policy could have branched.
    ``threshold=None``: no probability mask, every response token (the reference's GRPO, whose loss is
    otherwise SPO's).

    ``old_log_probs`` must come from temperature-scaled logits as verl's actor recomputes
    them (it divides the logits by the rollout temperature).
    """
    if threshold is None:
        return response_mask.bool()
    check_probability("probability mask threshold", threshold)
    return response_mask.bool() & (old_log_probs.exp() < threshold)


def whiten_over_mask(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``(values - mean) / sqrt(var + 1e-8)`` with token-weighted mean and unbiased variance over ``mask``.

    Applied to every position (the caller masks later). Fewer than two masked tokens give a
    variance of 0 instead of the 0/0 of Bessel's correction; no masked token gives zeros. Written
    without branches on the counts, so that it never waits for the GPU.
    """
    mask = mask.to(values.dtype)
    count = mask.sum()
    mean = (values * mask).sum() / count.clamp(min=1.0)
    squared = ((values - mean) ** 2 * mask).sum()
    variance = torch.where(count > 1, squared / (count - 1).clamp(min=1.0), torch.zeros_like(squared))
    whitened = (values - mean) * torch.rsqrt(variance + WHITEN_EPS)
    return torch.where(count > 0, whitened, torch.zeros_like(whitened))


def masked_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """The reference's ratio ``exp(clamp((logp - logp_old) * mask, -10, 10))`` (1 outside the mask)."""
    return torch.clamp((log_prob - old_log_prob) * loss_mask, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP).exp()


def clipped_surrogate(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token PPO-clip loss ``max(-A r, -A clip(r))`` with the reference's masked, clamped ratio.

    Returns the loss matrix and a boolean matrix of tokens where the clipped branch was taken.
    """
    ratio = masked_ratio(log_prob, old_log_prob, loss_mask)
    unclipped = -advantages * ratio
    clipped = -advantages * torch.clamp(ratio, 1.0 - clip_low, 1.0 + clip_high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def ratio_too_high(log_prob: torch.Tensor, old_log_prob: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """Whether the mean ratio over the masked tokens exceeds 10, as a 0-d boolean tensor (no host sync):
    the reference then multiplies the micro-batch's whole loss (policy and KL terms) by 0, so a policy
    far from the sampling one is not trained on. Apply it with :func:`unless_ratio_too_high`."""
    mask = loss_mask.to(log_prob.dtype)
    ratio = masked_ratio(log_prob.detach(), old_log_prob, mask)
    return masked_mean(ratio, mask) > RATIO_SKIP_THRESHOLD


def unless_ratio_too_high(loss: torch.Tensor, too_high: torch.Tensor) -> torch.Tensor:
    """``loss``, or ``loss * 0`` (still in the graph, so backward() runs) where ``too_high``."""
    return loss * (~too_high).to(loss.dtype)


class ReferencePolicyLoss(NamedTuple):
    """The reference's policy term on one micro-batch and what verl's metrics report of it (0-d tensors)."""

    loss: torch.Tensor  # mean over the masked tokens, 0 where the ratio guard skipped the micro-batch
    clipped_fraction: torch.Tensor
    approx_kl: torch.Tensor  # mean of old - new log-prob over the masked tokens
    skipped: torch.Tensor  # bool


def reference_policy_loss(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    token_weights: torch.Tensor | None = None,
) -> ReferencePolicyLoss:
    """The SPO reference's masked PPO-clip: advantages whitened over ``mask`` (the probability mask),
    the clipped surrogate with the masked ratio, its mean over ``mask``, and the high-ratio guard.
    ``token_weights`` multiply the per-token loss (verl's rollout importance weights)."""
    whitened = whiten_over_mask(advantages, mask)
    loss_matrix, clipped = clipped_surrogate(log_prob, old_log_prob, whitened, mask.to(log_prob.dtype),
                                             clip_low, clip_high)
    if token_weights is not None:
        loss_matrix = loss_matrix * token_weights
    skipped = ratio_too_high(log_prob, old_log_prob, mask)
    return ReferencePolicyLoss(
        loss=unless_ratio_too_high(masked_mean(loss_matrix, mask), skipped),
        clipped_fraction=masked_mean(clipped.float(), mask),
        approx_kl=masked_mean(old_log_prob - log_prob.detach(), mask),
        skipped=skipped,
    )


def k3_kl(log_prob: torch.Tensor, ref_log_prob: torch.Tensor) -> torch.Tensor:
    """Per-token k3 estimator ``exp(x) - x - 1`` with ``x = clamp(ref - logp, -10, 10)`` (the reference's
    clamp; verl's ``low_var_kl`` clamps x at 20 and the result at 10, which differs for far-off policies)."""
    x = torch.clamp(ref_log_prob - log_prob, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return x.exp() - x - 1.0


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    mask = mask.to(values.dtype)
    return (values * mask).sum() / mask.sum().clamp(min=1.0)


def reference_kl_term(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """k3 summed over the masked tokens of each sequence, averaged over sequences (no coefficient)."""
    if log_prob.shape[0] == 0:
        return log_prob.sum()
    per_sequence = (k3_kl(log_prob, ref_log_prob) * loss_mask.to(log_prob.dtype)).sum(dim=-1)
    return per_sequence.mean()
