"""One draw of the gradient measurement (docs/STUDY.md, "Which update is best per generated token"): an
estimator's gradient as training computes it at its first update, and the reference gradient it is
compared with.

* The units (GRPO groups, SPO trees, SPO-chain groups of chains) are sampled by the agent loops training
  uses, on verl's vLLM server: ``single_turn_agent`` for GRPO, ``spo_tree`` and ``spo_chain``
  (:func:`spo_workbench.credit.rollouts.sample_rollouts`).
* Advantages come from verl's ``compute_advantage`` with the rollouts' metadata
  (:mod:`spo_workbench.credit.rollouts`: SPO-tree's ``trained_mask``, the pooled view, SPO-chain's values).
* The loss is verl's registered policy loss (``get_policy_loss_fn``) with ``token-mean`` aggregation and,
  for ``spo_prob_mask``, the paper's reference normalisation; ratio 1 (the old log-probabilities are the
  current ones, detached). Its gradient with respect to the log-probabilities is taken once on the whole
  draw (the loss couples the rows: token-mean, the mask's whitening), then pushed through the model a few
  rows at a time, so no more than a chunk's logits are ever held, after the prompt the rows share,
  encoded once (:class:`SharedPrefix`).
* The reference: plain samples, each response's sequence log-probability weighted by its reward less the
  mean of the others (:func:`spo_workbench.credit.gradient_measures.leave_one_out_weights`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from spo_verl.core.algorithms.advantages import SEGMENT_WEIGHTS
from spo_workbench.credit.gradient_measures import leave_one_out_weights
from spo_workbench.credit.rollouts import SAMPLING, ChainSetup, Leaf, TreeSetup, gsm8k_score

THRESHOLD = 0.9  # algorithm.spo.prob_mask.threshold, the paper's
GROUP = 4  # rollout.n of the CPU settings' GRPO


@dataclass(frozen=True)
class GroupSetup:
    """GRPO's unit: ``responses`` plain samples a group; ``one_group``: every unit of a draw in one group."""

    name: str
    responses: int = GROUP
    one_group: bool = False


@dataclass(frozen=True)
class Estimator:
    """An estimator measured: how its units are sampled (``setup``), which view of their advantages it
    trains on (``grpo``, ``spo_tree``, ``spo_tree_pooled``, ``spo_tree_paths``, ``spo_tree_sqrt_paths``,
    ``spo_chain``) and its loss."""

    name: str
    setup: GroupSetup | TreeSetup | ChainSetup
    view: str
    loss_mode: str  # verl's registered policy loss: vanilla | spo_prob_mask
    secondary: bool = False


@dataclass
class Row:
    """One row of the actor's batch: its tokens and what the loss gives each response token."""

    prompt_ids: list[int]
    response_ids: list[int]
    advantages: list[float]
    trained: list[bool]  # SPO-tree: the row that trains a shared segment (the trainers' trained_mask)


@dataclass
class Draw:
    rows: dict[str, list[Row]]  # by estimator: estimators that share a sampling train on the same rollouts
    tokens: int  # generated: each tree node once, SPO-chain's continuations included
    rewards: list[float]


def sampling_key(estimator: Estimator) -> str:
    """Estimators with one key sample their units alike, so a draw's rollouts serve all of them (GRPO
    with and without the mask, in groups or as one group; each tree with and without pooled values):
    their comparison is then paired on the same responses."""
    setup = estimator.setup
    return f"group{setup.responses}" if isinstance(setup, GroupSetup) else setup.name


def group_config(model_dir: str, responses: int, prompt_length: int, response_length: int):
    """verl's configuration of plain sampling by ``single_turn_agent`` (what GRPO trains on)."""
    from spo_workbench.testing.verl_harness import compose_ppo_trainer

    return compose_ppo_trainer(
        f"actor_rollout_ref.model.path={model_dir}",
        f"actor_rollout_ref.rollout.n={responses}",
        f"actor_rollout_ref.rollout.prompt_length={prompt_length}",
        f"actor_rollout_ref.rollout.response_length={response_length}",
        "actor_rollout_ref.rollout.agent.default_agent_loop=single_turn_agent",
    )


