"""No-model benchmarks: advantage estimation at cluster size and the policy loss.

* Estimators through verl's own registry (``get_adv_estimator_fn``) on the same tensors: verl's
  ``grpo`` against ``spo_chain`` (512 responses x 4096 tokens, 8 per prompt) and ``spo_tree`` (32
  trees of 216 leaves x 1536 tokens); the SPO estimators get their rows as the SPO trainer hands
  them over (``provide_spo_rows``).
* The batched tensor functions against the plain-Python references they must agree with (chains
  of 1024 tokens; forests of 6-6-6 trees).
* The loss through verl's registry (``get_policy_loss_fn``): ``spo_prob_mask`` in both
  normalisations against verl's ``vanilla``, forward and backward on the same tensors.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

CHAIN_BATCH = {"full": (512, 4096), "quick": (32, 256)}
CHAIN_PER_PROMPT = 8
TREE_BATCH = {"full": (32, (6, 6, 6), 1536), "quick": (2, (3, 3, 3), 96)}
REFERENCE_CHAINS = {"full": ((512, 1024), (2048, 1024)), "quick": ((64, 128),)}
REFERENCE_FORESTS = {"full": (8, 32), "quick": (2,)}
LOSS_BATCH = {"full": (64, 4096), "quick": (8, 128)}


def _size(table: dict, quick: bool):
    return table["quick" if quick else "full"]


# ------------------------------------------------------------------------------------------------
# Batches
# ------------------------------------------------------------------------------------------------


@dataclass
class EstimatorBatch:
    token_level_rewards: torch.Tensor
    response_mask: torch.Tensor
    index: np.ndarray
    rows: list[dict]

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.response_mask.shape)


def _rewarded(lengths: list[int], width: int, rng: random.Random) -> tuple[torch.Tensor, torch.Tensor]:
    batch = len(lengths)
    response_mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).float()
    rewards = torch.zeros(batch, width)
    rewards[torch.arange(batch), torch.tensor(lengths) - 1] = torch.tensor([float(rng.random() < 0.5) for _ in lengths])
    return rewards, response_mask


def chain_batch(quick: bool, seed: int = 0) -> EstimatorBatch:
    """Responses of 1/4 to all of the width, each with 1-64 segments at random cutpoints (int5 on a
    4K response gives tens of them) and MC values in steps of 1/9."""
    batch, width = _size(CHAIN_BATCH, quick)
    rng = random.Random(seed)
    lengths = [rng.randint(width // 4, width) for _ in range(batch)]
    rewards, response_mask = _rewarded(lengths, width, rng)
    rows = []
    for length in lengths:
        starts = sorted(rng.sample(range(length), rng.randint(1, min(64, length))))
        rows.append({"segment_starts": starts, "boundary_values": [rng.randint(0, 9) / 9 for _ in starts],
                     "truncated": False})
    index = np.array([f"p{b // CHAIN_PER_PROMPT}" for b in range(batch)], dtype=object)
    return EstimatorBatch(rewards, response_mask, index, rows)


def tree_batch(quick: bool, seed: int = 0) -> EstimatorBatch:
    """One row per leaf of full trees; depths above the last take ``width / depth`` tokens, the last
    depth ends at a random length (EOS) within the rest."""
    trees, branching, width = _size(TREE_BATCH, quick)
    rng = random.Random(seed)
    segment = width // len(branching)
    lengths, rows, index = [], [], []
    for tree in range(trees):
        leaves = 1
        for children in branching:
            leaves *= children
        for leaf in range(leaves):
            path, digits, below = [], leaf, leaves
            node = 0
            for children in branching:
                below //= children
                node = node * children + digits // below + 1
                digits %= below
                path.append(node)
            ends = [segment * (d + 1) for d in range(len(branching) - 1)]
            ends.append(ends[-1] + rng.randint(1, width - ends[-1]) if ends else rng.randint(1, width))
            lengths.append(ends[-1])
            rows.append({"tree_id": f"t{tree}", "path": path, "segment_ends": ends, "truncated": False})
            index.append(f"t{tree}")
    rewards, response_mask = _rewarded(lengths, width, rng)
    return EstimatorBatch(rewards, response_mask, np.array(index, dtype=object), rows)


# ------------------------------------------------------------------------------------------------
# Estimators through verl's registry
# ------------------------------------------------------------------------------------------------


def estimator_call(name: str, data: EstimatorBatch):
    """A zero-argument call of verl's registered estimator ``name`` on ``data`` as verl's
    ``compute_advantage`` makes it (``grpo`` with its std normalisation on, verl's default)."""
    from omegaconf import OmegaConf
    from verl.trainer.ppo.core_algos import get_adv_estimator_fn

    import spo_verl.register  # noqa: F401
    from spo_verl.adapters.advantage_channel import provide_spo_rows

    config = OmegaConf.create({"adv_estimator": name, "norm_adv_by_std_in_grpo": True, "spo": {}})
    fn = get_adv_estimator_fn(name)
    if name == "grpo":
        return lambda: fn(token_level_rewards=data.token_level_rewards, response_mask=data.response_mask,
                          index=data.index, norm_adv_by_std_in_grpo=True, config=config)

    def call():
        with provide_spo_rows(data.rows):
            return fn(token_level_rewards=data.token_level_rewards, response_mask=data.response_mask,
                      index=data.index, config=config)

    return call


# ------------------------------------------------------------------------------------------------
# Batched functions against their plain-Python references
# ------------------------------------------------------------------------------------------------


def reference_chain_calls(batch: int, length: int, seed: int = 1):
    """The plain reference row by row, as a caller would, against the batched function on tensors."""
    from spo_verl.core.algorithms import chain_token_advantages, chain_token_advantages_batched

    rng = random.Random(seed)
    starts = [sorted(rng.sample(range(length), 8)) for _ in range(batch)]
    values = [[rng.random() for _ in range(8)] for _ in range(batch)]
    rewards = [float(rng.random() < 0.5) for _ in range(batch)]
    start_tensor = torch.tensor(starts)
    value_tensor = torch.tensor(values, dtype=torch.float64)
    counts, reward_tensor = torch.full((batch,), 8), torch.tensor(rewards, dtype=torch.float64)

    def reference():
        return [chain_token_advantages(length, starts[b], values[b], rewards[b]) for b in range(batch)]

    def batched():
        return chain_token_advantages_batched(start_tensor, value_tensor, counts, reward_tensor, length)

    if batched().tolist() != reference():
        raise AssertionError("batched chain advantages differ from the reference")
    return reference, batched


def _forest(trees: int, branching=(6, 6, 6), seed: int = 0):
    rng = random.Random(seed)
    parents, rewards = [], {}
    for _ in range(trees):
        root = len(parents)
        parents.append(-1)
        frontier = [root]
        for width in branching:
            next_frontier = []
            for node in frontier:
                for _ in range(width):
                    parents.append(node)
                    next_frontier.append(len(parents) - 1)
            frontier = next_frontier
        for leaf in frontier:
            rewards[leaf] = float(rng.random() < 0.5)
    return parents, rewards


def reference_tree_calls(trees: int):
    from spo_verl.core.algorithms import (tree_node_advantages, tree_node_advantages_batched, tree_values,
                                          tree_values_batched)

    parents, rewards = _forest(trees)
    size = len(parents) // trees
    one_tree = parents[:size]
    one_rewards = {n: r for n, r in rewards.items() if n < size}

    def reference():
        return [tree_node_advantages(one_tree, tree_values(one_tree, one_rewards)) for _ in range(trees)]

    parent_tensor = torch.tensor(parents)
    leaf_rewards = torch.zeros(len(parents), dtype=torch.float64)
    leaf_rewards[list(rewards)] = torch.tensor(list(rewards.values()), dtype=torch.float64)

    def batched():
        return tree_node_advantages_batched(parent_tensor, tree_values_batched(parent_tensor, leaf_rewards))

    return reference, batched, len(parents)


# ------------------------------------------------------------------------------------------------
# The loss through verl's registry
# ------------------------------------------------------------------------------------------------


@dataclass
class LossBatch:
    old_log_prob: torch.Tensor
    log_prob: torch.Tensor  # a leaf that requires grad
    advantages: torch.Tensor
    response_mask: torch.Tensor  # bool


def loss_batch(quick: bool, seed: int = 0, device: str | torch.device = "cpu") -> LossBatch:
    """One micro-batch of responses (1/4 to all of the width valid), about half of the tokens below
    the probability mask's p = 0.9; drawn on the CPU (the same numbers on every device)."""
    batch, width = _size(LOSS_BATCH, quick)
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(width // 4, width + 1, (batch,), generator=generator)
    response_mask = torch.arange(width)[None, :] < lengths[:, None]
    old_log_prob = -torch.rand(batch, width, generator=generator) ** 2 * 3  # p from 0.05 to 1: ~half below 0.9
    log_prob = old_log_prob + 0.05 * torch.randn(batch, width, generator=generator)
    advantages = torch.randn(batch, 1, generator=generator).expand(batch, width).contiguous()
    return LossBatch(old_log_prob.to(device), log_prob.to(device).requires_grad_(True), advantages.to(device),
                     response_mask.to(device))


def loss_call(name: str, quick: bool, seed: int = 0):
    """Forward and backward of verl's registered loss on one micro-batch: ``vanilla``,
    ``spo_prob_mask:reference`` or ``spo_prob_mask:verl``. Same tensors for every name."""
    from verl.trainer.ppo.core_algos import get_policy_loss_fn
    from verl.workers.config import ActorConfig, PolicyLossConfig

    import spo_verl.register  # noqa: F401
    from spo_verl.adapters.policy_loss import SPOPolicyLossConfig

    batch, width = _size(LOSS_BATCH, quick)
    inputs = loss_batch(quick, seed)
    old_log_prob, log_prob, advantages, response_mask = (inputs.old_log_prob, inputs.log_prob, inputs.advantages,
                                                         inputs.response_mask)
    loss_mode, _, normalization = name.partition(":")
    policy_loss = (SPOPolicyLossConfig(loss_mode=loss_mode, spo={"prob_mask": {"normalization": normalization}})
                   if normalization else PolicyLossConfig(loss_mode=loss_mode))
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=batch, clip_ratio=0.2,
                         loss_agg_mode="token-mean", policy_loss=policy_loss)
    config.global_batch_info.update({"dp_size": 1, "batch_num_tokens": int(response_mask.sum()),
                                     "global_batch_size": batch})
    fn = get_policy_loss_fn(loss_mode)

    def call():
        log_prob.grad = None
        loss, _ = fn(old_log_prob=old_log_prob, log_prob=log_prob, advantages=advantages,
                     response_mask=response_mask, loss_agg_mode="token-mean", config=config, rollout_is_weights=None)
        loss.backward()
        return loss

    return call


LOSS_NAMES = ("vanilla", "spo_prob_mask:reference", "spo_prob_mask:verl")


def memory_case(case: str, quick: bool):
    """Builder of a memory case for :func:`spo_workbench.benchmarks.timing.measure_memory_case`."""
    kind, _, name = case.partition("/")
    if kind == "estimator-chain":
        return lambda: estimator_call(name, chain_batch(quick))
    if kind == "estimator-tree":
        return lambda: estimator_call(name, tree_batch(quick))
    if kind == "loss":
        return lambda: loss_call(name, quick)
    raise ValueError(f"unknown memory case {case!r}")


MEMORY_CASES = (
    [f"estimator-chain/{name}" for name in ("grpo", "spo_chain")]
    + [f"estimator-tree/{name}" for name in ("grpo", "spo_tree")]
    + [f"loss/{name}" for name in LOSS_NAMES]
)
