"""The maths of the gradient measurement (docs/STUDY.md, "Which update is best per generated token"):
how close one estimator's update is to the true gradient of expected reward, after Ilyas et al. (2020).

* The reference gradient of expected reward: many plain samples of a prompt, each response's sequence
  log-probability weighted by its reward less the mean of the *other* rewards (a leave-one-out baseline,
  independent of the response it baselines, so the estimate stays unbiased). :func:`reference_objective`
  is the scalar whose gradient is that estimate, so a model needs one backward pass, not one a response.
* The cosine of two flat gradients, and its correction for the reference's own noise from the agreement
  of two independent halves (:func:`corrected_cosine`; the derivation is in STUDY.md).
* The tokens an estimator needs to match a target cosine (the paired interval over prompts that the
  test reports is :func:`spo_workbench.student_t.paired_interval`, shared with the studies).

Plain tensors and floats only: no framework, so the exact tests can check it on an enumerable policy.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def leave_one_out_weights(rewards: torch.Tensor) -> torch.Tensor:
    """Each reward less the mean of the others: ``r_i - (sum(r) - r_i) / (n - 1)``."""
    rewards = rewards.to(torch.float64)
    n = rewards.numel()
    if n < 2:
        raise ValueError(f"a leave-one-out baseline needs at least 2 rewards, got {n}")
    return rewards - (rewards.sum() - rewards) / (n - 1)


def reference_objective(sequence_log_probs: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """``mean_i w_i log p(y_i)`` with the leave-one-out weights held constant: its gradient is the
    reference estimate of the gradient of expected reward, ``mean_i w_i grad log p(y_i)``."""
    weights = leave_one_out_weights(rewards).to(sequence_log_probs.dtype).detach()
    return (weights * sequence_log_probs).mean()


def reference_gradient(log_prob_gradients: torch.Tensor, rewards: torch.Tensor) -> torch.Tensor:
    """The same estimate from per-response gradients ``(n, parameters)`` (for small models)."""
    weights = leave_one_out_weights(rewards).to(log_prob_gradients.dtype)
    return (weights[:, None] * log_prob_gradients).mean(dim=0)


def cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    """Cosine of two flat vectors in float64; NaN when either is zero (a draw that trained nothing has
    no direction)."""
    a, b = a.reshape(-1).to(torch.float64), b.reshape(-1).to(torch.float64)
    norms = float(a.norm()) * float(b.norm())
    return float(a @ b) / norms if norms > 0 else math.nan


def halves_reliability(halves_cosine: float) -> float:
    """How much of the squared norm of the mean of two halves is signal, from the halves' cosine rho:
    ``2 rho / (1 + rho)`` (the Spearman-Brown step from one half to both)."""
    return 2 * halves_cosine / (1 + halves_cosine)


def corrected_cosine(cosine_with_reference: float, halves_cosine: float) -> float:
    """An estimate of the cosine with the true gradient from the cosine with the mean of two noisy halves:
    ``cos(x, ref) / sqrt(2 rho / (1 + rho))``; NaN unless the halves agree (rho > 0)."""
    if not halves_cosine > 0:
        return math.nan
    return cosine_with_reference / math.sqrt(halves_reliability(halves_cosine))


def draw_alignment(cosine_with_reference: float, halves_cosine: float) -> float | None:
    """What one draw contributes to an estimator's mean: its corrected cosine; 0 for a draw whose update
    is zero (every unit's rewards agreed, so the cosine is undefined: the update moves the policy in no
    direction, the true gradient's included, and its tokens bought nothing); None where the prompt's
    halves do not agree (no reference direction to measure against)."""
    if not halves_cosine > 0:
        return None
    if math.isnan(cosine_with_reference):
        return 0.0
    return corrected_cosine(cosine_with_reference, halves_cosine)


def tokens_to_match(points: Sequence[tuple[float, float]], target: float) -> float | None:
    """The generated tokens at which an estimator's mean cosine first reaches ``target``, interpolated
    linearly in log tokens between its budgets ``(tokens, cosine)``; None when it never does."""
    ordered = sorted(points)
    if ordered and ordered[0][1] >= target:
        return ordered[0][0]
    for (t0, c0), (t1, c1) in zip(ordered, ordered[1:]):
        if c0 < target <= c1:
            share = (target - c0) / (c1 - c0)
            return math.exp(math.log(t0) + share * (math.log(t1) - math.log(t0)))
    return None
