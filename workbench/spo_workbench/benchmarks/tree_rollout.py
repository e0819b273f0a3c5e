"""Tree rollout against independent sampling of the same leaves, through verl's rollout path.

The ``spo_tree`` agent loop against ``single_turn_agent`` with ``rollout.n`` = the tree's leaves,
the same prompts, on one server (``spo_workbench.benchmarks.rollout``), in two regimes:

* **latency-bound**: two prompts, a few to a few hundred requests. Each engine iteration costs
  about the same whatever it holds, so the wall time follows the engine iterations on the critical
  path (the longest root-to-leaf path: its tokens, plus one request round trip per segment).
* **throughput-bound**: enough prompts that either side has hundreds of sequences in flight
  (up to the server's ``max_num_seqs``); the wall time is expected to follow the work, the tokens the
  engine computes: generated tokens plus the prompt tokens it recomputes (those not served from its prefix
  cache). A child's request recomputes the part of its prefix past the last whole cached block, so
  these cases run with segments aligned to the block (``algorithm.spo.tree.align_to_block``) and
  one case without, to show the difference.

Forced-length cases give every request vLLM's ``min_tokens = max_tokens`` (no EOS: every node gets
its full budget and the tree generates exactly its analytic count); the own-EOS cases let the model
stop. Every step starts from an empty prefix cache.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

from spo_workbench.benchmarks.rollout import (BLOCK_SIZE, Counts, Side, agent_config, alternating_rounds, make_side,
                                               numbered_prompts)
from spo_workbench.benchmarks.timing import Comparison
from spo_verl.core.rollout.tree_shape import check_tree_fits
from spo_verl.core.rollout.tree import aligned_budgets

LATENCY, THROUGHPUT = "latency-bound", "throughput-bound"
SHAPES = {"2-2": (2, 2), "4-4": (4, 4), "6-6-6": (6, 6, 6)}


@dataclass(frozen=True)
class TreeCase:
    shape: str
    budgets: tuple[int, ...]  # every depth but the last, which gets the rest of the response length
    response_length: int
    prompts: int
    regime: str
    full_length: bool = True  # False: the model's own EOS
    align_to_block: int | None = None

    def __post_init__(self):
        # The agent loop refuses a tree that does not fit its response length; refuse it here, when the
        # cases are defined, not after the cases before it have run.
        check_tree_fits(self.branching, self.budgets, self.response_length, self.leaves, self.align_to_block)

    @property
    def branching(self) -> tuple[int, ...]:
        return SHAPES[self.shape]

    @property
    def leaves(self) -> int:
        return math.prod(self.branching)

    @property
    def label(self) -> str:
        ending = "forced length" if self.full_length else "own EOS"
        alignment = f"aligned to {self.align_to_block}" if self.align_to_block else "unaligned"
        return f"{self.shape}, {self.prompts} x {self.leaves}, {ending}, segments {list(self.budgets)} {alignment}"


CASES = (
    TreeCase("2-2", (16,), 32, 2, LATENCY),
    TreeCase("4-4", (16,), 32, 2, LATENCY),
    TreeCase("6-6-6", (8, 8), 32, 2, LATENCY),
    TreeCase("4-4", (16,), 32, 2, LATENCY, full_length=False),
    # Alignment lengthens a first segment by up to a block less one token: room is left for it.
    TreeCase("2-2", (32,), 96, 64, THROUGHPUT, align_to_block=BLOCK_SIZE),
    TreeCase("4-4", (32,), 96, 16, THROUGHPUT, align_to_block=BLOCK_SIZE),
    TreeCase("6-6-6", (32, 32), 128, 1, THROUGHPUT, align_to_block=BLOCK_SIZE),
    TreeCase("6-6-6", (32, 32), 128, 1, THROUGHPUT),
    TreeCase("4-4", (32,), 96, 16, THROUGHPUT, full_length=False, align_to_block=BLOCK_SIZE),
)
QUICK_CASES = (TreeCase("2-2", (16,), 32, 1, LATENCY),)
#: Throughput-bound cases on a real model (SmolLM2-135M, the CPU default's): an engine iteration's
#: cost grows with its tokens there, unlike the tiny model's, whose iterations cost about the same
#: whatever they hold (least-squares fits on two CPU cores: ~120 ms fixed plus ~3.3 ms a token of work
#: over the two 32-sequence cases, ~50 ms plus ~5.2 ms over all five; a straight line fits them only
#: roughly). Two sizes of the same trees, 32 and 128 sequences in flight, and the paper's 6-6-6 from one
#: prompt (216 sequences; its first two depths hold 6 and 36). Responses of 64 tokens (80 for 6-6-6)
#: keep seven rounds of all five within about an hour (60 minutes measured).
SMOLLM2_CASES = (
    TreeCase("2-2", (16,), 64, 8, THROUGHPUT, align_to_block=BLOCK_SIZE),
    TreeCase("4-4", (16,), 64, 2, THROUGHPUT, align_to_block=BLOCK_SIZE),
    TreeCase("2-2", (16,), 64, 32, THROUGHPUT, align_to_block=BLOCK_SIZE),
    TreeCase("4-4", (16,), 64, 8, THROUGHPUT, align_to_block=BLOCK_SIZE),
    # Aligned, two 16-token segments can take up to 79 tokens: 80-token responses.
    TreeCase("6-6-6", (16, 16), 80, 1, THROUGHPUT, align_to_block=BLOCK_SIZE),
)
#: SmolLM2 keeps 46 KB of KV cache a token in float32 (30 layers, 3 KV heads of 64), so 216 sequences of
#: up to 128 tokens (whole blocks) need about 1.3 GB: more than the CPU runs' 1 GiB, which would preempt.
SMOLLM2_KV_CACHE_GIB = 2


def analytic_tree_tokens(branching, budgets, response_length: int) -> int:
    """Tokens a full tree generates when each node is generated once: every node of depth d has
    ``budgets[d]`` tokens (the last depth the rest of the response length)."""
    last = response_length - sum(budgets)
    total, width = 0, 1
    for depth, children in enumerate(branching):
        width *= children
        total += width * (budgets[depth] if depth < len(budgets) else last)
    return total


def row_prompt_lengths(output) -> list[int]:
    """Each row's prompt length (its attention-masked prompt tokens)."""
    return output.batch["attention_mask"][:, : output.batch["prompts"].shape[1]].sum(dim=1).tolist()


