"""Every unique token once per forward: pack rows that share prefixes (a prompt and its responses, an
SPO tree) into their unique tokens (:mod:`.tree_pack`), attend each run of tokens to its ancestors only
(:mod:`.cascade_attention`) and gather log-probs back into the per-row layout (:mod:`.packed_forward`).
In verl: :mod:`.engine` switches the FSDP engine to packed forwards, :mod:`.verl_rows` reads a verl
micro-batch as rows and :mod:`.micro_batches` keeps each prompt's rows together under the token budget."""

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
from spo_verl.packing.tree_pack import PackedTree, pack_sequences

__all__ = [
    "CASCADE_ATTENTION",
    "CascadeLayout",
    "PackedTree",
    "build_cascade_layout",
    "cascade_attention_enabled",
    "cascade_attention_forward",
    "pack_sequences",
    "packed_hidden_states",
    "packed_row_log_probs",
    "packed_token_log_probs",
    "packed_token_scores",
    "register_cascade_attention",
]
