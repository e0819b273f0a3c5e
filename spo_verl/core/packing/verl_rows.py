"""A verl micro-batch (no-padding layout) as rows to pack: each row's tokens (prompt then response),
its prompt length and its uid, and the :class:`~spo_verl.core.packing.tree_pack.PackedTree` of the
micro-batch. Nothing here reads SPO metadata: rows share what their tokens share."""

from __future__ import annotations

import torch

from spo_verl.core.packing.tree_pack import PackedTree, pack_sequences

__all__ = ["micro_batch_forest", "row_sequences", "row_uids"]


def _listed(value) -> list:
    if hasattr(value, "tolist") and not isinstance(value, torch.Tensor):
        value = value.tolist()  # tensordict's NonTensorStack
    return [getattr(item, "data", item) for item in value]


def row_uids(micro_batch) -> list:
    """Each row's uid (verl's prompt id: the ``rollout.n`` responses of a prompt, or the leaves of one
    SPO tree, share it), or None per row where the batch has no uid field."""
    if "uid" in micro_batch.keys():
        return _listed(micro_batch.get("uid"))
    return [None] * micro_batch.batch_size[0]


def _prompt_lengths(micro_batch) -> list[int]:
    """As verl's ``no_padding_2_padding`` reads them (``prompts`` nested or padded)."""
    prompts = micro_batch["prompts"]
    if prompts.is_nested:
        return prompts.offsets().diff().cpu().tolist()
    return micro_batch["attention_mask"].cpu()[:, : prompts.shape[1]].sum(1).tolist()


def row_sequences(micro_batch) -> tuple[list[list[int]], list[int]]:
    """Each row's tokens (prompt then response) and prompt length."""
    input_ids = micro_batch["input_ids"]
    if not input_ids.is_nested:
        raise ValueError("packed training needs verl's no-padding layout (nested input_ids)")
    sequences = [row.tolist() for row in input_ids.cpu().unbind()]
    prompt_lengths = _prompt_lengths(micro_batch)
    for row, (sequence, prompt_length) in enumerate(zip(sequences, prompt_lengths)):
        if not 0 < prompt_length <= len(sequence):
            raise ValueError(f"row {row}: a prompt of {prompt_length} tokens in a row of {len(sequence)}")
    return sequences, [int(length) for length in prompt_lengths]


def micro_batch_forest(micro_batch) -> PackedTree:
    """The :class:`PackedTree` of one verl micro-batch: every prefix its rows share, computed once."""
    sequences, prompt_lengths = row_sequences(micro_batch)
    return pack_sequences(sequences, prompt_lengths)
