"""A training batch as SPO's step reads it, whichever trainer holds it: the :class:`BatchView` each trainer
provides (``transfer_queue_batch.py``, ``dataproto_batch.py``) and the :class:`SampledResponse` rows it
fetches for the sample log and the credit metrics."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from spo_verl.core.metadata import EpisodeStatistics, SPORow, episode_from_extra_field, from_extra_field
from spo_verl.adapters.advantage_channel import SPOBatchContext, is_padding_uid


@dataclass
class SampledResponse:
    """One chosen row of the batch, as plain per-token sequences (the trainer adapters fetch them)."""

    batch_index: int  # row index in the step's batch (what SPOBatchContext is indexed by)
    uid: str
    row: SPORow | None  # the row's SPO metadata (a dict as the agent loop wrote it is read), None for plain rows
    prompt_ids: list[int]
    response_ids: list[int]
    log_probs: torch.Tensor  # (L,) p_old as log-probabilities (old_log_probs)
    response_mask: torch.Tensor  # (L,) before SPO narrows it to the trained segments
    advantages: torch.Tensor  # (L,)
    trained: torch.Tensor  # (L,) bool: in the loss
    score: float
    episode: EpisodeStatistics | None = None  # a multi-turn episode's (as the agent loop wrote it, or read)

    def __post_init__(self):
        self.row = from_extra_field(self.row)
        self.episode = episode_from_extra_field(self.episode)

    @classmethod
    def of_row(cls, context, index: int, uid: str, prompt_ids: list[int], response_ids: list[int],
               log_probs: torch.Tensor, response_mask: torch.Tensor, advantages: torch.Tensor,
               score: float, episode: Any = None) -> SampledResponse:
        """Row ``index`` of a step's batch as either trainer reads it; ``context``: the step's
        SPOBatchContext (None for a baseline), whose rows and trained mask it takes; ``episode``: the
        row's ``extra_fields[EPISODE_FIELD]``."""
        trained = response_mask.bool()
        if context is not None and context.trained_mask is not None:
            trained = trained & context.trained_mask[index, :response_mask.numel()].bool()
        return cls(batch_index=index, uid=uid, row=context.rows[index] if context is not None else None,
                   prompt_ids=prompt_ids, response_ids=response_ids, log_probs=log_probs, response_mask=response_mask,
                   advantages=advantages, trained=trained, score=score, episode=episode)


@dataclass
class BatchView:
    """One training batch as the SPO step reads it, whichever trainer holds it.

    ``rows``: each row's SPO metadata (``extra_fields["spo"]``), None where it has none; ``episodes``:
    each row's multi-turn episode statistics; ``uids``; ``response_mask`` (rows x response width),
    before SPO narrows it; ``fetch(context, indices)``: those rows as plain per-token sequences, read
    after the advantage step."""

    rows: Sequence[Any]
    episodes: Sequence[Any]
    uids: Sequence[str]
    response_mask: torch.Tensor
    fetch: Callable[[SPOBatchContext | None, list[int]], list[SampledResponse]]

    @property
    def padding(self) -> list[bool]:
        """verl's padding rows (copies of a real row, named by their uid): they count nowhere."""
        return [is_padding_uid(uid) for uid in self.uids]
