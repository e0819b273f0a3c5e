"""The legacy trainer's batch as SPO's step reads it: a ``DataProto`` whose prompts are left-padded and
responses right-padded, both delimited by ``attention_mask``, with the rollout's SPO metadata and
episodes in its ``non_tensor_batch`` columns."""

from __future__ import annotations

from spo_verl.core.metadata import EPISODE_FIELD, SPO_FIELD, episode_from_extra_field
from spo_verl.adapters.trainer.batch_view import BatchView, SampledResponse


def view_of(data) -> BatchView:
    """The batch before SPO narrows its ``response_mask``; rows and episodes are None where the rollout
    wrote none."""
    column = data.non_tensor_batch.get(SPO_FIELD)
    episodes = data.non_tensor_batch.get(EPISODE_FIELD)
    response_mask = data.batch["response_mask"]
    return BatchView(rows=list(column) if column is not None else [None] * len(data),
                     episodes=[episode_from_extra_field(e) for e in episodes] if episodes is not None else [None] * len(data),
                     uids=[str(uid) for uid in data.non_tensor_batch["uid"]], response_mask=response_mask,
                     fetch=lambda context, chosen: _responses(data, context, response_mask, chosen))


def _responses(data, context, response_mask, chosen: list[int]) -> list[SampledResponse]:
    """Rows ``chosen`` as plain per-token sequences, read after the advantage step; ``response_mask`` as it
    was before SPO narrowed it."""
    uids = data.non_tensor_batch["uid"]
    prompt_width = data.batch["prompts"].shape[-1]
    attention = data.batch["attention_mask"].bool()
    episodes = data.non_tensor_batch.get(EPISODE_FIELD)
    responses = []
    for i in chosen:
        length = int(attention[i, prompt_width:].sum())
        responses.append(SampledResponse.of_row(
            context, i, str(uids[i]), data.batch["prompts"][i][attention[i, :prompt_width]].tolist(),
            data.batch["responses"][i, :length].tolist(), data.batch["old_log_probs"][i, :length],
            response_mask[i, :length], data.batch["advantages"][i, :length],
            float(data.batch["token_level_scores"][i].sum()), episodes[i] if episodes is not None else None,
        ))
    return responses
