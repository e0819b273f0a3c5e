"""The GPU check's maths: the SPO advantage functions and the probability-masked loss of the
framework-free core (:mod:`spo_verl.core.algorithms`) on the GPU, at the batch sizes of BENCHMARKS.md's
sections 3 and 4 (:mod:`spo_workbench.benchmarks.maths`' batches). No verl import: the estimators are timed
as the core functions the ``spo_chain``/``spo_tree`` estimators call (metadata rows to tensors
included), against the same call with the tensors on the CPU; the loss against the same clipped
surrogate over every response token (what the mask and the reference normalisation add on top).
"""

from __future__ import annotations

import torch

from spo_verl.core.algorithms.batched import chain_token_advantages_batched
from spo_verl.core.algorithms.masked_loss import (
    clipped_surrogate,
    masked_mean,
    probability_mask,
    reference_policy_loss,
)
from spo_verl.core.algorithms.tree_rows import tree_token_advantages
from spo_workbench.benchmarks import maths, tokens
from spo_workbench.benchmarks.gpu_model import measured_call
from spo_workbench.benchmarks.timing import compare

PROMPT_TOKENS = 150  # the training step's lower bound counts a ~150-token prompt per row, as section 3
CLIP = 0.2
MASK_THRESHOLD = 0.9


def chain_call(data: maths.EstimatorBatch, device: torch.device):
    """SPO-chain advantages as the ``spo_chain`` estimator computes them: the rows' segment starts and
    boundary values padded into tensors, then :func:`chain_token_advantages_batched` on ``device``."""
    rewards = data.token_level_rewards.to(device)
    response_mask = data.response_mask.to(device)
    starts_of = [row["segment_starts"] for row in data.rows]
    values_of = [row["boundary_values"] for row in data.rows]

    def call():
        counts = torch.tensor([len(starts) for starts in starts_of])
        valid = torch.arange(int(counts.max()))[None, :] < counts[:, None]
        starts = torch.zeros(valid.shape, dtype=torch.long)
        values = torch.zeros(valid.shape)
        starts[valid] = torch.tensor([s for row in starts_of for s in row])
        values[valid] = torch.tensor([v for row in values_of for v in row], dtype=torch.float32)
        advantages = chain_token_advantages_batched(starts.to(device), values.to(device), counts.to(device),
                                                    rewards.sum(-1).float(), rewards.shape[1])
        return advantages * response_mask

    return call


def tree_call(data: maths.EstimatorBatch, device: torch.device):
    """SPO-tree advantages as the ``spo_tree`` estimator computes them (:func:`tree_token_advantages`)."""
    rewards = data.token_level_rewards.to(device)
    response_mask = data.response_mask.to(device)
    tree_ids = [row["tree_id"] for row in data.rows]
    paths = [row["path"] for row in data.rows]
    ends = [row["segment_ends"] for row in data.rows]
    return lambda: tree_token_advantages(tree_ids, paths, ends, rewards.sum(-1), response_mask,
                                         zero_untrained=True).token_advantages


def masked_loss_call(batch: maths.LossBatch):
    """Forward + backward of the ``spo_prob_mask`` loss in its reference normalisation: the core's
    :func:`reference_policy_loss`, as :func:`spo_verl.adapters.policy_loss.compute_policy_loss_spo_prob_mask`
    calls it, with its metrics read back in one copy as that loss reads them."""

    def call():
        batch.log_prob.grad = None
        mask = probability_mask(batch.old_log_prob, batch.response_mask, MASK_THRESHOLD)
        terms = reference_policy_loss(batch.log_prob, batch.old_log_prob, batch.advantages, mask, CLIP, CLIP)
        terms.loss.backward()
        torch.stack([terms.clipped_fraction, terms.approx_kl, terms.skipped.float()]).tolist()

    return call


def surrogate_call(batch: maths.LossBatch):
    """The same clipped surrogate over every response token: no probability mask, no whitening."""

    def call():
        batch.log_prob.grad = None
        losses, _ = clipped_surrogate(batch.log_prob, batch.old_log_prob, batch.advantages,
                                      batch.response_mask.float(), CLIP, CLIP)
        masked_mean(losses, batch.response_mask).backward()

    return call


def measure(device: torch.device, quick: bool, repeats: int, log) -> list[dict]:
    """CSV rows: each estimator on the CPU (a) against ``device`` (b), and the loss (a) against the
    plain surrogate (b) on ``device``."""
    cpu = torch.device("cpu")
    results = []
    for name, data, build in (("spo_chain", maths.chain_batch(quick), chain_call),
                              ("spo_tree", maths.tree_batch(quick), tree_call)):
        batch, width = data.shape
        trees = len(set(data.index))
        label = (f"{batch} responses x {width} tokens ({maths.CHAIN_PER_PROMPT} per prompt)" if name == "spo_chain"
                 else f"{trees} trees x {batch // trees} leaves x {width} tokens")
        peaks: list[float] = []
        comparison = compare(measured_call(build(data, cpu), cpu, []),
                             measured_call(build(data, device), device, peaks), repeats)
        lower_bound = tokens.step_seconds_lower_bound(int(data.response_mask.sum()) + PROMPT_TOKENS * batch)
        results.append(_row("estimator", name, f"`{name}` advantages (framework-free core), {label}", "cpu",
                            device.type, comparison, repeats, b_peak_gib=max(peaks, default=None),
                            step_lower_bound_s=lower_bound))
        log(f"{name}: {comparison.b_median * 1e3:.1f} ms on {device.type}, {comparison.a_median * 1e3:.1f} ms on cpu")
    loss_batch = maths.loss_batch(quick, device=device)
    batch, width = loss_batch.response_mask.shape
    peaks = []
    comparison = compare(measured_call(masked_loss_call(loss_batch), device, peaks),
                         measured_call(surrogate_call(loss_batch), device, []), repeats)
    results.append(_row("loss", "spo_prob_mask", f"masked policy loss (`spo_prob_mask` reference maths) vs the same "
                        f"clipped surrogate on every response token, {batch} x {width}, forward + backward",
                        "spo_prob_mask", "surrogate", comparison, repeats, a_peak_gib=max(peaks, default=None)))
    log(f"loss: {comparison.a_median * 1e3:.2f} ms vs {comparison.b_median * 1e3:.2f} ms")
    return results


def _row(kind, case, label, a_side, b_side, comparison, repeats, **extra) -> dict:
    return {"kind": kind, "case": case, "label": label, "status": "ok", "a_side": a_side, "b_side": b_side,
            "a_ms": comparison.a_median * 1e3, "b_ms": comparison.b_median * 1e3, "ratio": comparison.ratio,
            "ratio_low": comparison.spread[0], "ratio_high": comparison.spread[1], "rounds": repeats, **extra}
