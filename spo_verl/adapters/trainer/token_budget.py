"""Equal sampling cost across algorithms: the tokens each step's rollout generated, and the end of
training at ``algorithm.spo.budget.generated_tokens``.

A step's generated tokens: for SPO-tree each tree node once (leaf rows repeat their shared
prefixes, which were generated once); for SPO-chain the responses plus their Monte Carlo
continuations; for every other algorithm the response tokens of the batch. Logged for every
algorithm as ``spo/generated_tokens`` (this step) and ``spo/generated_tokens_cumulative`` (since
this process started training; a resumed run counts from its resume).
"""

from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

GENERATED_TOKENS = "spo/generated_tokens"
GENERATED_TOKENS_CUMULATIVE = "spo/generated_tokens_cumulative"


def step_generated_tokens(response_tokens: float, spo_metrics: Mapping[str, float]) -> float:
    """Tokens the rollout generated this step, from the batch's response-token count and its ``spo/*`` metrics."""
    tree_tokens = spo_metrics.get("spo/tree/generated_tokens")
    if tree_tokens is not None:
        return float(tree_tokens)
    return float(response_tokens) + float(spo_metrics.get("spo/chain/mc_tokens", 0.0))


class GeneratedTokenBudget:
    """Counts generated tokens and, with a budget, makes the step expected to reach it the last one.

    verl's trainers decide whether a step is the last (final validation and checkpoint) before the
    step runs, from ``trainer.total_training_steps``. So after step k, if the count so far plus step
    k's own count reaches the budget, step k+1 is made the last: the run ends within about one step's
    tokens of the budget. A first step that alone exceeds the budget still gets one more step."""

    def __init__(self, budget: int | None):
        self.budget = budget
        self.total = 0.0

    def record(self, trainer: Any, step_tokens: float, metrics: MutableMapping[str, float]) -> None:
        self.total += step_tokens
        metrics[GENERATED_TOKENS] = float(step_tokens)
        metrics[GENERATED_TOKENS_CUMULATIVE] = self.total
        if self.budget is None:
            return
        next_step = trainer.global_steps + 1
        if self.total + step_tokens >= self.budget and trainer.total_training_steps > next_step:
            trainer.total_training_steps = next_step