async def plain_samples(config, client, tokenizer, uid: str, messages: list[dict], truth: str,
                        score: Callable[[str, str], float] = gsm8k_score) -> list[Leaf]:
    """``rollout.n`` plain responses to one prompt by verl's ``single_turn_agent``, each scored."""
    from verl.experimental.agent_loop.single_turn_agent_loop import SingleTurnAgentLoop

    from spo_workbench.testing.verl_harness import run_sessions

    outputs = await run_sessions(SingleTurnAgentLoop, config, client, tokenizer, uid, messages,
                                 sampling_params=SAMPLING, data_source="openai/gsm8k",
                                 reward_model={"ground_truth": truth})
    return [Leaf(uid, out, score(tokenizer.decode(out.response_ids, skip_special_tokens=True), truth)) for out in outputs]


def tree_tokens(leaves: Sequence[Leaf]) -> int:
    """Tokens a forest of trees generated: every node's segment once, as training counts them."""
    seen: set[tuple[str, object]] = set()
    total = 0
    for leaf in leaves:
        row = leaf.output.extra_fields["spo"]
        start = 0
        for node, end in zip(row["path"], row["segment_ends"]):
            if (leaf.uid, node) not in seen:
                seen.add((leaf.uid, node))
                total += end - start
            start = end
    return total


async def sample_draw(estimators: Sequence[Estimator], units: int, model_dir: str, client, tokenizer, uid: str,
                      messages: list[dict], truth: str, prompt_length: int, response_length: int,
                      score: Callable[[str, str], float] = gsm8k_score) -> Draw:
    """``units`` independent units of the sampling ``estimators`` share (one :func:`sampling_key`) for one
    prompt, and every estimator's rows with its advantages through verl's advantage step."""
    from spo_workbench.credit.rollouts import (_verl_advantages, chain_and_grpo_responses, rollout_config,
                                                sample_rollouts, tree_and_grpo_responses)

    if len({sampling_key(e) for e in estimators}) != 1:
        raise ValueError(f"estimators of one draw must share their sampling, got {[e.name for e in estimators]}")
    setup = estimators[0].setup
    unit_uids = [f"{uid}/u{j}" for j in range(units)]
    rows: dict[str, list[Row]] = {}
    if isinstance(setup, GroupSetup):
        config = group_config(model_dir, setup.responses, prompt_length, response_length)
        groups = await asyncio.gather(*(plain_samples(config, client, tokenizer, u, messages, truth, score)
                                        for u in unit_uids))
        leaves = [leaf for group in groups for leaf in group]
        for estimator in estimators:
            grouped = [Leaf(uid, leaf.output, leaf.score) for leaf in leaves] if estimator.setup.one_group else leaves
            advantages, _ = _verl_advantages(grouped, "grpo", config)
            rows[estimator.name] = [Row(list(leaf.output.prompt_ids), list(leaf.output.response_ids),
                                        advantages[i, : len(leaf.output.response_ids)].tolist(),
                                        [True] * len(leaf.output.response_ids)) for i, leaf in enumerate(leaves)]
        tokens = sum(len(leaf.output.response_ids) for leaf in leaves)
        return Draw(rows, tokens, [leaf.score for leaf in leaves])
    config = rollout_config(model_dir, setup, prompt_length, response_length)
    leaves = await sample_rollouts(config, client, tokenizer, [(u, messages, truth) for u in unit_uids], score=score)
    no_error = lambda *_: None  # noqa: E731  (no blame measured here)
    if isinstance(setup, ChainSetup):
        views = chain_and_grpo_responses(leaves, config, tokenizer, THRESHOLD, no_error)
        tokens = sum(len(leaf.output.response_ids) for leaf in leaves) + sum(r.mc_tokens for r in views["spo_chain"])
    else:
        weights = [e.view.removeprefix("spo_tree_") for e in estimators if e.view.startswith("spo_tree_")]
        views = tree_and_grpo_responses(leaves, config, tokenizer, THRESHOLD, no_error,
                                        [w for w in weights if w in SEGMENT_WEIGHTS])
        tokens = tree_tokens(leaves)
    for estimator in estimators:
        rows[estimator.name] = [Row(list(leaf.output.prompt_ids), list(leaf.output.response_ids), list(r.advantages),
                                    list(r.trained)) for leaf, r in zip(leaves, views[estimator.view])]
    return Draw(rows, tokens, [leaf.score for leaf in leaves])


