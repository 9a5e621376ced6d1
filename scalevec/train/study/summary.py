"""Each (size, variant) at its best learning rate, and its paired differences to its reference at the reference's
best learning rate, seed by seed.

The best learning rate is chosen on the selection half of the held-out blocks (`eval_select_loss`: lowest mean over
the seeds that every rate of the grid trained) and every difference is measured on the other, disjoint half
(`eval_report_loss`), so that the number reported is not the one the choice was made by. Seeds that a grid trains at
one rate only (to confirm a chosen rate with more seeds) take no part in the choice, and count in the differences
where that rate is the best. A rate at which any seed diverged, or whose selection loss is missing or not finite in
any seed that chooses, loses the choice. A variant is at its best rate only when every learning rate of
the grid finished or diverged in every seed of the grid (in a study of several grids, of the grids that hold that
size and variant); until then it is *incomplete* and names what is missing.
A best rate at either end of the grid is flagged: the true optimum may lie beyond it."""

import statistics
from collections import defaultdict
from dataclasses import dataclass, field

from .grid import Grid
from .metric import LOSS, oriented
from .records import DIVERGED, FINISHED, MISSING, RunRecord
from .variants import VARIANTS

Key = tuple[str, str]  # (size, variant)
SELECTED, INCOMPLETE, NONE_SELECTABLE = "selected", "incomplete", "no rate selectable"


@dataclass
class LearningRateResult:
    learning_rate: float
    finished: list[int]  # seeds
    diverged: list[int]
    missing: list[int]
    select_loss_mean: float | None  # over the seeds every rate trained, where each finished with a finite one
    report_loss_mean: float | None  # over the seeds that finished with a finite report loss
    report_loss_std: float | None  # sample standard deviation; None with fewer than two seeds


@dataclass
class VariantSummary:
    """One variant at one size: every learning rate, and the best one with its runs' figures."""

    size: str
    variant: str
    status: str  # SELECTED, INCOMPLETE or NONE_SELECTABLE
    missing: list[str]  # the runs still missing ("lr 0.01 seed 1"), when INCOMPLETE
    learning_rates: list[LearningRateResult]  # every learning rate of the grid, in the order given
    best_learning_rate: float | None = None
    edge: str | None = None  # "extend the grid above 0.01" where the best rate is the grid's highest, ...
    report_loss_mean: float | None = None
    report_loss_std: float | None = None
    report_losses: dict[int, float] = field(default_factory=dict)  # seed -> report loss at the best rate
    train_loss_mean: float | None = None
    reference: str | None = None
    reference_learning_rate: float | None = None  # the reference's own best learning rate
    differences: dict[int, float] = field(default_factory=dict)  # seed -> report loss minus the reference's
    expected: str | None = None
    quantization_increase: dict[str, dict[int, float]] = field(default_factory=dict)  # scheme -> seed -> increase


def by_learning_rate(records: list[RunRecord]) -> dict[Key, dict[float, list[RunRecord]]]:
    """(size, variant) -> learning rate -> its runs (whole runs only), in the order of the seeds (a study's added
    seeds may be recorded before the first ones), which every row and table lists them in."""
    grouped = defaultdict(lambda: defaultdict(list))
    for record in sorted(records, key=lambda r: r.seed):
        if record.budget is None:
            grouped[record.size, record.variant][record.learning_rate].append(record)
    return grouped


def _rate_result(learning_rate: float, runs: list[RunRecord], metric: str, choosing: set[int]) -> LearningRateResult:
    """One rate's runs; its selection loss over the seeds in `choosing` (those every rate of the grid trained)."""

    def seeds(status: str) -> list[int]:
        return [r.seed for r in runs if r.status == status]

    select = [r.eval_select_loss for r in runs if r.seed in choosing]
    report = [r.figure(metric) for r in runs if r.status == FINISHED and r.figure(metric) is not None]
    selectable = all(r.status == FINISHED for r in runs) and None not in select
    return LearningRateResult(
        learning_rate=learning_rate,
        finished=seeds(FINISHED),
        diverged=seeds(DIVERGED),
        missing=seeds(MISSING),
        select_loss_mean=statistics.fmean(select) if selectable and runs else None,
        report_loss_mean=statistics.fmean(report) if report else None,
        report_loss_std=statistics.stdev(report) if len(report) > 1 else None,
    )