def tree_prompt_lengths(output) -> list[int]:
    """Each tree's prompt length, in the order the trees first appear in the batch."""
    lengths = row_prompt_lengths(output)
    seen, result = set(), []
    for row, meta in enumerate(output.non_tensor_batch["spo"]):
        if meta["tree_id"] not in seen:
            seen.add(meta["tree_id"])
            result.append(lengths[row])
    return result


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
    prompt_lengths = row_prompt_lengths(output)
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


def critical_path(output) -> tuple[int, int]:
    """Tokens and requests on the batch's longest root-to-leaf path: a tree leaf's response is its
    path's segments, one request each; a flat sample is one request."""
    spo = output.non_tensor_batch.get("spo")
    if spo is None:
        return int(output.batch["response_mask"].sum(dim=1).max()), 1
    return max((meta["segment_ends"][-1], len(meta["path"])) for meta in spo)


def work(counts: Counts) -> int:
    """Tokens the engine computed: generated plus prompt tokens not served from its prefix cache."""
    return counts.generated_tokens + counts.computed_prompt_tokens


@dataclass
class TreeResult:
    case: TreeCase
    comparison: Comparison
    tree: Side
    independent: Side
    round_trip_seconds: float

    @property
    def early_stops(self) -> int:
        total = 0
        for round_ in self.tree.rounds:
            spo = round_["output"].non_tensor_batch["spo"]
            total += sum({m["tree_id"]: sum(m["tree"]["early_stops_per_depth"]) for m in spo}.values())
        return total

    def analytic_generated(self) -> int | None:
        """What the tree must generate when no EOS is sampled (the last round's prompts)."""
        if not self.case.full_length:
            return None
        output = self.tree.rounds[-1]["output"]
        return sum(analytic_tree_tokens(self.case.branching, aligned_budgets(p, self.case.budgets, self.case.align_to_block),
                                        self.case.response_length) for p in tree_prompt_lengths(output))

    def per_round(self) -> list[dict]:
        rows = []
        for tree, independent in zip(self.tree.rounds, self.independent.rounds):
            rows.append({
                "wall_ratio": tree["seconds"] / independent["seconds"],
                "work_ratio": work(tree["counts"]) / work(independent["counts"]),
                "generated_ratio": tree["counts"].generated_tokens / independent["counts"].generated_tokens,
            })
        return rows

    def median(self, key: str) -> float:
        return statistics.median(row[key] for row in self.per_round())

    def wall_over_work(self) -> float:
        return statistics.median(row["wall_ratio"] / row["work_ratio"] for row in self.per_round())

    def extra_seconds(self) -> float:
        return self.comparison.a_median - self.comparison.b_median

    def explained_extra_seconds(self) -> float:
        """What the tree's extra requests explain: one request round trip for each segment after the
        first on the critical path, and the prompt tokens they recompute beyond independent sampling's
        work, at independent sampling's seconds per token of work."""
        _, requests = critical_path(self.tree.rounds[-1]["output"])
        extra_work = statistics.median(work(t["counts"]) - work(i["counts"])
                                       for t, i in zip(self.tree.rounds, self.independent.rounds))
        seconds_per_work = statistics.median(i["seconds"] / work(i["counts"]) for i in self.independent.rounds)
        return (requests - 1) * self.round_trip_seconds + max(extra_work, 0) * seconds_per_work

    def as_dict(self) -> dict:
        def side(s: Side) -> dict:
            last = s.rounds[-1]
            return {"seconds": [r["seconds"] for r in s.rounds], "counts": vars(last["counts"]),
                    "engine": vars(last["engine"]) if last["engine"] else None,
                    "critical_path": critical_path(last["output"]), "training": training_rows(last["output"])}

        return {"case": vars(self.case), "round_trip_seconds": self.round_trip_seconds, "per_round": self.per_round(),
                "analytic_generated": self.analytic_generated(), "early_stops": self.early_stops,
                "tree": side(self.tree), "independent": side(self.independent)}


