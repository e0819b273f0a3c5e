"""Packed SPO-tree training against per-row training, through verl's own actor worker.

    python -m spo_workbench.benchmarks.packing --json [--quick] [--threads N] [--repeats R]

Runs in a fresh process (it sets up the one-process gloo world and the ``spo_cpu`` platform before
verl is imported): builds the tests' tiny Qwen2 in a temporary folder and two verl actor
``TrainingWorker`` s from it (FSDP2 engine on CPU, fp32, gradient checkpointing on), switches the second
one to packed forwards (:func:`spo_verl.adapters.packing.engine.enable_packed_training`) and times one actor
update pass of the same batch on each, alternating (:func:`spo_workbench.benchmarks.timing.compare`): zero
the gradients, then verl's ``forward_backward_batch`` of the whole batch as one micro-batch in training
mode (forward + backward, no optimizer step), so every tree packs whole. The packed engine's
``spo/packing/*`` metrics must count exactly the batch's distinct prefixes (its unique tokens: at least
the trees' shared segments, and siblings that happen to open with the same token share that too) and
the batch's row tokens.
Peak memory of each side is measured afterwards in one fresh subprocess (``--memory-cases``, the
method of :func:`spo_workbench.benchmarks.timing.memory_report`).

The last line of stdout is the JSON result.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass

from spo_verl.adapters.packing.micro_batches import packed_token_count
from spo_workbench.testing.verl_engine import start_process_group


@dataclass(frozen=True)
class Shape:
    """``trees`` random trees of ``branching``, segment ``segments[depth]`` tokens, ``prompt``-token prompts."""

    label: str
    branching: tuple[int, ...]
    segments: tuple[int, ...]
    prompt: int
    trees: int

    @property
    def response_length(self) -> int:
        return sum(self.segments)

    def describe(self) -> str:
        segments = "/".join(str(s) for s in self.segments) if len(set(self.segments)) > 1 else str(self.segments[0])
        return (f"{self.trees} x {self.label} ({segments}-token segments, {self.prompt}-token prompt)")


SHAPES = (
    Shape("3-3", (3, 3), (16, 16), 24, 2),
    Shape("4-4", (4, 4), (32, 32), 24, 2),
    # The paper's 6-6-6 with its proportions (segments 600 / 600 / 300), scaled down.
    Shape("6-6-6", (6, 6, 6), (16, 16, 8), 24, 1),
)
QUICK_SHAPES = SHAPES[:1]
SIDES = ("per-row", "packed")


@dataclass(frozen=True)
class GroupShape:
    """One GRPO group: ``rows`` responses of ``response`` tokens each to one ``prompt``-token prompt
    (nothing shared but the prompt): how much packing saves is all in the prompt's share."""

    prompt: int
    response: int
    rows: int = 8

    @property
    def label(self) -> str:
        return f"GRPO {self.rows} x ({self.prompt} + {self.response})"


# From almost nothing shared (0.99) through the cluster's proportions (a ~150-token prompt under ~1,900-
# token responses, 8 a prompt: packed 0.93 of the rows) to prompts as long as the responses (0.56).
GROUP_SHAPES = (GroupShape(2, 206), GroupShape(16, 192), GroupShape(48, 160), GroupShape(96, 96))


def shapes(quick: bool) -> tuple[Shape, ...]:
    return QUICK_SHAPES if quick else SHAPES


def _trees(shape: Shape, vocab: int, seed: int = 0) -> list:
    from spo_workbench.testing.random_trees import Tree

    rng = random.Random(seed)
    return [Tree(rng, shape.branching, lambda depth, _rng: shape.segments[depth], prompt_len=shape.prompt, vocab=vocab)
            for _ in range(shape.trees)]