def trainable(model, parameters: str) -> list[torch.nn.Parameter]:
    """The parameters whose gradient is measured: ``all``, or ``last_blocks`` (the last two decoder blocks
    and the final norm; the rest frozen, so the backward pass stops there)."""
    if parameters == "all":
        chosen = list(model.parameters())
    elif parameters == "last_blocks":
        chosen = [*model.model.layers[-2].parameters(), *model.model.layers[-1].parameters(),
                  *model.model.norm.parameters()]
    else:
        raise ValueError(f"parameters must be 'all' or 'last_blocks', got {parameters!r}")
    ids = {id(p) for p in chosen}
    for p in model.parameters():
        p.requires_grad_(id(p) in ids)
        p.grad = None
    return chosen


@dataclass
class SharedPrefix:
    """The tokens every row of a draw begins with (the prompt, less its last token, which predicts the first
    response token), encoded once: each layer's keys and values for one row, expanded over a chunk's rows.
    In a draw every row repeats the prompt (four fifths of its tokens on the horizon tasks), so the
    rows' forward and backward passes cost their suffixes only; the trainable layers' keys and values keep
    their graph, so each chunk's backward pass also reaches the parameters through the prefix."""

    ids: list[int]
    layers: list[tuple[torch.Tensor, torch.Tensor]]


def shared_prefix(model, rows: Sequence[Row]) -> SharedPrefix | None:
    """The longest token prefix of every row that stops before each row's last prompt token; ``None``
    when the rows share no token."""
    sequences = [r.prompt_ids + r.response_ids for r in rows]
    length = min(len(r.prompt_ids) for r in rows) - 1
    for sequence in sequences[1:]:
        length = next((i for i in range(length) if sequence[i] != sequences[0][i]), length)
    if length <= 0:
        return None
    ids = sequences[0][:length]
    cache = model.model(input_ids=torch.tensor([ids]), use_cache=True).past_key_values
    return SharedPrefix(ids, [(layer.keys, layer.values) for layer in cache.layers])


def _token_log_probs(model, rows: Sequence[Row], prefix: SharedPrefix | None = None) -> list[torch.Tensor]:
    """Each row's response tokens' log-probabilities (temperature 1), right-padded in one forward after the
    ``prefix`` the rows share (if any); only the response positions are projected to the vocabulary."""
    from transformers import DynamicCache

    skip = len(prefix.ids) if prefix is not None else 0
    suffixes = [(r.prompt_ids + r.response_ids)[skip:] for r in rows]
    width = max(len(s) for s in suffixes)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attention = torch.zeros(len(rows), skip + width, dtype=torch.long)
    attention[:, :skip] = 1
    for b, suffix in enumerate(suffixes):
        ids[b, : len(suffix)] = torch.tensor(suffix)
        attention[b, skip : skip + len(suffix)] = 1
    cache = None
    if prefix is not None:
        cache = DynamicCache([(k.expand(len(rows), -1, -1, -1), v.expand(len(rows), -1, -1, -1))
                              for k, v in prefix.layers], config=model.config)
    hidden = model.model(input_ids=ids, attention_mask=attention, past_key_values=cache,
                         use_cache=cache is not None).last_hidden_state
    out = []
    for b, r in enumerate(rows):
        start, length = len(r.prompt_ids) - skip, len(r.response_ids)
        logits = model.lm_head(hidden[b, start - 1 : start + length - 1]).float()
        out.append(torch.log_softmax(logits, dim=-1).gather(-1, ids[b, start : start + length, None])[:, 0])
    return out


def _padded(values: Sequence[torch.Tensor], width: int) -> torch.Tensor:
    out = torch.zeros(len(values), width)
    for b, v in enumerate(values):
        out[b, : len(v)] = v
    return out


