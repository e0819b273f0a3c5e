"""Training an SPO tree in one forward (issue #11): pack the leaf rows of a tree into its unique tokens
(:mod:`.tree_pack`), attend each segment to its ancestors only (:mod:`.cascade_attention`) and gather
log-probs back into the per-row layout (:mod:`.packed_forward`). In verl: :mod:`.engine` switches the
FSDP engine to packed forwards, :mod:`.verl_rows` reads the trees out of a verl batch and
:mod:`.micro_batches` keeps them together under the token budget."""

from spo_verl.packing.cascade_attention import (
    CASCADE_ATTENTION,
    CascadeLayout,
    build_cascade_layout,
    cascade_attention_forward,
    register_cascade_attention,
)
from spo_verl.packing.packed_forward import (
    cascade_attention_enabled,
    packed_hidden_states,
    packed_row_log_probs,
    packed_token_log_probs,
    packed_token_scores,
)
from spo_verl.packing.tree_pack import PackedTree, pack_forest, pack_tree

__all__ = [
    "CASCADE_ATTENTION",
    "CascadeLayout",
    "PackedTree",
    "build_cascade_layout",
    "cascade_attention_enabled",
    "cascade_attention_forward",
    "pack_forest",
    "pack_tree",
    "packed_hidden_states",
    "packed_row_log_probs",
    "packed_token_log_probs",
    "packed_token_scores",
    "register_cascade_attention",
]
