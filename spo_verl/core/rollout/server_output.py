"""What SPO's agent loops take from verl's ``TokenOutput`` besides tokens: the policy versions a
trajectory was generated with, and a clear error for requests the server aborted."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
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