def select(
    size: str, variant: str, rates: dict[float, list[RunRecord]], grid: Grid, metric: str = LOSS
) -> VariantSummary:
    """The best learning rate of one (size, variant) on the selection half, or why there is none; its figures in
    `metric`."""
    tried = grid.learning_rates_of(size, variant)
    choosing = set.intersection(*({r.seed for r in rates.get(lr, [])} for lr in tried))
    results = [_rate_result(lr, rates.get(lr, []), metric, choosing) for lr in tried]
    missing = [f"lr {r.learning_rate:g} seed {seed}" for r in results for seed in r.missing]
    summary = VariantSummary(size, variant, INCOMPLETE if missing else NONE_SELECTABLE, missing, results)
    candidates = [r for r in results if r.select_loss_mean is not None]
    if missing or not candidates:
        return summary
    best = min(candidates, key=lambda r: r.select_loss_mean)  # the first of equals, in the grid's order
    runs = rates[best.learning_rate]
    summary.status, summary.best_learning_rate = SELECTED, best.learning_rate
    summary.edge = edge_flag(best.learning_rate, tried)
    summary.report_loss_mean, summary.report_loss_std = best.report_loss_mean, best.report_loss_std
    summary.report_losses = report_losses(runs, metric)
    summary.quantization_increase = quantization_increase(runs)
    trained = [r.train_loss for r in runs if r.train_loss is not None]
    summary.train_loss_mean = statistics.fmean(trained) if trained else None
    return summary


def edge_flag(best: float, rates: list[float]) -> str | None:
    """What to do when the best rate lies at an end of the grid (the optimum may lie beyond it); None inside."""
    if len(rates) == 1:
        return "one learning rate only: not tuned"
    if best == max(rates):
        return f"extend the grid above {best:g}"
    if best == min(rates):
        return f"extend the grid below {best:g}"
    return None


def best_runs(records: list[RunRecord], summaries: list[VariantSummary]) -> dict[Key, list[RunRecord]]:
    """(size, variant) -> its runs at its best learning rate, for the variants with one."""
    grouped = by_learning_rate(records)
    return {
        (s.size, s.variant): grouped[s.size, s.variant][s.best_learning_rate]
        for s in summaries
        if s.status == SELECTED
    }


def report_losses(runs: list[RunRecord], metric: str = LOSS) -> dict[int, float]:
    """Seed -> the runs' `metric` (for the held-out loss, its report half)."""
    return {r.seed: r.figure(metric) for r in runs if r.figure(metric) is not None}


def quantization_increase(runs: list[RunRecord]) -> dict[str, dict[int, float]]:
    """Scheme -> seed -> the report-half loss of the run's final model with that scheme's weights minus without
    (both evaluated after training, `--quantize`)."""
    increases = defaultdict(dict)
    for r in runs:
        base = r.quantized_report_loss.get("none")
        for scheme, loss in r.quantized_report_loss.items():
            if scheme != "none" and base is not None and loss is not None:
                increases[scheme][r.seed] = loss - base
    return dict(sorted(increases.items()))


def paired_differences(variant: list[RunRecord], reference: list[RunRecord], metric: str = LOSS) -> dict[int, float]:
    """Seed -> `metric` (the report-half loss by default) of `variant` minus that of `reference`, over the seeds
    both have."""
    ours, theirs = report_losses(variant, metric), report_losses(reference, metric)
    return {seed: loss - theirs[seed] for seed, loss in ours.items() if seed in theirs}


def summarise(records: list[RunRecord], grid: Grid, metric: str = LOSS) -> list[VariantSummary]:
    """Per size and variant that `grid` holds (a union of grids: not every pair), in its order, each over the
    learning rates of the grids that hold it; `records`: every point's (`grid_records`); losses and
    differences in `metric` (`study.metric`), each variant's prediction as its sign."""
    grouped = by_learning_rate(records)
    summaries = [
        select(size.name, variant, grouped.get((size.name, variant), {}), grid, metric)
        for size in grid.sizes
        for variant in grid.variants
        if grid.holds(size.name, variant)
    ]
    best = best_runs(records, summaries)
    chosen = {(s.size, s.variant): s for s in summaries}
    for s in summaries:
        variant = VARIANTS[s.variant]
        reference = chosen.get((s.size, variant.reference))
        if s.status == SELECTED and reference is not None and reference.status == SELECTED:
            s.reference, s.reference_learning_rate = variant.reference, reference.best_learning_rate
            s.differences = paired_differences(best[s.size, s.variant], best[s.size, variant.reference], metric)
            s.expected = oriented(variant.expected, metric)
    return summaries
