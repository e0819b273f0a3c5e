"""The SPO metadata of one trajectory: the contract between the agent loops that write it and the
estimators, trainers, sample log and metrics that read it.

An agent loop returns it in ``AgentLoopOutput.extra_fields[SPO_FIELD]`` as a plain dict
(``to_extra_field``: verl carries extra fields through Ray, TransferQueue and the legacy trainer's
``non_tensor_batch`` column ``spo``, which all take dicts); every reader turns it back into one of the
classes below with ``from_extra_field``, which names the missing setting when a dict is incomplete.

* ``TreeLeafRow`` (``spo_tree``): one leaf of a sampled tree, one training row. ``path`` are the node
  ids from the root's child to the leaf, ``segment_ends`` the response offset where each path node's
  segment ends. ``trains`` is False for the legacy trainer's stand-in copy of a leaf that stopped
  early (its mask is all zero). ``tree`` carries the tree's shape and cost for the ``spo/tree/*``
  metrics (the same on every leaf of a tree): ``TreeStatistics``, or ``CutpointTreeStatistics`` for a
  tree that forks at cutpoints.
* ``ChainRow`` (``spo_chain``): one response. ``segment_starts`` are the response offsets where the
  segments begin, ``boundary_values`` the Monte Carlo value of the prefix before each start.
  ``chain`` carries its Monte Carlo cost for the ``spo/chain/*`` metrics (``ChainStatistics``).

``truncated``: the response was cut by the length limit (``algorithm.spo.truncated_response_score``
says how the estimators score it).

A multi-turn episode, whatever loop played it (SPO's over turns, or ``spo_episode`` for verl's own
estimators), carries its ``EpisodeStatistics`` in ``extra_fields[EPISODE_FIELD]``
(``episode_to_extra_field``), beside any SPO metadata: the ``spo/turns/*`` metrics read it for every
algorithm.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

# Key of the SPO metadata in AgentLoopOutput.extra_fields (and so a non_tensor_batch column).
SPO_FIELD = "spo"
# Key of a multi-turn episode's statistics in AgentLoopOutput.extra_fields.
EPISODE_FIELD = "spo_turns"
# The SPO algorithms: each is the name of an advantage estimator and of the agent loop that samples for it.
SPO_ALGORITHMS = ("spo_chain", "spo_tree")


class SPOMetadataMissingError(RuntimeError):
    pass


@dataclass(frozen=True)
class TreeStatistics:
    """Shape and cost of one sampled tree."""
    nodes: int  # segments, the root excluded
    leaves: int
    early_stops_per_depth: list[int]  # leaves that stopped above the last depth, by depth
    generated_tokens: int  # every node's segment once
    independent_sample_tokens: int  # what the leaves would have cost as independent responses


@dataclass(frozen=True)
class CutpointTreeStatistics(TreeStatistics):
    """A tree that forks at cutpoints: also its forks and where they fall."""
    paths: int = 0  # responses sampled from the prompt
    forks: int = 0
    fork_positions: list[float] = field(default_factory=list)  # a fork's offset over its response's length
    cutpoint_requests: int = 0  # requests made to find the cutpoints


@dataclass(frozen=True)
class ChainStatistics:
    """Monte Carlo cost of one chain."""
    boundaries: int
    mc_continuations: int  # continuations this response started (a prefix's value shared between responses counts once)
    mc_tokens: int
    mc_truncated: int  # continuations cut by the length limit
    cutpoint_requests: int
    no_cutpoint: bool  # cutpoint partition, and no token below the threshold
    capped: bool  # boundaries dropped by the per-response caps (max_boundaries, max_mc_tokens_per_response)


@dataclass(frozen=True)
class EpisodeStatistics:
    """One multi-turn episode, for the ``spo/turns/*`` metrics."""
    turns: int  # the model's turns
    reply_tokens: int  # the environment's tokens in the response (out of the loss)
    ended_by: str  # environment, turns, length or error
    environment_error: str | None = None


@dataclass(frozen=True)
class TreeLeafRow:
    path: list[int]
    segment_ends: list[int]
    tree_id: Any = None  # None: the row's uid names its tree
    trains: bool = True
    truncated: bool = False
    tree: TreeStatistics | None = None


@dataclass(frozen=True)
class ChainRow:
    segment_starts: list[int]
    boundary_values: list[float]
    truncated: bool = False
    chain: ChainStatistics | None = None


SPORow = TreeLeafRow | ChainRow
_KINDS = {"tree_leaf": TreeLeafRow, "chain": ChainRow}
_KIND_OF = {cls: kind for kind, cls in _KINDS.items()}
_REQUIRED = {cls: [f.name for f in fields(cls) if f.default is MISSING] for cls in _KINDS.values()}


def to_extra_field(row: SPORow) -> dict[str, Any]:
    return {"kind": _KIND_OF[type(row)], **asdict(row)}


def _kind(value: Mapping[str, Any]) -> type:
    if "kind" in value:
        if value["kind"] not in _KINDS:
            raise SPOMetadataMissingError(f"SPO metadata of unknown kind {value['kind']!r} (known: {sorted(_KINDS)})")
        return _KINDS[value["kind"]]
    # Rows written by hand (the benchmarks', the test harness's) may omit the kind: recognised by their fields.
    if "path" in value or "segment_ends" in value:
        return TreeLeafRow
    if "segment_starts" in value or "boundary_values" in value:
        return ChainRow
    raise SPOMetadataMissingError(
        f"a row's SPO metadata has neither a tree leaf's 'path'/'segment_ends' nor a chain's "
        f"'segment_starts'/'boundary_values' (got keys {sorted(value)})")


def from_extra_field(value: Any) -> SPORow | None:
    """A trajectory's metadata as written by an agent loop (a dict), or None for a row without any."""
    if value is None or isinstance(value, (TreeLeafRow, ChainRow)):
        return value
    if not isinstance(value, Mapping):
        raise SPOMetadataMissingError(f"a row's SPO metadata is a {type(value).__name__}, not a mapping")
    cls = _kind(value)
    for name in _REQUIRED[cls]:
        if name not in value:
            raise SPOMetadataMissingError(f"{'spo_tree' if cls is TreeLeafRow else 'spo_chain'}: a row's SPO "
                                          f"metadata has no '{name}' (got keys {sorted(value)})")
    known = {f.name for f in fields(cls)}
    row = {key: item for key, item in value.items() if key in known}
    if row.get("tree") is not None:
        row["tree"] = _statistics(CutpointTreeStatistics if "forks" in row["tree"] else TreeStatistics, row["tree"])
    if row.get("chain") is not None:
        row["chain"] = _statistics(ChainStatistics, row["chain"])
    return cls(**row)


def episode_to_extra_field(statistics: EpisodeStatistics) -> dict[str, Any]:
    return asdict(statistics)


def episode_from_extra_field(value: Any) -> EpisodeStatistics | None:
    """An episode's statistics as an agent loop wrote them, or None for a row that is no episode (or a
    copy that trains nothing)."""
    return None if value is None else _statistics(EpisodeStatistics, value)


def _statistics(cls: type, value: Any):
    if isinstance(value, cls):
        return value
    missing = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING and f.name not in value]
    if missing:
        raise SPOMetadataMissingError(f"a row's {cls.__name__} has no {missing} (got keys {sorted(value)})")
    return cls(**{f.name: value[f.name] for f in fields(cls) if f.name in value})
