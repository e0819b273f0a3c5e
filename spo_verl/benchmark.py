"""Benchmarks, measured side by side in one run, printed as tables.

1. Advantage maths: the batched tensor functions against the plain-Python references on the same
   random batches (SPO-tree forests of 6-6-6 trees; SPO-chain batches).
2. Rollout: SPO-tree sampling against independent sampling of the same number of leaves, on a real
   vLLM engine on CPU with a tiny local model (wall time and generated tokens).

    bash scripts/benchmark.sh [--skip-rollout]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import tempfile
import time

import torch

from spo_verl.algorithms import (
    chain_token_advantages,
    chain_token_advantages_batched,
    tree_advantages,
    tree_advantages_batched,
    tree_values,
    tree_values_batched,
)


def _seconds(fn, repeat=3):
    best = math.inf
    for _ in range(repeat):
        started = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - started)
    return best


def _forest(trees: int, branching=(6, 6, 6), seed=0):
    rng = random.Random(seed)
    parents, rewards = [], {}
    for _ in range(trees):
        root = len(parents)
        parents.append(-1)
        frontier = [root]
        for width in branching:
            frontier = [parents.append(node) or len(parents) - 1 for node in frontier for _ in range(width)]
        for leaf in frontier:
            rewards[leaf] = float(rng.random() < 0.5)
    return parents, rewards


def benchmark_advantages() -> None:
    print("advantage maths: plain-Python reference vs batched tensors (best of 3)")
    print(f"{'case':<34}{'reference ms':>14}{'batched ms':>12}{'speed-up':>10}")
    for trees in (8, 32):
        parents, rewards = _forest(trees)
        # The reference functions take one tree; run them tree by tree as a caller would.
        size = len(parents) // trees
        one_tree = [p - 0 if p < 0 else p for p in parents[:size]]
        one_rewards = {n: r for n, r in rewards.items() if n < size}

        def reference():
            for _ in range(trees):
                tree_advantages(one_tree, tree_values(one_tree, one_rewards))

        parent_tensor = torch.tensor(parents)
        leaf_rewards = torch.zeros(len(parents), dtype=torch.float64)
        leaf_rewards[list(rewards)] = torch.tensor(list(rewards.values()), dtype=torch.float64)

        def batched():
            tree_advantages_batched(parent_tensor, tree_values_batched(parent_tensor, leaf_rewards))

        ref, bat = _seconds(reference) * 1e3, _seconds(batched) * 1e3
        print(f"{f'{trees} trees 6-6-6 ({len(parents)} nodes)':<34}{ref:>14.1f}{bat:>12.1f}{ref / bat:>9.1f}x")
    for batch, length in ((512, 1024), (2048, 1024)):
        rng = random.Random(1)
        starts = [sorted(rng.sample(range(length), 8)) for _ in range(batch)]
        values = [[rng.random() for _ in range(8)] for _ in range(batch)]
        rewards = [float(rng.random() < 0.5) for _ in range(batch)]

        def reference():
            for b in range(batch):
                chain_token_advantages(length, starts[b], values[b], rewards[b])

        start_tensor, value_tensor = torch.tensor(starts), torch.tensor(values)
        counts, reward_tensor = torch.full((batch,), 8), torch.tensor(rewards)

        def batched():
            chain_token_advantages_batched(start_tensor, value_tensor, counts, reward_tensor, length)

        ref, bat = _seconds(reference) * 1e3, _seconds(batched) * 1e3
        print(f"{f'{batch} chains x {length} tokens':<34}{ref:>14.1f}{bat:>12.1f}{ref / bat:>9.1f}x")


async def benchmark_rollout(branching=(4, 4), segment_tokens=24, response_length=96, prompts=4) -> None:
    from spo_verl.rollout.tree import sample_tree
    from spo_verl.testing.tiny_vllm import CPUvLLMServer, build_tiny_qwen2, build_tiny_tokenizer

    with tempfile.TemporaryDirectory() as directory:
        tokenizer = build_tiny_tokenizer(directory)
        build_tiny_qwen2(directory, tokenizer, seed=0, eos_prob=0.01)
        server = await CPUvLLMServer.start(directory, prompt_length=64, response_length=response_length)
        try:
            prompt_ids = [tokenizer.apply_chat_template([{"role": "user", "content": f"Task {i}"}],
                                                        add_generation_prompt=True, tokenize=True, return_dict=False)
                          for i in range(prompts)]
            params = {"temperature": 1.0, "top_p": 1.0, "logprobs": True}
            eos = {tokenizer.eos_token_id}

            async def trees():
                return await asyncio.gather(*(
                    sample_tree(server.generate, f"t{i}", p, params, branching, [segment_tokens] * (len(branching) - 1),
                                response_length, eos) for i, p in enumerate(prompt_ids)))

            tree_seconds = independent_seconds = math.inf
            for _ in range(3):  # alternate, best of 3 each: the engine is warm for both
                started = time.perf_counter()
                sampled = await trees()
                tree_seconds = min(tree_seconds, time.perf_counter() - started)
                leaves = [len(t.leaves()) for t in sampled]
                tree_tokens = sum(len(n.token_ids) for t in sampled for n in t.nodes[1:])

                started = time.perf_counter()
                independent = await asyncio.gather(*(
                    server.generate(f"i{i}", prompt_ids=p, sampling_params={**params, "max_tokens": response_length})
                    for i, (p, count) in enumerate(zip(prompt_ids, leaves)) for _ in range(count)))
                independent_seconds = min(independent_seconds, time.perf_counter() - started)
                independent_tokens = sum(len(o.token_ids) for o in independent)
        finally:
            await server.shutdown()
    print(f"\nrollout on vLLM CPU: SPO-tree {'-'.join(map(str, branching))} ({segment_tokens}-token segments) vs "
          f"independent samples, {prompts} prompts, {sum(leaves)} leaves each way (last of 3 rounds; time: best of 3)")
    print(f"{'':<24}{'wall s':>10}{'generated tokens':>20}")
    print(f"{'tree':<24}{tree_seconds:>10.2f}{tree_tokens:>20}")
    print(f"{'independent':<24}{independent_seconds:>10.2f}{independent_tokens:>20}")
    print(f"{'tree / independent':<24}{tree_seconds / independent_seconds:>10.2f}{tree_tokens / independent_tokens:>20.2f}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--skip-rollout", action="store_true", help="only the advantage maths (no vLLM engine)")
    args = parser.parse_args(argv)
    benchmark_advantages()
    if not args.skip_rollout:
        asyncio.run(benchmark_rollout())


if __name__ == "__main__":
    main()