class Setup:
    """The tiny model, a per-row and a packed actor worker built from it, and each shape's batch."""

    def __init__(self, model_dir: str):
        from transformers import AutoTokenizer

        from spo_verl.adapters.packing.engine import PackedTrainingSettings, enable_packed_training
        from spo_workbench.testing.verl_engine import build_actor_worker

        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.engines, self.losses = {}, {}
        for side in SIDES:
            worker, loss = build_actor_worker(model_dir, micro_batch_size=4096, gradient_checkpointing=True)
            self.engines[side], self.losses[side] = worker.engine, loss
        # Packs every micro-batch (no per-row fallback): the sweep measures where packing stops paying.
        enable_packed_training(self.engines["packed"], PackedTrainingSettings(max_token_ratio=1.0))
        self.vocab = self.engines["per-row"].module.config.vocab_size

    def batch(self, shape: Shape):
        from spo_workbench.testing.verl_engine import tree_training_batch

        trees = _trees(shape, self.vocab)
        # micro_batch_size defaults to the whole batch: one micro-batch, every tree packs whole.
        data = tree_training_batch(trees, pad_token_id=self.tokenizer.pad_token_id,
                                   response_length=shape.response_length, rng=random.Random(1), vocab=self.vocab)
        return trees, data

    def group_batch(self, shape: GroupShape):
        from spo_workbench.testing.verl_engine import rows_training_batch

        rng = random.Random(2)
        prompt = [rng.randrange(self.vocab) for _ in range(shape.prompt)]
        responses = [[rng.randrange(self.vocab) for _ in range(shape.response)] for _ in range(shape.rows)]
        return rows_training_batch([prompt] * shape.rows, responses, ["group0"] * shape.rows,
                                   pad_token_id=self.tokenizer.pad_token_id, response_length=shape.response, rng=rng)

    def update(self, side: str, data):
        """One actor update pass without the optimizer step: returns verl's output (metrics, losses)."""
        engine = self.engines[side]
        with engine.train_mode():
            engine.optimizer_zero_grad()
            return engine.forward_backward_batch(data, self.losses[side], forward_only=False)


def _metric(metrics: dict, key: str) -> int | None:
    value = metrics.get(key)
    if value is None:
        return None
    return int(value.aggregate() if hasattr(value, "aggregate") else value)


def measure_timing(setup: Setup, quick: bool, repeats: int) -> list[dict]:
    from spo_workbench.benchmarks.timing import compare

    results = []
    for shape in shapes(quick):
        trees, data = setup.batch(shape)
        row_tokens = int(data["input_ids"].offsets()[-1])
        unique = packed_token_count([row.tolist() for row in data["input_ids"].unbind()])
        outputs: dict[str, list] = {side: [] for side in SIDES}

        def call(side):
            return lambda: outputs[side].append(setup.update(side, data))

        comparison = compare(call("per-row"), call("packed"), repeats)  # ratio: per-row / packed = speed-up
        packed_counts = {(_metric(o["metrics"], "spo/packing/packed_tokens"),
                          _metric(o["metrics"], "spo/packing/row_tokens")) for o in outputs["packed"]}
        if packed_counts != {(unique, row_tokens)}:
            raise AssertionError(f"{shape.label}: packed engine counted (packed, row) tokens "
                                 f"{sorted(packed_counts)}, expected ({unique}, {row_tokens}): the batch's unique "
                                 f"tokens and the batch's row tokens")
        if any(len(o["loss"]) != 1 for side in SIDES for o in outputs[side]):
            raise AssertionError(f"{shape.label}: the batch was split into several micro-batches")
        losses = {side: [sum(o["loss"]) for o in outputs[side]] for side in SIDES}
        loss_rel_diff = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(losses["per-row"], losses["packed"]))
        if loss_rel_diff > 1e-4:
            raise AssertionError(f"{shape.label}: per-row and packed losses differ: {losses}")
        results.append({
            "shape": shape.label, "label": shape.describe(), "trees": shape.trees,
            "rows": int(data.batch_size[0]), "row_tokens": row_tokens, "unique_tokens": unique,
            "packed_tokens": next(iter(packed_counts))[0], "metric_row_tokens": next(iter(packed_counts))[1],
            "per_row_seconds": comparison.a_seconds, "packed_seconds": comparison.b_seconds,
            "per_row_median_s": comparison.a_median, "packed_median_s": comparison.b_median,
            "speedup": comparison.ratio, "speedup_spread": list(comparison.spread),
            "loss": {side: losses[side][-1] for side in SIDES}, "loss_rel_diff": loss_rel_diff,
        })
    return results


