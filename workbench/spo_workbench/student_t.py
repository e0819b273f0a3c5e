"""Student's t distribution without scipy (which the project does not install): its distribution function
and quantiles, for the intervals the studies and the gradient measurement report."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass


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


def detectable_difference(se: float, pairs: int, level: float, power: float = 0.8) -> float:
    """The smallest true difference a two-sided paired t test at ``level`` finds with ``power``, from its
    standard error: ``(t_(level) + t_(power)) * se`` with ``pairs - 1`` degrees of freedom (the usual
    approximation; :func:`paired_t_power` is the exact noncentral-t power)."""
    df = pairs - 1
    return (t_quantile(1 - (1 - level) / 2, df) + t_quantile(power, df)) * se


def _normal_cdf(x: float) -> float:
    return 0.5 * math.erfc(-x / math.sqrt(2))


def paired_t_power(pairs: int, difference: float, sd: float, level: float = 0.975, grid: int = 2000) -> float:
    """The power of the two-sided paired t test at confidence ``level`` with ``pairs`` pairs, when the true
    mean difference is ``difference`` and the differences' standard deviation ``sd``: P(|T| > t_crit) for
    T noncentral t with pairs - 1 degrees of freedom and noncentrality difference sqrt(pairs) / sd, by
    integrating the normal numerator over the chi-square denominator (Simpson's rule would add nothing at
    this grid)."""
    df = pairs - 1
    shift = difference * math.sqrt(pairs) / sd
    critical = t_quantile(1 - (1 - level) / 2, df)
    top = df + 12 * math.sqrt(2 * df) + 20  # the chi-square density is negligible beyond
    step = top / grid
    log_norm = (df / 2) * math.log(2) + math.lgamma(df / 2)
    total = 0.0
    for i in range(1, grid):
        v = i * step
        density = math.exp((df / 2 - 1) * math.log(v) - v / 2 - log_norm)
        scale = math.sqrt(v / df)
        total += density * ((1 - _normal_cdf(critical * scale - shift)) + _normal_cdf(-critical * scale - shift))
    return total * step


def pairs_needed(difference: float, sd: float, level: float = 0.975, power: float = 0.8) -> int:
    """The fewest pairs whose paired t test at ``level`` detects ``difference`` with ``power`` (exact
    noncentral t), searched from the normal approximation's count ``((z + z) sd / difference)^2``."""
    z = statistics.NormalDist().inv_cdf
    pairs = max(2, round(((z(1 - (1 - level) / 2) + z(power)) * sd / difference) ** 2))
    while paired_t_power(pairs, difference, sd, level) < power:
        pairs += 1
    while pairs > 2 and paired_t_power(pairs - 1, difference, sd, level) >= power:
        pairs -= 1
    return pairs


@dataclass(frozen=True)
class PairedInterval:
    """The mean of paired differences (``n`` of them, one a ``unit``: a prompt, a seed), its standard
    error, a two-sided Student-t interval at ``level`` and the smallest difference found with 80 % power
    at that level; below two pairs only the mean (None with none)."""
    n: int
    mean: float | None
    se: float | None
    low: float | None
    high: float | None
    detectable: float | None
    level: float
    unit: str = "pairs"

    @property
    def verdict(self) -> str:
        """The declared reading: better (interval above 0), worse (below), or not resolved."""
        if self.low is None:
            return f"not resolved (too few {self.unit})"
        return "better" if self.low > 0 else "worse" if self.high < 0 else "not resolved"


def paired_interval(differences: Sequence[float], level: float = 0.95, unit: str = "pairs") -> PairedInterval:
    values = [float(d) for d in differences]
    if len(values) < 2:
        mean = values[0] if values else None
        return PairedInterval(len(values), mean, None, None, None, None, level, unit)
    mean = statistics.fmean(values)
    se = statistics.stdev(values) / math.sqrt(len(values))
    half = t_quantile(1 - (1 - level) / 2, len(values) - 1) * se
    return PairedInterval(len(values), mean, se, mean - half, mean + half,
                          detectable_difference(se, len(values), level), level, unit)