def ascent_gradient(model, parameters: list[torch.nn.Parameter], rows: Sequence[Row],
                    token_weights: torch.Tensor, chunk_rows: int = 8) -> torch.Tensor:
    """The flat gradient of ``sum_(b, t) token_weights[b, t] * log p(token t of row b)`` over
    ``parameters``, accumulated a chunk of rows at a time."""
    for p in parameters:
        p.grad = None
    prefix = shared_prefix(model, rows)
    for first in range(0, len(rows), chunk_rows):
        chunk = rows[first : first + chunk_rows]
        log_probs = _token_log_probs(model, chunk, prefix)
        weights = token_weights[first : first + len(chunk)]
        objective = sum((lp * weights[b, : len(lp)]).sum() for b, lp in enumerate(log_probs))
        if objective.requires_grad:
            objective.backward(retain_graph=prefix is not None)  # the prefix's graph serves every chunk
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in parameters])


def actor_config(loss_mode: str, rows: int, response_tokens: int):
    """verl's actor configuration of the loss as the settings train it (``token-mean``; for
    ``spo_prob_mask`` the paper's reference normalisation at threshold 0.9), with one micro-batch's
    global batch information."""
    from verl.workers.config import ActorConfig, PolicyLossConfig

    from spo_verl.adapters.policy_loss import SPOPolicyLossConfig

    policy_loss = (SPOPolicyLossConfig(loss_mode=loss_mode, spo={"prob_mask": {"threshold": THRESHOLD,
                                                                               "normalization": "reference"}})
                   if loss_mode == "spo_prob_mask" else PolicyLossConfig(loss_mode=loss_mode))
    config = ActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=1, clip_ratio=0.2,
                         loss_agg_mode="token-mean", use_kl_loss=False, policy_loss=policy_loss)
    config.global_batch_info.update({"dp_size": 1, "batch_num_tokens": response_tokens, "global_batch_size": rows})
    return config


def estimator_gradient(model, parameters: list[torch.nn.Parameter], rows: Sequence[Row], loss_mode: str,
                       chunk_rows: int = 8) -> torch.Tensor:
    """The ascent direction of one update: minus the gradient of verl's policy loss ``loss_mode`` over the
    draw's rows, at ratio 1."""
    import spo_verl.register  # noqa: F401  (spo_prob_mask in verl's registry)
    from verl.trainer.ppo.core_algos import get_policy_loss_fn

    width = max(len(r.response_ids) for r in rows)
    with torch.no_grad():
        prefix = shared_prefix(model, rows)
        current = torch.cat([_padded(_token_log_probs(model, rows[i : i + chunk_rows], prefix), width)
                             for i in range(0, len(rows), chunk_rows)])
    response_mask = _padded([torch.tensor(r.trained, dtype=torch.float32) for r in rows], width)
    advantages = _padded([torch.tensor(r.advantages, dtype=torch.float32) for r in rows], width)
    log_prob = current.clone().requires_grad_(True)
    config = actor_config(loss_mode, len(rows), int(response_mask.sum()))
    loss, _ = get_policy_loss_fn(loss_mode)(current, log_prob, advantages, response_mask, "token-mean", config, None)
    (loss_by_log_prob,) = torch.autograd.grad(loss, log_prob, allow_unused=True)
    if loss_by_log_prob is None:
        loss_by_log_prob = torch.zeros_like(log_prob)
    return ascent_gradient(model, parameters, rows, -loss_by_log_prob, chunk_rows)


def reference_half(model, parameters: list[torch.nn.Parameter], leaves: Sequence[Leaf],
                   chunk_rows: int = 8) -> torch.Tensor:
    """One half of the reference: ``mean_i w_i grad log p(y_i)`` with the leave-one-out weights, every
    response token in its sequence log-probability."""
    rows = [Row(list(leaf.output.prompt_ids), list(leaf.output.response_ids), [], []) for leaf in leaves]
    weights = leave_one_out_weights(torch.tensor([leaf.score for leaf in leaves])).float() / len(leaves)
    width = max(len(r.response_ids) for r in rows)
    token_weights = torch.zeros(len(rows), width)
    for b, r in enumerate(rows):
        token_weights[b, : len(r.response_ids)] = weights[b]
    return ascent_gradient(model, parameters, rows, token_weights, chunk_rows)
