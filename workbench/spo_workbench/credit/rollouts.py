"""The rollouts the credit measures read: SPO trees sampled by the ``spo_tree`` agent loop and SPO chains by
the ``spo_chain`` agent loop on verl's vLLM server, every response scored by verl's GSM8K reward, and on
the same responses the advantages that SPO-tree or SPO-chain (verl's advantage step with the rollouts'
metadata, as the trainers call it), SPO-tree with each value pooled over identical prefixes, and verl's
GRPO (grouped by prompt, normalised by the group's standard deviation, as verl's default) hand the loss.

For SPO-tree each token carries its segment's advantage (a segment shared by several leaves carries it
in each of them; ``trained`` marks the row that trains it, as the trainer does), so a response reads as
the estimator placed its credit; ``in_loss`` is the probability mask the loss applies (the rollout's
probability of the token below the threshold).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from spo_verl.core.credit.blame import Response


@dataclass(frozen=True)
class TreeSetup:
    """An SPO-tree configuration to measure (``algorithm.spo.tree``)."""

    name: str
    branching: tuple[int, ...]
    segment_tokens: tuple[int, ...]
    branch_at: str = "fixed"
    cutpoint: tuple[str, ...] = ()  # algorithm.spo.tree.cutpoint.* settings, "key=value"

    def overrides(self) -> list[str]:
        tree = "algorithm.spo.tree"
        return [f"+{tree}.branching={list(self.branching)}", f"+{tree}.segment_tokens={list(self.segment_tokens)}",
                f"+{tree}.branch_at={self.branch_at}", *(f"+{tree}.cutpoint.{setting}" for setting in self.cutpoint)]

    def leaf_slots(self) -> int:
        from spo_verl.core.rollout.tree_shape import leaf_slots

        section = {"branching": list(self.branching), "segment_tokens": list(self.segment_tokens),
                   "branch_at": self.branch_at,
                   "cutpoint": {k: int(v) if v.isdigit() else float(v)
                                for k, v in (setting.split("=", 1) for setting in self.cutpoint)}}
        return leaf_slots(section)


@dataclass(frozen=True)
class ChainSetup:
    """An SPO-chain configuration to measure (``algorithm.spo.chain``): ``responses`` a prompt
    (``rollout.n``), cut at cutpoints every ``cutpoint_interval`` tokens, each boundary valued by
    ``mc_samples`` continuations."""

    name: str
    responses: int
    cutpoint_interval: int
    mc_samples: int

    def overrides(self) -> list[str]:
        chain = "algorithm.spo.chain"
        return [f"+{chain}.partition=cutpoint", f"+{chain}.cutpoint_interval={self.cutpoint_interval}",
                f"+{chain}.mc_samples={self.mc_samples}"]

    def leaf_slots(self) -> int:
        return self.responses


#: A quarter of each horizon task's mean answer in tokens (docs/RESULTS.md's calibration: 29, 42, 53, 77):
#: the paper's 600-token segments of much longer answers, scaled to these tasks.
QUARTER_ANSWER_TOKENS = {"steps2": 7, "steps3": 10, "steps4": 13, "steps5": 19}


def paper_tree(task: str) -> TreeSetup:
    """The paper's SPO-tree, 6-6-6, its two first segments a quarter of ``task``'s mean answer each."""
    quarter = QUARTER_ANSWER_TOKENS[task]
    return TreeSetup("6_6_6", (6, 6, 6), (quarter, quarter))


#: The paper's SPO-chain: cutpoints every 5th low-probability token ("int5"), each boundary valued by 9
#: Monte Carlo continuations; 4 chains a prompt.
PAPER_CHAIN = ChainSetup("int5_mc9", 4, 5, 9)


def rollout_config(model_dir: str, setup: TreeSetup | ChainSetup, prompt_length: int, response_length: int):
    """verl's trainer configuration of an SPO-tree or SPO-chain rollout of ``setup`` (what the agent
    loop reads)."""
    from spo_workbench.testing.verl_harness import compose_ppo_trainer

    return compose_ppo_trainer(
        f"actor_rollout_ref.model.path={model_dir}",
        f"actor_rollout_ref.rollout.n={setup.leaf_slots()}",
        f"actor_rollout_ref.rollout.prompt_length={prompt_length}",
        f"actor_rollout_ref.rollout.response_length={response_length}",
        f"actor_rollout_ref.rollout.agent.default_agent_loop={'spo_chain' if isinstance(setup, ChainSetup) else 'spo_tree'}",
        *setup.overrides(),
    )


SAMPLING = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "repetition_penalty": 1.0, "logprobs": True}


@dataclass
class Leaf:
    uid: str
    output: object  # verl's AgentLoopOutput
    score: float


def gsm8k_score(text: str, truth: str) -> float:
    """verl's GSM8K reward, as the CPU settings' runs score a response."""
    from verl.utils.reward_score.gsm8k import compute_score

    return float(compute_score(text, truth))


GSM8K_SOURCE = "openai/gsm8k"  # the data_source verl's default reward scores with its GSM8K scorer


async def sample_rollouts(config, server, tokenizer, problems: Sequence[tuple[str, list[dict], str]],
                          score=gsm8k_score) -> list[Leaf]:
    """One tree (or ``rollout.n`` chains) per problem ``(uid, chat messages, ground truth)``, by the
    agent loop ``config`` names, every response scored by ``score(decoded response, ground truth)``.
    The chain loop scores its Monte Carlo continuations itself, by verl's reward for the row's
    ``data_source`` (GSM8K's, the same scorer)."""
    import asyncio

    from spo_verl.adapters.agent_loops.chain_agent_loop import SPOChainAgentLoop
    from spo_verl.adapters.agent_loops.tree_agent_loop import SPOTreeAgentLoop
    from spo_workbench.testing.verl_harness import run_sessions

    loop = SPOChainAgentLoop if config.actor_rollout_ref.rollout.agent.default_agent_loop == "spo_chain" else SPOTreeAgentLoop

    async def one(uid, messages, truth):
        outputs = await run_sessions(loop, config, server, tokenizer, uid, messages, sampling_params=SAMPLING,
                                     data_source=GSM8K_SOURCE, reward_model={"ground_truth": truth})
        return [Leaf(uid, out, score(tokenizer.decode(out.response_ids, skip_special_tokens=True), truth))
                for out in outputs if out != []]

    groups = await asyncio.gather(*(one(*problem) for problem in problems))
    return [leaf for group in groups for leaf in group]


def _verl_advantages(leaves: list[Leaf], estimator: str, config, rows=None, settings=None):
    """verl's ``compute_advantage`` over the leaves (one row each, the score on the last token);
    returns the advantages (B, T) and, for SPO-tree, the batch context the estimator filled.
    ``settings``: the SPO settings the estimator reads instead of the config's ``algorithm.spo``."""
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import compute_advantage

    from spo_verl.adapters.advantage_channel import provide_spo_rows

    width = max(len(leaf.output.response_ids) for leaf in leaves)
    mask = torch.zeros(len(leaves), width)
    rewards = torch.zeros(len(leaves), width)
    for row, leaf in enumerate(leaves):
        mask[row, : len(leaf.output.response_ids)] = 1
        rewards[row, len(leaf.output.response_ids) - 1] = leaf.score
    data = DataProto.from_dict(tensors={"token_level_rewards": rewards, "response_mask": mask},
                               non_tensors={"uid": np.array([leaf.uid for leaf in leaves], dtype=object)})
    if rows is None:
        return compute_advantage(data, estimator, config=config.algorithm).batch["advantages"], None
    with provide_spo_rows(rows, settings) as context:
        advantages = compute_advantage(data, estimator, config=config.algorithm).batch["advantages"]
    return advantages, context


def pooled_segment_values(leaves: list[Leaf], rewards: list[float], i: int, ends: list[int]) -> list[float]:
    """V before and after each segment of leaf ``i``, each the mean reward of every leaf of its tree
    that shares the prefix token for token (sibling nodes that wrote the same tokens then estimate one
    value, from all their leaves)."""
    ids = list(leaves[i].output.response_ids)
    group = [j for j, leaf in enumerate(leaves) if leaf.uid == leaves[i].uid]
    values = []
    for end in [0, *ends]:
        sharing = [rewards[j] for j in group if list(leaves[j].output.response_ids[:end]) == ids[:end]]
        values.append(sum(sharing) / len(sharing))
    return values


def _response_fields(leaf: Leaf, i: int, tokenizer, threshold: float, locate) -> dict:
    """What every estimator's view of response ``i`` shares: its tokens, reward, the probability mask
    (the rollout's probability of each token below ``threshold``) and its first wrong token."""
    from spo_verl.core.algorithms.masked_loss import probability_mask

    ids = list(leaf.output.response_ids)
    log_probs = torch.tensor(leaf.output.response_logprobs[: len(ids)], dtype=torch.float32)
    in_loss = probability_mask(log_probs, torch.ones(len(ids)), threshold).bool().tolist()
    texts = [tokenizer.decode([token]) for token in ids]
    return dict(prompt_uid=leaf.uid, response_id=f"{leaf.uid}-{i}", reward=leaf.score, tokens=tuple(ids),
                in_loss=tuple(in_loss), first_error=locate(leaf.uid, texts, leaf.score))


def weighted_view(segment_weight: str) -> str:
    """The view of a tree's leaves under ``algorithm.spo.tree.segment_weight`` (``spo_tree``: the paper's)."""
    return "spo_tree" if segment_weight == "segment" else f"spo_tree_{segment_weight}"


def tree_and_grpo_responses(leaves: list[Leaf], config, tokenizer, threshold: float,
                            locate, segment_weights: Sequence[str] = ()) -> dict[str, list[Response]]:
    """Views of the same leaves, by estimator: ``spo_tree`` (verl's advantage step with the trees'
    metadata), ``spo_tree_pooled`` (the same segments, each value pooled over identical prefixes:
    :func:`pooled_segment_values`), ``grpo`` (verl's) and, for each of ``segment_weights`` but
    ``segment``, :func:`weighted_view` (the estimator's advantages and trained mask under that
    ``algorithm.spo.tree.segment_weight``, the same values and advantages weighted otherwise).
    ``locate(uid, tokens, score)``: the first wrong token of a response given its tokens' texts (None
    for a right or unplaced one)."""
    import dataclasses

    from spo_verl.adapters.settings import spo_settings

    from spo_verl.core.algorithms.tree_rows import build_forest

    rows = [leaf.output.extra_fields["spo"] for leaf in leaves]
    _, context = _verl_advantages(leaves, "spo_tree", config, rows)
    grpo_advantages, _ = _verl_advantages(leaves, "grpo", config)
    nodes = context.tree_nodes
    forest = build_forest(nodes.tree_ids, nodes.paths)
    # The leaf rewards the tree estimator used: a response cut by the length limit scores 0.
    rewards = [0.0 if row["truncated"] else leaf.score for row, leaf in zip(rows, leaves)]
    views: dict[str, list[Response]] = {"spo_tree": [], "spo_tree_pooled": [], "grpo": []}
    settings = spo_settings(config.algorithm)
    weighted = {}
    for weight in dict.fromkeys(w for w in segment_weights if w != "segment"):
        changed = dataclasses.replace(settings, tree=dataclasses.replace(settings.tree, segment_weight=weight))
        weighted[weighted_view(weight)] = _verl_advantages(leaves, "spo_tree", config, rows, changed)
        views[weighted_view(weight)] = []
    for i, leaf in enumerate(leaves):
        common = _response_fields(leaf, i, tokenizer, threshold, locate)
        length = len(common["tokens"])
        ends = list(rows[i]["segment_ends"])
        pooled = pooled_segment_values(leaves, rewards, i, ends)
        per_token, pooled_per_token, start = [], [], 0
        for k, (node, end) in enumerate(zip(forest.row_nodes[i], ends)):
            per_token += [float(nodes.advantages[node])] * (end - start)
            pooled_per_token += [pooled[k + 1] - pooled[k]] * (end - start)
            start = end
        trained = context.trained_mask[i, :length].bool().tolist() if context.trained_mask is not None else [True] * length
        views["spo_tree"].append(Response(advantages=tuple(per_token), trained=tuple(trained), **common))
        views["spo_tree_pooled"].append(Response(advantages=tuple(pooled_per_token), trained=tuple(trained), **common))
        views["grpo"].append(Response(advantages=tuple(float(a) for a in grpo_advantages[i, :length]), **common))
        for view, (advantages, weighted_context) in weighted.items():
            views[view].append(Response(advantages=tuple(float(a) for a in advantages[i, :length]),
                                        trained=tuple(weighted_context.trained_mask[i, :length].bool().tolist()), **common))
    return views


def chain_and_grpo_responses(leaves: list[Leaf], config, tokenizer, threshold: float,
                             locate) -> dict[str, list[Response]]:
    """Two views of the same chains, by estimator: ``spo_chain`` (verl's advantage step with the chains'
    metadata: each segment's ``V(after) - V(before)`` on its tokens) and ``grpo`` (verl's, over the
    same responses). ``locate`` as for :func:`tree_and_grpo_responses`."""
    rows = [leaf.output.extra_fields["spo"] for leaf in leaves]
    chain_advantages, _ = _verl_advantages(leaves, "spo_chain", config, rows)
    grpo_advantages, _ = _verl_advantages(leaves, "grpo", config)
    views: dict[str, list[Response]] = {"spo_chain": [], "grpo": []}
    for i, leaf in enumerate(leaves):
        common = {**_response_fields(leaf, i, tokenizer, threshold, locate), "mc_tokens": int(rows[i]["chain"]["mc_tokens"])}
        length = len(common["tokens"])
        views["spo_chain"].append(Response(advantages=tuple(float(a) for a in chain_advantages[i, :length]), **common))
        views["grpo"].append(Response(advantages=tuple(float(a) for a in grpo_advantages[i, :length]), **common))
    return views
