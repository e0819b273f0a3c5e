"""Student's t distribution without scipy (which the project does not install): its distribution function
and quantiles, for the intervals the studies and the gradient measurement report."""

from __future__ import annotations

import math


def _t_pdf(x: float, df: int) -> float:
    log_norm = math.lgamma((df + 1) / 2) - math.lgamma(df / 2) - 0.5 * math.log(df * math.pi)
    return math.exp(log_norm - (df + 1) / 2 * math.log1p(x * x / df))


def t_cdf(x: float, df: int, intervals: int = 2000) -> float:
    """Student-t distribution function (Simpson's rule on the density from 0 to |x|)."""
    if x == 0:
        return 0.5
    h = abs(x) / intervals
    total = _t_pdf(0, df) + _t_pdf(abs(x), df)
    total += sum((4 if i % 2 else 2) * _t_pdf(i * h, df) for i in range(1, intervals))
    half = total * h / 3
    return 0.5 + half if x > 0 else 0.5 - half


def t_quantile(p: float, df: int) -> float:
    """The ``p`` quantile of Student's t with ``df`` degrees of freedom (bisection on :func:`t_cdf`)."""
    if not 0 < p < 1 or df < 1:
        raise ValueError(f"need 0 < p < 1 and df >= 1, got p={p}, df={df}")
    low, high = -1e3, 1e3
    for _ in range(100):
        middle = (low + high) / 2
        low, high = (middle, high) if t_cdf(middle, df) < p else (low, middle)
    return (low + high) / 2
