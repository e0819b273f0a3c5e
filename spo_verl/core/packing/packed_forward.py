"""One forward per packed tree (or forest) of a Hugging Face causal LM, log-probs back in row layout.

:func:`packed_row_log_probs` runs the decoder once over a :class:`~spo_verl.core.packing.tree_pack.PackedTree`
(unique tokens, path position ids, :mod:`~spo_verl.core.packing.cascade_attention`), so every shared prefix
is computed -- and back-propagated -- once. Log-probs are then taken per packed token from the hidden
state of the token *before it on its path* (:attr:`PackedTree.previous_position`): the last token of a
node predicts a different token in each child, so the first token of every child is scored from its
parent's last hidden state, once per child. That is one log-prob per unique (context, token) pair,
i.e. per non-prompt packed token; they are gathered into the (B, T_response) layout a per-row forward
gives (zeros past each row's length and for padding rows), so verl's loss can use them unchanged. A
segment shared by k rows appears in k rows of the output; gradients from all of them add up in the
packed token, exactly as the per-row forwards' gradients add up in the parameters.

The vocabulary projection is done ``chunk_tokens`` hidden states at a time (a 90k-token tree at a
152k vocabulary would need ~51 GiB of fp32 logits at once); with gradients each chunk is
checkpointed, so only the chunk's hidden states and log-probs stay alive until backward.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from spo_verl.core.packing.cascade_attention import (
    CASCADE_ATTENTION,
    LAYOUT_KWARG,
    CascadeLayout,
    build_cascade_layout,
    register_cascade_attention,
)
from spo_verl.core.packing.tree_pack import PackedTree

__all__ = [
    "cascade_attention_enabled",
    "packed_hidden_states",
    "packed_row_log_probs",
    "packed_token_scores",
]


@contextlib.contextmanager
def cascade_attention_enabled(model: torch.nn.Module):
    """Within the block the model's attention implementation is :data:`CASCADE_ATTENTION` (restored after).

    With gradient checkpointing the layers are re-run during backward, outside this block: set
    ``model.config._attn_implementation = CASCADE_ATTENTION`` for the whole step instead (the packed
    functions accept a model already switched)."""
    register_cascade_attention()
    config = model.config
    previous = config._attn_implementation
    if previous == CASCADE_ATTENTION:
        yield model
        return
    if getattr(model, "is_gradient_checkpointing", False) and torch.is_grad_enabled():
        raise RuntimeError(
            "gradient checkpointing re-runs attention during backward: set the model's attention implementation to "
            f"{CASCADE_ATTENTION!r} before the step rather than switching it for the forward only"
        )
    config._attn_implementation = CASCADE_ATTENTION
    try:
        yield model
    finally:
        config._attn_implementation = previous


def _decoder_and_head(model: torch.nn.Module):
    decoder = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    if decoder is None or decoder is model:
        decoder = model.get_decoder()
    head = model.get_output_embeddings()
    if head is None:
        raise ValueError("the model has no output embeddings (lm_head)")
    return decoder, head


def _check_full_attention(config) -> None:
    layer_types = getattr(config, "layer_types", None) or ["full_attention"]
    if any(kind != "full_attention" for kind in layer_types):
        raise ValueError(f"packed trees support full attention layers only, the model has {sorted(set(layer_types))}")


def packed_hidden_states(
    model: torch.nn.Module, packed: PackedTree, layout: CascadeLayout | None = None
) -> torch.Tensor:
    """(N, hidden) final hidden states (after the final norm) of every packed token, one decoder forward."""
    decoder, _ = _decoder_and_head(model)
    _check_full_attention(model.config)
    device = packed.input_ids.device if next(model.parameters(), None) is None else next(model.parameters()).device
    if layout is None:
        layout = build_cascade_layout(packed, device)
    with cascade_attention_enabled(model):
        output = decoder(
            input_ids=packed.input_ids.to(device)[None],
            position_ids=packed.position_ids.to(device)[None],
            # No mask: the model asks transformers' mask interface, which for CASCADE_ATTENTION builds none
            # (a mask mapping would do for Qwen2, but Llama-style decoders take a tensor or None only).
            attention_mask=None,
            use_cache=False,
            **{LAYOUT_KWARG: layout},
        )
    return output.last_hidden_state[0]


def _chunk_scores(
    head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, temperature: float, with_entropy: bool
) -> torch.Tensor:
    """(C,) log-probs of ``targets``, or (C, 2) log-probs and entropies of the predicting distributions."""
    logits = head(hidden)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    normaliser = torch.logsumexp(logits, dim=-1)
    log_probs = logits.gather(1, targets[:, None]).squeeze(1) - normaliser
    if not with_entropy:
        return log_probs
    entropy = normaliser - (torch.softmax(logits, dim=-1) * logits).sum(-1)  # as verl's entropy_from_logits
    return torch.stack([log_probs, entropy], dim=1)


def packed_token_scores(
    model: torch.nn.Module,
    packed: PackedTree,
    temperature: float = 1.0,
    chunk_tokens: int = 4096,
    layout: CascadeLayout | None = None,
    checkpoint_chunks: bool | None = None,
    with_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per packed token: the log-prob of the token given its path, and (``with_entropy``) the entropy
    of the distribution it was drawn from; (N,) each, 0 for prompt tokens. One decoder forward.

    ``checkpoint_chunks`` (default: when gradients are on) recomputes each chunk's logits in backward
    instead of keeping them."""
    _, head = _decoder_and_head(model)
    if packed.num_packed_tokens == 0:  # only padding rows: nothing to run
        dtype = torch.promote_types(head.weight.dtype, torch.float32)
        empty = torch.zeros(0, dtype=dtype, device=head.weight.device)
        return empty, (empty.clone() if with_entropy else None)
    hidden = packed_hidden_states(model, packed, layout)
    device = hidden.device
    # Every packed token that is some row's response token, once (a shared prompt token is not scored).
    scored = packed.response_index[packed.response_index >= 0]
    targets = torch.unique(scored.cpu()) if scored.numel() else scored.new_zeros(0)
    sources = packed.previous_position.cpu()[targets]
    if bool((sources < 0).any()):
        raise ValueError("a row's first token is scored as a response token: every row needs a prompt of at least one token")
    targets, sources = targets.to(packed.input_ids.device), sources.to(packed.input_ids.device)
    target_ids = packed.input_ids[targets].to(device)
    targets, sources = targets.to(device), sources.to(device)
    if checkpoint_chunks is None:
        checkpoint_chunks = torch.is_grad_enabled()
    pieces = []
    for start in range(0, targets.numel(), max(1, int(chunk_tokens))):
        stop = min(targets.numel(), start + int(chunk_tokens))
        arguments = (head, hidden.index_select(0, sources[start:stop]), target_ids[start:stop], temperature,
                     with_entropy)
        if checkpoint_chunks:
            pieces.append(checkpoint(_chunk_scores, *arguments, use_reentrant=False))
        else:
            pieces.append(_chunk_scores(*arguments))
    dtype = pieces[0].dtype if pieces else torch.promote_types(hidden.dtype, torch.float32)
    shape = (packed.num_packed_tokens, 2) if with_entropy else (packed.num_packed_tokens,)
    scores = torch.zeros(shape, dtype=dtype, device=device)
    if pieces:
        scores = scores.index_put((targets,), torch.cat(pieces))
    if with_entropy:
        return scores[:, 0], scores[:, 1]
    return scores, None


def packed_row_log_probs(model: torch.nn.Module, packed: PackedTree, temperature: float = 1.0,
                         **forward_options: Any) -> torch.Tensor:
    """(B, T_response) log-probs of each row's response tokens, as a per-row forward gives them
    (``log_softmax(logits / temperature)`` of the row's next token), 0 past each row's length and for
    padding rows. Differentiable; one decoder forward over the packed sequence (``forward_options``:
    ``chunk_tokens``, ``layout``, ``checkpoint_chunks`` of :func:`packed_token_scores`)."""
    token_log_probs, _ = packed_token_scores(model, packed, temperature, **forward_options)
    return packed.gather_rows(token_log_probs)
