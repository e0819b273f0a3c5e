"""SPO maths as framework-free functions (no verl import): segment partitions, segment values and
advantages, and the probability-masked loss. Plain-Python references plus batched tensor versions."""

from spo_verl.core.algorithms.advantages import (
    chain_segment_advantages,
    chain_token_advantages,
    tree_node_advantages,
    tree_values,
)
from spo_verl.core.algorithms.batched import (
    chain_token_advantages_batched,
    tree_node_advantages_batched,
    tree_values_batched,
)
from spo_verl.core.algorithms.masked_loss import (
    clipped_surrogate,
    k3_kl,
    probability_mask,
    reference_kl_term,
    reference_policy_loss,
    whiten_over_mask,
)
from spo_verl.core.algorithms.segments import (
    cutpoint_segment_starts,
    delimiter_segment_starts,
    fixed_count_segment_starts,
    low_probability_positions,
)

__all__ = [
    "chain_segment_advantages",
    "chain_token_advantages",
    "chain_token_advantages_batched",
    "clipped_surrogate",
    "cutpoint_segment_starts",
    "delimiter_segment_starts",
    "fixed_count_segment_starts",
    "k3_kl",
    "low_probability_positions",
    "probability_mask",
    "reference_kl_term",
    "reference_policy_loss",
    "tree_node_advantages",
    "tree_node_advantages_batched",
    "tree_values",
    "tree_values_batched",
    "whiten_over_mask",
]
