"""Reading SPO trees out of a verl batch (no-padding layout): each row's tree, path and segment ends
from its metadata (the legacy trainer's ``spo`` column or v1's ``extra_fields["spo"]``), and the
:class:`~spo_verl.packing.tree_pack.PackedTree` of a micro-batch."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from spo_verl.batch_context import SPO_FIELD
from spo_verl.packing.tree_pack import PackedTree, pack_forest

__all__ = ["RowPlacement", "micro_batch_forest", "row_placements"]

# verl's synthetic padding rows copy the first sample's extra_fields (trainer/ppo/padding_utils.py)
# and take a uid with this prefix; they are plain rows whatever their metadata says.
_PADDING_UID_PREFIX = "pad"


def _listed(value: Any) -> list | None:
    if value is None:
        return None
    if hasattr(value, "tolist") and not isinstance(value, torch.Tensor):
        value = value.tolist()  # tensordict's NonTensorStack
    return [getattr(item, "data", item) for item in value]


def _uids(micro_batch) -> list:
    return _listed(micro_batch.get("uid")) if "uid" in micro_batch.keys() else [None] * micro_batch.batch_size[0]


def _is_padding(uid) -> bool:
    return isinstance(uid, str) and uid.startswith(_PADDING_UID_PREFIX)


def _row_metadata(micro_batch) -> list[Mapping | None]:
    """Each row's SPO metadata: the legacy trainer's ``spo`` column or v1's ``extra_fields["spo"]``."""
    keys = set(micro_batch.keys())
    batch = micro_batch.batch_size[0]
    if SPO_FIELD in keys:
        rows = _listed(micro_batch.get(SPO_FIELD))
    elif "extra_fields" in keys:
        rows = [value.get(SPO_FIELD) if isinstance(value, Mapping) else None
                for value in _listed(micro_batch.get("extra_fields"))]
    else:
        rows = [None] * batch
    return [None if _is_padding(uid) or not isinstance(row, Mapping) else row
            for row, uid in zip(rows, _uids(micro_batch))]


def _prompt_and_response_lengths(micro_batch) -> tuple[torch.Tensor, torch.Tensor]:
    """As verl's ``no_padding_2_padding`` reads them (``prompts``/``responses`` nested or not)."""
    prompts, responses = micro_batch["prompts"], micro_batch["responses"]
    if prompts.is_nested:
        return prompts.offsets().diff().cpu(), responses.offsets().diff().cpu()
    attention = micro_batch["attention_mask"].cpu()
    width = prompts.shape[1]
    return attention[:, :width].sum(1), attention[:, width:].sum(1)


@dataclass(frozen=True)
class RowPlacement:
    """Where a verl row sits in its SPO tree: ``tree_key`` None for a row with no response token
    (nothing of it is scored), ``("row", b)`` for a row packed alone, ``("tree", tree_id)`` for a
    tree's leaf, ``("padding", uid)`` for verl's padding rows (one template, shared like a tree)."""

    tree_key: tuple | None
    path: list | None
    segment_ends: list[int] | None
    prompt_length: int
    response_length: int


def row_placements(micro_batch) -> list[RowPlacement]:
    """A row with SPO-tree metadata whose response is exactly its path's segments packs with the other
    rows of its tree, verl's padding rows pack with each other, and every other row (GRPO, SPO-chain)
    is a one-node tree of its own."""
    prompt_lengths, response_lengths = _prompt_and_response_lengths(micro_batch)
    placements = []
    for row, (metadata, uid) in enumerate(zip(_row_metadata(micro_batch), _uids(micro_batch))):
        prompt_length, response_length = int(prompt_lengths[row]), int(response_lengths[row])
        ends = list(metadata["segment_ends"]) if metadata is not None and "path" in metadata else None
        if _is_padding(uid) and response_length > 0:
            # verl builds every padding row of a batch from one template under one uid (EOS tokens,
            # trains nothing): they pack as one tree of one node (pack_forest checks the tokens agree).
            placement = RowPlacement(("padding", uid), [0], [response_length], prompt_length, response_length)
        elif ends and ends[-1] == response_length:
            placement = RowPlacement(("tree", metadata["tree_id"]), list(metadata["path"]), ends, prompt_length,
                                     response_length)
        elif response_length > 0:
            placement = RowPlacement(("row", row), [0], [response_length], prompt_length, response_length)
        else:
            placement = RowPlacement(None, None, None, prompt_length, response_length)
        placements.append(placement)
    return placements


def micro_batch_forest(micro_batch) -> PackedTree:
    """The :class:`PackedTree` of one verl micro-batch (no-padding layout, nested ``input_ids``)."""
    input_ids = micro_batch["input_ids"]
    if not input_ids.is_nested:
        raise ValueError("packed SPO-tree training needs verl's no-padding layout (nested input_ids)")
    sequences = [row.tolist() for row in input_ids.cpu().unbind()]
    placements = row_placements(micro_batch)
    for row, (place, sequence) in enumerate(zip(placements, sequences)):
        if place.prompt_length + place.response_length != len(sequence):
            raise ValueError(f"row {row}: prompt {place.prompt_length} + response {place.response_length} tokens, "
                             f"but input_ids holds {len(sequence)}")
    return pack_forest(
        [place.tree_key for place in placements],
        [sequence[: place.prompt_length] for place, sequence in zip(placements, sequences)],
        [sequence[place.prompt_length:] for place, sequence in zip(placements, sequences)],
        [place.path for place in placements],
        [place.segment_ends for place in placements],
    )
