"""Tree ("cascade") attention over packed rows, as a transformers attention function.

In a :class:`~spo_verl.core.packing.tree_pack.PackedTree` a token may attend to its own node's earlier
tokens and to every token of its ancestors -- the context it has in each leaf row that contains it.
A dense N x N tree mask says the same but is quadratic in the *packed* length (for a 6-6-6 MATH tree
~90k tokens: 7.6 GiB as bool) and makes attention slower than the rows. Instead, for every node:

    queries = the node's own tokens,
    keys / values = the K/V of the node's root-to-node path (ancestors' spans, then its own span),
    causal within the node's own span, aligned bottom-right (query i sees path keys 0 .. offset + i),

which is exactly what a varlen kernel with per-segment query lengths and per-path key lengths computes
(flash-attn >= 2.1's causal is bottom-right aligned), so the same layout carries to GPUs. Here each
group of nodes with the same (depth, query length, key length) is one batched
``torch.nn.functional.scaled_dot_product_attention`` call with no mask tensor at all: ``is_causal``
where a node's queries are its whole path (the prompts), else torch's bottom-right ``CausalBias``.

Kernel on GPU: SDPA picks it per call. ``is_causal`` and ``CausalBias`` (lower right) are both
accepted by PyTorch's FlashAttention-2 backend for fp16/bf16 (its causal mask is bottom-right
aligned), and by the memory-efficient backend otherwise, so no call falls back to SDPA's math path
or builds a (q x kv) mask; GQA goes through SDPA's ``enable_gqa``; autograd handles backward
(index_select / cat only). One call per (depth, q, kv) group means many small calls when last-depth
lengths vary (about one per leaf per layer); one ``flash_attn_varlen_func`` call per layer over the
gathered paths (cu_seqlens_q = node spans, cu_seqlens_k = path lengths) is the way to remove them.

Use: ``register_cascade_attention()`` once (registers :data:`CASCADE_ATTENTION` = "spo_cascade" with
``transformers.AttentionInterface`` and a mask function that builds no mask), set the model's
``config._attn_implementation`` to it, and pass the :class:`CascadeLayout` of the packed batch as the
``spo_tree_layout`` keyword of the forward (transformers hands extra keywords down to the attention
function; gradient checkpointing replays them). :func:`spo_verl.core.packing.packed_forward.packed_row_log_probs`
does all of that.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.functional import scaled_dot_product_attention
from torch.nn.attention.bias import CausalBias, causal_lower_right

from spo_verl.core.packing.tree_pack import PackedTree

__all__ = ["CASCADE_ATTENTION", "LAYOUT_KWARG", "CascadeGroup", "CascadeLayout", "build_cascade_layout",
           "cascade_attention_forward", "register_cascade_attention"]

CASCADE_ATTENTION = "spo_cascade"
LAYOUT_KWARG = "spo_tree_layout"


@dataclass(frozen=True)
class CascadeGroup:
    """Nodes with the same depth, query length ``q_len`` and key length ``kv_len``."""

    nodes: torch.Tensor  # (G,) node indices
    q_index: torch.Tensor  # (G * q_len,) packed positions of the queries, node after node
    kv_index: torch.Tensor  # (G * kv_len,) packed positions of each node's path keys, node after node
    q_len: int
    kv_len: int

    def mask(self) -> CausalBias | None:
        """Bottom-right causal (q_len x kv_len) as torch's CausalBias, which SDPA hands to its fused
        kernels (flash / memory-efficient on GPU) without building a mask; None when q_len == kv_len
        (plain causal). Made at the call, never stored in the layout: the layout travels through the
        model's forward keywords, and FSDP's mixed-precision input cast turns a CausalBias into a bare
        tensor (``.to(bfloat16)`` keeps the class but drops its lengths and variant)."""
        return None if self.q_len == self.kv_len else causal_lower_right(self.q_len, self.kv_len)


@dataclass(frozen=True)
class CascadeLayout:
    groups: tuple[CascadeGroup, ...]
    output_order: torch.Tensor  # (N,) position in the concatenated group outputs of each packed token
    num_tokens: int

    def to(self, device) -> "CascadeLayout":
        groups = tuple(CascadeGroup(g.nodes.to(device), g.q_index.to(device), g.kv_index.to(device), g.q_len, g.kv_len)
                       for g in self.groups)
        return CascadeLayout(groups, self.output_order.to(device), self.num_tokens)


def build_cascade_layout(packed: PackedTree, device: torch.device | str | None = None) -> CascadeLayout:
    """The per-group gather indices of :func:`cascade_attention_forward` for ``packed`` (vectorised
    per group: the key positions of a node come from its ancestor table and path offsets)."""
    # Built on the CPU whichever device the tree is on (the packed engine moves it to the GPU first), then
    # moved to ``device``: the bookkeeping below makes index tensors of its own, and reads sizes per group.
    starts, lengths = packed.node_starts.cpu(), packed.node_lengths.cpu()
    depths, ancestors = packed.node_depths.cpu(), packed.node_ancestors.cpu()
    path_offsets = packed.position_ids.cpu()[starts]  # path position of each node's first token
    kv_lengths = path_offsets + lengths
    num_nodes = starts.numel()
    groups = []
    pieces = []
    if num_nodes:
        # One integer key per (depth, q_len, kv_len).
        big = int(kv_lengths.max()) + 1
        keys = (depths * big + lengths) * big + kv_lengths
        unique_keys, inverse = torch.unique(keys, return_inverse=True)
        for group in range(unique_keys.numel()):
            nodes = (inverse == group).nonzero().squeeze(1)
            depth, q_len, kv_len = int(depths[nodes[0]]), int(lengths[nodes[0]]), int(kv_lengths[nodes[0]])
            chain = ancestors[nodes, : depth + 1]  # (G, depth + 1) root .. node
            chain_starts, chain_offsets = starts[chain], path_offsets[chain]  # (G, depth + 1)
            k = torch.arange(kv_len)
            holder = torch.searchsorted(chain_offsets, k.expand(nodes.numel(), kv_len).contiguous(), right=True) - 1
            kv_index = chain_starts.gather(1, holder) + k - chain_offsets.gather(1, holder)  # (G, kv_len)
            q_index = starts[nodes][:, None] + torch.arange(q_len)  # (G, q_len)
            groups.append(CascadeGroup(nodes, q_index.reshape(-1), kv_index.reshape(-1), q_len, kv_len))
            pieces.append(q_index.reshape(-1))
    num_tokens = packed.num_packed_tokens
    output_order = torch.empty(num_tokens, dtype=torch.long)
    if pieces:
        concatenated = torch.cat(pieces)
        output_order[concatenated] = torch.arange(concatenated.numel())
        if concatenated.numel() != num_tokens:
            raise AssertionError("the node spans do not cover the packed sequence once")
    layout = CascadeLayout(tuple(groups), output_order, num_tokens)
    return layout if device is None else layout.to(device)


def cascade_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query`` (1, H, N, D), ``key``/``value`` (1, H_kv, N, D) over
    the packed sequence; returns ((1, N, H, D), None). The layout comes from ``kwargs[LAYOUT_KWARG]``."""
    layout: CascadeLayout | None = kwargs.get(LAYOUT_KWARG)
    if layout is None:
        raise ValueError(f"{CASCADE_ATTENTION} attention needs the packed layout as the `{LAYOUT_KWARG}` keyword")
    if attention_mask is not None:
        raise ValueError(f"{CASCADE_ATTENTION} attention takes no attention mask (the tree layout is the mask)")
    if kwargs.get("sliding_window") is not None:
        raise ValueError(f"{CASCADE_ATTENTION} attention does not implement sliding windows")
    if query.shape[0] != 1 or query.shape[2] != layout.num_tokens or key.shape[2] != layout.num_tokens:
        raise ValueError(f"{CASCADE_ATTENTION}: expected one packed sequence of {layout.num_tokens} tokens, "
                         f"got query {tuple(query.shape)}, key {tuple(key.shape)}")
    heads, kv_heads, head_dim = query.shape[1], key.shape[1], query.shape[3]
    gqa = {"enable_gqa": True} if kv_heads != heads else {}
    dropout_p = dropout if module is None or module.training else 0.0
    q_all, k_all, v_all = query[0], key[0], value[0]  # (H, N, D), (H_kv, N, D)
    outputs = []
    for group in layout.groups:
        count = group.nodes.numel()
        q = q_all.index_select(1, group.q_index).view(heads, count, group.q_len, head_dim).transpose(0, 1)
        k = k_all.index_select(1, group.kv_index).view(kv_heads, count, group.kv_len, head_dim).transpose(0, 1)
        v = v_all.index_select(1, group.kv_index).view(kv_heads, count, group.kv_len, head_dim).transpose(0, 1)
        mask = group.mask()
        if mask is None:
            out = scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, scale=scaling, **gqa)
        else:
            out = scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p, scale=scaling, **gqa)
        outputs.append(out.transpose(1, 2).reshape(count * group.q_len, heads, head_dim))  # (G * q_len, H, D)
    attn_output = torch.cat(outputs, 0).index_select(0, layout.output_order)  # packed order
    return attn_output.unsqueeze(0), None


def _no_mask(*args, **kwargs):
    return None


def register_cascade_attention() -> str:
    """Register the attention function (and a mask function that builds nothing) under
    :data:`CASCADE_ATTENTION`; idempotent. Returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(CASCADE_ATTENTION, cascade_attention_forward)
    AttentionMaskInterface.register(CASCADE_ATTENTION, _no_mask)
    return CASCADE_ATTENTION
