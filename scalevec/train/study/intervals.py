"""Verdicts with intervals. A claim's measurement is a set of paired differences Δ, one per seed; its 95 % interval
is Student's t on those differences (mean ± t(0.975, n-1) · s / √n), its p-value the two-sided paired t-test's,
and its verdict one of:

- *holds*: the interval excludes 0 on the side the paper predicts;
- *contradicted*: it excludes 0 on the other side;
- *unresolved*: it covers 0 (its half-width is the smallest effect these seeds could resolve), or fewer than
  `MIN_SEEDS` seeds were paired, whatever their signs;
- *incomplete*: runs the comparison needs are missing (the row names them): never a verdict from a partial sweep;
- *not tested*: the grid holds no runs for it.

Many rows are tested at once, so beside each row's verdict stands the same verdict at a family-wise error rate of
5 % over every tested row (Holm's step-down correction of the p-values)."""

import math
import statistics
from dataclasses import dataclass

from scipy import stats

LEVEL = 0.95
MIN_SEEDS = 3
HOLDS, CONTRADICTED, UNRESOLVED = "holds", "contradicted", "unresolved"
INCOMPLETE, UNTESTED = "incomplete", "not tested"
TESTED = (HOLDS, CONTRADICTED, UNRESOLVED)


@dataclass
class Interval:
    """A measured effect: its mean, 95 % interval (NaN bounds with fewer than 2 values) and two-sided p-value."""

    n: int
    mean: float
    low: float
    high: float
    p_value: float

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2


def paired_interval(differences: list[float]) -> Interval:
    """Student's t interval and paired t-test of `differences` (at least one)."""
    n, mean = len(differences), statistics.fmean(differences)
    if n < 2:
        return Interval(n, mean, math.nan, math.nan, 1.0)
    error = statistics.stdev(differences) / math.sqrt(n)
    half = float(stats.t.ppf((1 + LEVEL) / 2, n - 1)) * error
    if error == 0:
        return Interval(n, mean, mean, mean, 1.0 if mean == 0 else 0.0)
    p_value = float(2 * stats.t.sf(abs(mean) / error, n - 1))
    return Interval(n, mean, mean - half, mean + half, p_value)


def verdict(interval: Interval, expected: str, significant: bool | None = None) -> str:
    """HOLDS, CONTRADICTED or UNRESOLVED for an effect the paper predicts to be `expected` ("lower": Δ < 0,
    "higher": Δ > 0); `significant` overrides whether the interval excludes 0 (as a corrected p-value decides)."""
    if interval.n < MIN_SEEDS:
        return UNRESOLVED
    excludes = interval.low > 0 or interval.high < 0 if significant is None else significant
    if not excludes or interval.mean == 0:
        return UNRESOLVED
    return HOLDS if (interval.mean < 0) == (expected == "lower") else CONTRADICTED


def holm(p_values: list[float]) -> list[float]:
    """Holm's adjusted p-values, in the order given: the k-th smallest of m times (m - k + 1), made monotone."""
    order = sorted(range(len(p_values)), key=lambda k: p_values[k])
    adjusted, running = [1.0] * len(p_values), 0.0
    for rank, k in enumerate(order):
        running = max(running, min(1.0, (len(p_values) - rank) * p_values[k]))
        adjusted[k] = running
    return adjusted
