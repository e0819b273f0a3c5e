"""What SPO's samplers take from verl's ``TokenOutput``: a generated segment's tokens, log-probs and the
policy versions it was generated with, and a clear error for requests the server aborted."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

WEIGHT_VERSION_FIELDS = ("global_steps", "min_global_steps", "max_global_steps")


class AbortedGeneration(RuntimeError):
    pass


def check_not_aborted(output: Any, what: str) -> None:
    """verl's server reports ``stop_reason="aborted"`` for a request it cancelled (e.g. while weights
    were swapped in an asynchronous trainer); a partial segment must not be taken for a finished one."""
    if getattr(output, "stop_reason", None) == "aborted":
        raise AbortedGeneration(
            f"the rollout server aborted a {what} request; SPO's agent loops need complete generations and run "
            f"with verl's synchronous trainers (trainer.v1.trainer_mode=spo or trainer.use_v1=false)"
        )


@dataclass
class GeneratedSegment:
    token_ids: list[int]
    log_probs: list[float]  # 0.0 for each token where the server returned none
    server_fields: dict[str, Any]  # TokenOutput.extra_fields (weight versions)


async def generate_segment(generate: Callable[..., Awaitable[Any]], request_id: str, prompt_ids: list[int],
                           sampling_params: dict, what: str) -> GeneratedSegment:
    """One generate call of a tree sampler, read into a segment; an aborted request is an error."""
    output = await generate(request_id, prompt_ids=prompt_ids, sampling_params=sampling_params)
    check_not_aborted(output, what)
    token_ids = list(output.token_ids)
    log_probs = list(output.log_probs) if output.log_probs is not None else [0.0] * len(token_ids)
    return GeneratedSegment(token_ids, log_probs, dict(getattr(output, "extra_fields", None) or {}))


def merged_weight_versions(server_fields: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The weight-version fields of one trajectory built from several generate calls: the oldest
    and newest versions any of its tokens came from (verl's staleness metrics read them)."""
    fields = [f for f in server_fields if f]
    merged: dict[str, Any] = {}
    if not fields:
        return merged
    mins = [f.get("min_global_steps", f.get("global_steps")) for f in fields]
    maxs = [f.get("max_global_steps", f.get("global_steps")) for f in fields]
    mins, maxs = [m for m in mins if m is not None], [m for m in maxs if m is not None]
    if "global_steps" in fields[-1]:
        merged["global_steps"] = fields[-1]["global_steps"]
    if mins:
        merged["min_global_steps"] = min(mins)
    if maxs:
        merged["max_global_steps"] = max(maxs)
    return merged
