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
    tokens of the budget. A first step that alone exceeds the budget still gets one more step. The
    budget only says which step that is; the trainer sets its ``total_training_steps`` to it."""

    def __init__(self, budget: int | None):
        self.budget = budget
        self.total = 0.0

    def record(self, step_tokens: float, training_step: int, last_training_step: int,
               metrics: MutableMapping[str, float]) -> int | None:
        """Count the tokens of step ``training_step`` (``spo/generated_tokens`` and the cumulative count
        into ``metrics``). Returns the step that is now to be the last, or None to keep
        ``last_training_step`` (no budget, or not expected to be reached before it)."""
        self.total += step_tokens
        metrics[GENERATED_TOKENS] = float(step_tokens)
        metrics[GENERATED_TOKENS_CUMULATIVE] = self.total
        if self.budget is None:
            return None
        next_step = training_step + 1
        if self.total + step_tokens >= self.budget and last_training_step > next_step:
            return next_step
        return None
