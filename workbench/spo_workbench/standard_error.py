"""The mean of a sample and its standard error (sample standard deviation / sqrt(n)): over seeds, over
problems or over paired differences, wherever the tools report an uncertainty."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence


def standard_error(values: Sequence[float]) -> float | None:
    """None under two values: one value has no spread to estimate."""
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) >= 2 else None


def mean_and_se(values: Sequence[float]) -> tuple[float | None, float | None]:
    return (statistics.fmean(values) if values else None), standard_error(values)
