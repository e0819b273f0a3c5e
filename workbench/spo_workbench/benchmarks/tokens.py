"""Training tokens per step: what goes through the actor's forward and backward.

verl trains each leaf of an SPO tree as its own row (prompt + every segment on its path), so a
shared prefix is recomputed once per leaf below it; GRPO with the same number of samples trains the
same number of whole sequences; training each tree node once (shared-prefix training, not built)
would need only the tree's unique tokens.
"""

from __future__ import annotations

import math

#: The paper's MATH setting (its section on R1-Distill-Qwen-1.5B on MATH): ~150-token prompt, tree
#: 6-6-6, 600-token segments at the first two depths, ~300 tokens at the last.
PAPER_PROMPT, PAPER_BRANCHING, PAPER_SEGMENTS, PAPER_PROMPTS_PER_STEP = 150, (6, 6, 6), (600, 600, 300), 32


def per_leaf_row_tokens(prompt: int, branching, segments) -> int:
    return math.prod(branching) * (prompt + sum(segments))


def unique_tree_tokens(prompt: int, branching, segments) -> int:
    total, width = prompt, 1
    for children, tokens in zip(branching, segments):
        width *= children
        total += width * tokens
    return total


def paper_counts() -> dict[str, int]:
    rows = per_leaf_row_tokens(PAPER_PROMPT, PAPER_BRANCHING, PAPER_SEGMENTS)
    return {
        "spo_tree_rows": rows,
        "grpo_same_leaves": rows,  # 216 independent samples of the same length
        "unique": unique_tree_tokens(PAPER_PROMPT, PAPER_BRANCHING, PAPER_SEGMENTS),
        "prompts_per_step": PAPER_PROMPTS_PER_STEP,
    }


#: 6 * parameters FLOPs per token for forward + backward (the usual dense-transformer estimate).
def step_seconds_lower_bound(tokens_per_step: int, parameters: float = 1.5e9, gpus: int = 8,
                             flops_per_gpu: float = 989e12, utilisation: float = 0.5) -> float:
    """A generous lower bound on the actor update alone of one step at the paper's setting: 6 N
    FLOPs per trained token on ``gpus`` H100s (989 dense bf16 TFLOP/s) at ``utilisation``; rollout,
    old/reference log-probs and weight sync come on top."""
    return 6 * parameters * tokens_per_step / (gpus * flops_per_gpu * utilisation)
