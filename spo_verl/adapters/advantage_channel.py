"""The one channel between verl's advantage step and SPO's estimators, and why there is one.

verl 0.9.1 calls an advantage estimator with rewards, masks, uids and ``config`` only, and keeps only the
advantages it returns. A trainer adapter therefore collects the rollout's metadata (``extra_fields["spo"]``
of each trajectory) in batch order and calls verl's own advantage step inside ``provide_spo_rows(rows,
settings)``. A registered SPO estimator asks this channel for its call (:func:`estimator_call`: the rows
it computes and the run's settings, or None while the legacy trainer defers the step), computes with the
core's maths and records what it found besides the advantages (:func:`record_result`: the mask of tokens
to train, the tree's node values for the sample log, metrics) on the channel's :class:`SPOBatchContext`,
where the trainer reads it. The channel calls no estimator code, and nothing else reads it.

A verl whose advantage step hands estimators the batch's per-sample fields and takes extra outputs back
(proposed upstream: verl-project/verl pull request 7473) would remove this module: the estimators would
take the rows as an argument and return the rest.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from spo_verl.core.config import SPOSettings
from spo_verl.core.metadata import SPO_FIELD, SPOMetadataMissingError, SPORow, TreeLeafRow, from_extra_field
from spo_verl.adapters.settings import spo_settings

# verl's upsample_batch_to_divisible_size names the synthetic rows it pads a batch with "pad<hex>",
# builds them all from one template and copies the first sample's extra_fields into them.
PADDING_UID_PREFIX = "pad"


def is_padding_uid(uid: Any) -> bool:
    """Whether a row is one of verl's synthetic padding rows (its metadata, if any, is a copy): the one
    rule by which the plugin tells them apart."""
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


@dataclass(frozen=True)
class EstimatorCall:
    """What the channel hands an SPO estimator besides verl's arguments: the batch's SPO rows (None for
    the rows it skips: verl's padding, rows trained elsewhere) and the run's settings."""

    rows: list[SPORow | None]
    settings: SPOSettings


@dataclass
class EstimatorResult:
    """What an SPO estimator computed: the advantages for verl and what the trainer reads after verl's
    advantage step. ``trained_mask`` (bs, response_length): the tokens the loss keeps, None for
    every response token."""

    advantages: torch.Tensor  # (bs, response_length)
    trained_mask: torch.Tensor | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    tree_nodes: TreeNodes | None = None


@dataclass
class SPOBatchContext:
    """One advantage step's channel: the rows and settings the trainer hands in, and the estimator's
    result once it has recorded it (:func:`record_result`; None before, or for a step verl computed alone)."""

    rows: list[SPORow | None]
    settings: SPOSettings | None = None  # the trainer's algorithm.spo; None: taken from verl's ``config`` argument
    result: EstimatorResult | None = None

    def __post_init__(self):
        self.rows = [from_extra_field(row) for row in self.rows]  # as written by the agent loops, or already read

    @property
    def trained_mask(self) -> torch.Tensor | None:
        return self.result.trained_mask if self.result is not None else None

    @property
    def metrics(self) -> dict[str, float]:
        return self.result.metrics if self.result is not None else {}

    @property
    def tree_nodes(self) -> TreeNodes | None:
        return self.result.tree_nodes if self.result is not None else None


_current: contextvars.ContextVar[SPOBatchContext | None] = contextvars.ContextVar("spo_batch_context", default=None)
_deferred: contextvars.ContextVar[bool] = contextvars.ContextVar("spo_advantages_deferred", default=False)


@contextlib.contextmanager
def provide_spo_rows(rows: Sequence[Any], settings: SPOSettings | None = None) -> Iterator[SPOBatchContext]:
    """Make ``rows`` (one SPO metadata per batch row, as the agent loop wrote it or already read; None
    for rows without any) and ``settings`` visible to the estimators during verl's advantage step."""
    context = SPOBatchContext(rows=list(rows), settings=settings)
    token = _current.set(context)
    try:
        yield context
    finally:
        _current.reset(token)


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


def missing_metadata(estimator: str) -> SPOMetadataMissingError:
    return SPOMetadataMissingError(
        f"algorithm.adv_estimator={estimator} needs the per-response SPO metadata (extra_fields['{SPO_FIELD}']) "
        f"that the '{estimator}' agent loop produces and the SPO trainer hands to the estimator. Set "
        f"actor_rollout_ref.rollout.agent.default_agent_loop={estimator} and launch through the SPO recipe "
        f"(python -m recipe.spo.main_spo, or scripts/run_{estimator}.sh), which installs that trainer."
    )


def _estimated_rows(estimator: str, row_type: type, context: SPOBatchContext, batch_size: int,
                    index: Any) -> list[SPORow | None]:
    """The context's rows the estimator computes, None for verl's padding rows and the legacy trainer's
    stand-in copies of early-stopped leaves; an error where the rows do not fit the batch or the
    estimator."""
    rows = context.rows
    if len(rows) != batch_size:
        raise ValueError(f"{estimator}: {len(rows)} metadata rows for a batch of {batch_size}")
    padding = [is_padding_uid(uid) for uid in index] if index is not None else [False] * batch_size
    rows = [None if pad or row is None or (isinstance(row, TreeLeafRow) and not row.trains) else row
            for row, pad in zip(rows, padding)]
    wrong = next((b for b, row in enumerate(rows) if row is not None and not isinstance(row, row_type)), None)
    if wrong is not None:
        raise SPOMetadataMissingError(f"{estimator}: row {wrong} carries {type(rows[wrong]).__name__} metadata; "
                                      f"algorithm.adv_estimator and the agent loop must name the same algorithm")
    if batch_size and all(row is None for row in rows) and not all(padding):
        raise missing_metadata(estimator)
    return rows


def estimator_call(estimator: str, row_type: type, batch_size: int, index: Any,
                   config: Any) -> EstimatorCall | None:
    """A registered SPO estimator's call from verl (``index``, ``config``: verl's arguments): the channel's
    rows it computes (``row_type`` each) and the settings (the trainer's, else read from ``config``).
    None while the legacy trainer defers the step (:func:`advantages_at_actor_update`): the estimator
    then gives verl zeros. Raises where no trainer opened the channel."""
    context = _current.get()
    if context is None:
        if _deferred.get():
            return None
        raise missing_metadata(estimator)
    rows = _estimated_rows(estimator, row_type, context, batch_size, index)
    return EstimatorCall(rows, context.settings if context.settings is not None else spo_settings(config))


def record_result(result: EstimatorResult) -> None:
    """What the estimator computed on the call :func:`estimator_call` gave it, for the trainer to read."""
    _current.get().result = result
