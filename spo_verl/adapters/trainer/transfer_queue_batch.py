"""The default trainer's batch as SPO's step reads and writes it: rows in TransferQueue, named by a
``KVBatchMeta`` (keys, tags) that the trainer hands from step to step.

:func:`view_of` describes a step's batch as a :class:`BatchView`, each row's SPO metadata and episode
read from the rollout's ``extra_fields`` (:func:`extra_field_values`, :func:`episodes_from_extra_fields`);
:func:`write_trained_mask` narrows the loss to the trained segments (``response_mask`` and
``loss_mask``); :func:`rows_of` and :func:`with_padding_of` take the rows that train into the actor
update and hand back the padding rows verl added for it, so that the trainer clears them with the step's.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import transfer_queue as tq
from tensordict import TensorDict
from transfer_queue import KVBatchMeta
from verl.workers.utils.padding import response_to_nested

from spo_verl.core.metadata import EPISODE_FIELD, SPO_FIELD, EpisodeStatistics, episode_from_extra_field
from spo_verl.adapters.trainer.batch_view import BatchView, SampledResponse

#: Per-response-token fields written after the rollout (the advantage step, old and reference
#: log-probs, values, rollout-correction weights). verl's padding rows copy every field of a real row
#: and reset only the rollout's own to one token; padded this late, the rest keep that row's length.
LATE_TOKEN_FIELDS = ("old_log_probs", "advantages", "returns", "ref_log_prob", "values", "rollout_is_weights")


def extra_field_values(extra_fields: Sequence[Any], field: str) -> list[Mapping | None]:
    """Each row's ``extra_fields[field]`` (None where it has none)."""
    rows = []
    for value in extra_fields:
        value = getattr(value, "data", value)  # TransferQueue hands back NonTensorData
        rows.append(value.get(field) if isinstance(value, Mapping) else None)
    return rows


def episodes_from_extra_fields(extra_fields: Sequence[Any]) -> list[EpisodeStatistics | None]:
    """Each row's multi-turn episode (None for a row that is none, or a copy that trains nothing)."""
    return [episode_from_extra_field(value) for value in extra_field_values(extra_fields, EPISODE_FIELD)]


def stored_uids(stored) -> list[str]:
    """The batch's uids as TransferQueue returns them (a list of strings, a NonTensorStack once padded)."""
    uids = stored["uid"]
    return [str(uid) for uid in (uids.tolist() if hasattr(uids, "tolist") else uids)]


def read_stored(batch: KVBatchMeta):
    """The step's uids, extra fields and ``response_mask`` as the rollout left them, before SPO narrows the mask."""
    return tq.kv_batch_get(keys=batch.keys, partition_id=batch.partition_id,
                           select_fields=["extra_fields", "response_mask", "uid"])


def view_of(batch: KVBatchMeta, stored) -> BatchView:
    """The step's batch as SPO's step reads it, from what :func:`read_stored` read."""
    extra_fields = list(stored["extra_fields"])
    return BatchView(rows=extra_field_values(extra_fields, SPO_FIELD), episodes=episodes_from_extra_fields(extra_fields),
                     uids=stored_uids(stored), response_mask=stored["response_mask"].to_padded_tensor(0),
                     fetch=lambda context, chosen: _fetch_responses(batch, stored, context, chosen))


def _fetch_responses(batch: KVBatchMeta, stored, context, chosen: list[int]) -> list[SampledResponse]:
    """Rows ``chosen`` of the step's batch, read after the advantage step, as plain per-token sequences;
    ``stored`` holds the uids, extra fields and ``response_mask`` from before SPO narrowed it."""
    data = tq.kv_batch_get(keys=[batch.keys[i] for i in chosen], partition_id=batch.partition_id,
                           select_fields=["prompts", "responses", "advantages", "old_log_probs", "rm_scores"])
    fields = {name: list(data[name].unbind()) for name in data.keys()}
    masks = list(stored["response_mask"].unbind())
    uids = stored_uids(stored)
    episodes = extra_field_values(list(stored["extra_fields"]), EPISODE_FIELD)
    return [SampledResponse.of_row(context, i, uids[i], fields["prompts"][j].tolist(), fields["responses"][j].tolist(),
                                   fields["old_log_probs"][j], masks[i], fields["advantages"][j],
                                   float(fields["rm_scores"][j].sum()), episodes[i])
            for j, i in enumerate(chosen)]


def write_trained_mask(batch: KVBatchMeta, stored, trained: torch.Tensor) -> KVBatchMeta:
    """``response_mask`` and ``loss_mask`` narrowed to ``trained`` (rows x response width) in TransferQueue,
    as verl's rollout correction masks."""
    nested = response_to_nested(trained, stored["response_mask"])
    return tq.kv_batch_put(keys=batch.keys, partition_id=batch.partition_id,
                           fields=TensorDict({"response_mask": nested, "loss_mask": nested}, batch_size=len(batch)))


def rows_of(batch: KVBatchMeta, kept: list[int]) -> KVBatchMeta:
    """The rows ``kept`` of ``batch``, in order."""
    return KVBatchMeta(partition_id=batch.partition_id, keys=[batch.keys[i] for i in kept],
                       tags=[batch.tags[i] for i in kept], extra_info=dict(batch.extra_info))


def fit_padding_rows(update: KVBatchMeta, known: set) -> None:
    """Give the padding rows verl added to ``update`` (keys not in ``known``) one token of each late
    per-token field (zeros, as verl's padding does for the rollout's fields), so that a micro-batch's
    fields pad to one width."""
    added = [key for key, tag in zip(update.keys, update.tags) if key not in known and tag.get("is_padding", False)]
    if not added:
        return
    sample = tq.kv_batch_get(keys=added[:1], partition_id=update.partition_id)[0]
    present = [name for name in LATE_TOKEN_FIELDS if name in sample.keys()]
    if not present:
        return
    fields = {name: torch.nested.as_nested_tensor([torch.zeros(1, dtype=sample[name].dtype)] * len(added),
                                                  layout=torch.jagged) for name in present}
    tq.kv_batch_put(keys=added, partition_id=update.partition_id, fields=TensorDict(fields, batch_size=len(added)))


def with_padding_of(batch: KVBatchMeta, update: KVBatchMeta) -> KVBatchMeta:
    """``batch`` and the padding rows verl added to ``update``: they live in TransferQueue too, and the
    trainer clears a step's rows by the batch it gets back."""
    known = set(batch.keys)
    added = [(key, tag) for key, tag in zip(update.keys, update.tags) if key not in known]
    return KVBatchMeta(partition_id=batch.partition_id, keys=batch.keys + [key for key, _ in added],
                       tags=batch.tags + [tag for _, tag in added], extra_info=batch.extra_info)