async def request_round_trip(server, prompt_ids: list[int], samples: int = 7) -> float:
    """Median seconds of a one-token request on the idle server through verl's client: what a tree
    pays per extra request on its critical path (the hop from a parent's reply to its child's first
    token)."""
    client = server.new_client()
    seconds = []
    for sample in range(samples):
        started = time.perf_counter()
        await client.generate(f"round-trip-{sample}-{time.monotonic_ns()}", prompt_ids=prompt_ids,
                              sampling_params={"max_tokens": 1, "temperature": 1.0})
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


async def benchmark_trees(model_dir: str, cases, rounds: int, kv_cache_gib: int | None = None) -> list[TreeResult]:
    """Every case on one fresh benchmark server for ``model_dir``, shut down afterwards."""
    from spo_workbench.benchmarks.rollout import start_server

    server = await start_server(model_dir, response_length=max(case.response_length for case in cases),
                                kv_cache_gib=kv_cache_gib)
    try:
        results = []
        for case in cases:
            results.append(await benchmark_tree(server, model_dir, case, rounds))
            print(f"[tree rollout] {case.regime} {case.label}: wall {results[-1].comparison.ratio:.2f}x, "
                  f"work {results[-1].median('work_ratio'):.2f}x, wall / work {results[-1].wall_over_work():.2f}", flush=True)
        return results
    finally:
        server.shutdown()


async def benchmark_tree(server, model_dir: str, case: TreeCase, rounds: int) -> TreeResult:
    extra = [f"+algorithm.spo.tree.branching={list(case.branching)}",
             f"+algorithm.spo.tree.segment_tokens={list(case.budgets)}"]
    if case.align_to_block:
        extra.append(f"+algorithm.spo.tree.align_to_block={case.align_to_block}")
    tree_config = agent_config(model_dir, "spo_tree", case.leaves, case.response_length, *extra)
    single_config = agent_config(model_dir, "single_turn_agent", case.leaves, case.response_length)
    prompts = numbered_prompts(case.prompts)
    tree = make_side("tree", server, tree_config, prompts, case.response_length, full_length=case.full_length)
    independent = make_side("indep", server, single_config, prompts, case.response_length, full_length=case.full_length)
    comparison = await alternating_rounds(tree, independent, server, rounds)
    output = tree.rounds[-1]["output"]
    first_prompt = output.batch["input_ids"][0][output.batch["attention_mask"][0].bool()][: tree_prompt_lengths(output)[0]]
    return TreeResult(case, comparison, tree, independent, await request_round_trip(server, first_prompt.tolist()))