def measure_group_sweep(setup: Setup, repeats: int) -> list[dict]:
    """Per-row against packed on GRPO groups of decreasing prompt share (same engines, same pass)."""
    from spo_workbench.benchmarks.timing import compare

    results = []
    for shape in GROUP_SHAPES:
        data = setup.group_batch(shape)
        outputs: dict[str, list] = {side: [] for side in SIDES}

        def call(side):
            return lambda: outputs[side].append(setup.update(side, data))

        comparison = compare(call("per-row"), call("packed"), repeats)
        packed = {_metric(o["metrics"], "spo/packing/packed_tokens") for o in outputs["packed"]}
        # The prompt once; random responses may also open with the same token now and then.
        expected = packed_token_count([row.tolist() for row in data["input_ids"].unbind()])
        if packed != {expected} or expected > shape.prompt + shape.rows * shape.response:
            raise AssertionError(f"{shape.label}: packed {sorted(packed)} tokens, expected {expected}")
        share = expected / int(data["input_ids"].offsets()[-1])
        results.append({"label": shape.label, "packed_share": share, "speedup": comparison.ratio,
                        "speedup_spread": list(comparison.spread), "per_row_median_s": comparison.a_median,
                        "packed_median_s": comparison.b_median})
    return results


def memory_cases(quick: bool) -> list[str]:
    return [f"{side}/{shape.label}" for shape in shapes(quick) for side in SIDES]


def measure_memory(setup: Setup, cases: list[str], quick: bool) -> dict:
    from spo_workbench.benchmarks.timing import measure_memory_case

    by_label = {shape.label: shape for shape in shapes(quick)}
    results = {}
    for case in cases:
        side, label = case.split("/", 1)

        def build(side=side, label=label):
            _, data = setup.batch(by_label[label])
            return lambda: setup.update(side, data)

        results[case] = measure_memory_case(build)
    return results


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print the result as JSON (the last line of stdout)")
    parser.add_argument("--quick", action="store_true", help="one small shape (3-3), 2 rounds")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument("--repeats", type=int, default=None, help="timed rounds (default 7, quick 2)")
    parser.add_argument("--memory-cases", nargs="*", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    start_process_group()  # before verl is imported
    import torch

    from recipe.spo.cpu_settings.tiny_model import temporary_tiny_qwen2

    torch.set_num_threads(args.threads)
    with temporary_tiny_qwen2() as model_dir:
        setup = Setup(model_dir)
        if args.memory_cases is not None:
            result = measure_memory(setup, args.memory_cases, args.quick)
            print(json.dumps(result))
            return result
        repeats = args.repeats or (2 if args.quick else 7)
        timing = measure_timing(setup, args.quick, repeats)
        sweep = [] if args.quick else measure_group_sweep(setup, repeats)
        module = setup.engines["per-row"].module
        config = module.config
        model = (f"tiny Qwen2 ({sum(p.numel() for p in module.parameters()):,} parameters, "
                 f"{config.num_hidden_layers} layers, hidden {config.hidden_size}, vocabulary {config.vocab_size})")
    del setup
    from spo_workbench.benchmarks.timing import memory_report

    memory = memory_report("spo_workbench.benchmarks.packing", memory_cases(args.quick), args.quick, args.threads)
    for row in timing:
        row["peak_mib"] = {side: memory[f"{side}/{row['shape']}"]["peak_mib"] for side in SIDES}
    result = {"model": model, "threads": args.threads,
              "repeats": repeats, "shapes": timing, "group_sweep": sweep, "memory": memory}
    print(json.dumps(result) if args.json else json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
    sys.stdout.flush()
