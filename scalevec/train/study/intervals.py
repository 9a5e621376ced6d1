"""Verdicts with intervals. A claim's measurement is a set of paired differences Δ, one per seed; its 95 % interval
is Student's t on those differences (mean ± t(0.975, n-1) · s / √n), its p-value the two-sided paired t-test's,
and its verdict one of:

- *holds*: the interval excludes 0 on the side the paper predicts and the mean lies beyond the row's floor (the
  smallest effect that counts, `--min-effect`; 0 where the row has none);
- *contradicted*: the same on the other side;
- *unresolved*: it covers 0, or its mean is within the floor, or fewer than `MIN_SEEDS` seeds were paired, whatever
  their signs. Where the interval covers 0 the row states the effect its seeds had 80 % power to detect
  (`detectable_effect`); the interval's half-width is only the effect they detect half of the time;
- *incomplete*: runs the comparison needs are missing (the row names them): never a verdict from a partial sweep;
- *not tested*: the grid holds no runs for it.

Many rows are tested at once, so beside each row's verdict stands the same verdict at a family-wise error rate of
5 % within its family of rows (Holm's step-down correction of the p-values).

A percentile bootstrap over fewer than `MIN_BOOTSTRAP_SEEDS` seeds is descriptive, not a 95 % interval: n seeds have
only C(2n-1, n) distinct resamples (10 for 3 seeds), too few for its percentiles to have that coverage."""

import math
import statistics
from dataclasses import dataclass

from scipy import optimize, stats

LEVEL = 0.95
POWER = 0.8
MIN_SEEDS = 3
MIN_BOOTSTRAP_SEEDS = 5
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


def detectable_effect(interval: Interval, power: float = POWER) -> float:
    """The true |Δ| at which the two-sided paired t test at level 1 - LEVEL over `interval.n` seeds rejects with
    probability `power`, the seeds' own standard deviation taken as the true one: exact, from the noncentral t
    (the approximation (t(1 - α/2, n-1) + t(power, n-1)) · s / √n falls 5 % short at 3 seeds). NaN below 2 seeds."""
    if interval.n < 2:
        return math.nan
    freedom, critical = interval.n - 1, float(stats.t.ppf((1 + LEVEL) / 2, interval.n - 1))
    error = interval.half_width / critical  # s / √n
    if error == 0:
        return 0.0

    def shortfall(shift: float) -> float:  # both tails; sf at -shift is the lower one, stable where cdf is not
        return float(stats.nct.sf(critical, freedom, shift) + stats.nct.sf(critical, freedom, -shift)) - power

    upper = critical + float(stats.t.ppf(power, freedom))
    while shortfall(upper) < 0:
        upper *= 2
    return optimize.brentq(shortfall, 0.0, upper, xtol=1e-12) * error


def distinct_resamples(seeds: int) -> int:
    """How many different samples with replacement `seeds` seeds have (multisets of their size)."""
    return math.comb(2 * seeds - 1, seeds)


def bootstrap_caveat(seeds: int) -> str:
    """The sentence that calls a seed bootstrap's intervals descriptive below `MIN_BOOTSTRAP_SEEDS` seeds; "" from
    there on."""
    if seeds >= MIN_BOOTSTRAP_SEEDS:
        return ""
    return (
        f"Over {seeds} seed{'s' * (seeds != 1)} these intervals are descriptive, not 95 % intervals: {seeds} "
        f"seed{'s' * (seeds != 1)} have {distinct_resamples(seeds)} distinct resamples (a seed bootstrap is read as "
        f"an interval from {MIN_BOOTSTRAP_SEEDS} seeds, {distinct_resamples(MIN_BOOTSTRAP_SEEDS)} resamples, on)."
    )


def verdict(interval: Interval, expected: str, significant: bool | None = None, floor: float = 0.0) -> str:
    """HOLDS, CONTRADICTED or UNRESOLVED for an effect the paper predicts to be `expected` ("lower": Δ < 0,
    "higher": Δ > 0); `significant` overrides whether the interval excludes 0 (as a corrected p-value decides);
    a mean within `floor` of 0 is UNRESOLVED however significant."""
    if interval.n < MIN_SEEDS:
        return UNRESOLVED
    excludes = interval.low > 0 or interval.high < 0 if significant is None else significant
    if not excludes or abs(interval.mean) <= floor:
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
