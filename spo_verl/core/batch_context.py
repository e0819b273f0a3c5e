"""Hands per-trajectory SPO metadata from a trainer adapter to the registered estimators: the package's
one side channel, and why it is one.

verl 0.9.1 calls an advantage estimator with rewards, masks, uids and ``config`` only, and keeps only the
advantages it returns. A trainer adapter therefore collects the rollout's metadata
(``extra_fields["spo"]`` of each trajectory) in batch order and calls verl's own advantage step inside
``provide_spo_rows(rows)``; the estimator reads the rows from this context and leaves what the trainer
needs back (the mask of tokens to train, the tree's node values for the sample log, metrics) on the same
object. A verl whose advantage step hands estimators the batch's per-sample fields and takes extra
outputs back (proposed upstream: verl-project/verl pull request 7473) would remove this module: the
estimators would take the rows as an argument and return the rest.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from spo_verl.core.config import SPOSettings
from spo_verl.core.metadata import SPORow, from_extra_field

# verl's upsample_batch_to_divisible_size names the synthetic rows it pads a batch with "pad<hex>",
# builds them all from one template and copies the first sample's extra_fields into them.
PADDING_UID_PREFIX = "pad"


def is_padding_uid(uid: Any) -> bool:
    """Whether a row is one of verl's synthetic padding rows (its metadata, if any, is a copy)."""
    return str(uid).startswith(PADDING_UID_PREFIX)


@dataclass
class TreeNodes:
    """What the ``spo_tree`` estimator computed for every node of the batch's forest, for the sample log.

    ``tree_ids``/``paths`` are the estimator's per-row inputs (None for rows it skipped); the forest
    built from them (``spo_verl.core.algorithms.tree_rows.build_forest``) numbers the nodes that
    ``values``/``advantages`` are indexed by."""

    tree_ids: list[Any]
    paths: list[list[int] | None]
    values: torch.Tensor  # (N,)
    advantages: torch.Tensor  # (N,)


@dataclass
class SPOBatchContext:
    rows: list[SPORow | None]
    trained_mask: torch.Tensor | None = None  # (B, T) set by the estimator; None means "train every token"
    metrics: dict[str, float] = field(default_factory=dict)
    tree_nodes: TreeNodes | None = None  # set by the spo_tree estimator
    settings: SPOSettings | None = None  # the trainer's algorithm.spo, parsed once; None: the estimator parses its config

    def __post_init__(self):
        self.rows = [from_extra_field(row) for row in self.rows]  # as written by the agent loops, or already read


_current: contextvars.ContextVar[SPOBatchContext | None] = contextvars.ContextVar("spo_batch_context", default=None)


@contextlib.contextmanager
def provide_spo_rows(rows: Sequence[Any], settings: SPOSettings | None = None) -> Iterator[SPOBatchContext]:
    """Make ``rows`` (one SPO metadata per batch row, as the agent loop wrote it or already read; None
    for rows without any) visible to the estimators, as ``spo_verl.core.metadata`` rows."""
    context = SPOBatchContext(rows=list(rows), settings=settings)
    token = _current.set(context)
    try:
        yield context
    finally:
        _current.reset(token)


def current_spo_context() -> SPOBatchContext | None:
    return _current.get()


_deferred: contextvars.ContextVar[bool] = contextvars.ContextVar("spo_advantages_deferred", default=False)


@contextlib.contextmanager
def advantages_at_actor_update() -> Iterator[None]:
    """verl's legacy ``fit`` runs its advantage step without the batch's SPO metadata; inside this
    context an SPO estimator called without rows returns zeros (a placeholder), and the SPO trainer
    computes the real advantages with the rows when the batch reaches its actor update."""
    token = _deferred.set(True)
    try:
        yield
    finally:
        _deferred.reset(token)


def advantages_deferred() -> bool:
    return _deferred.get()
