"""Every unique token once per forward: pack rows that share prefixes (a prompt and its responses, an
SPO tree) into their unique tokens (:mod:`.tree_pack`), attend each run of tokens to its ancestors only
(:mod:`.cascade_attention`), gather log-probs back into the per-row layout (:mod:`.packed_forward`) and
read a verl micro-batch's tensors as rows (:mod:`.verl_rows`). verl's engine uses them through
:mod:`spo_verl.adapters.packing`."""

from spo_verl.core.packing.cascade_attention import (
    CASCADE_ATTENTION,
    CascadeLayout,
    build_cascade_layout,
    cascade_attention_forward,
    register_cascade_attention,
)
from spo_verl.core.packing.packed_forward import (
    cascade_attention_enabled,
    packed_hidden_states,
    packed_row_log_probs,
    packed_token_scores,
)
from spo_verl.core.packing.tree_pack import PackedTree, pack_sequences

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
    "packed_token_scores",
    "register_cascade_attention",
]
