"""The paper's claims, each tested by the runs of the grid that bear on it, with a verdict per size (`intervals`)."""

import math
from dataclasses import dataclass, field, replace

import numpy as np

from .intervals import (
    INCOMPLETE,
    MIN_BOOTSTRAP_SEEDS,
    MIN_SEEDS,
    POWER,
    TESTED,
    UNRESOLVED,
    UNTESTED,
    Interval,
    detectable_effect,
    distinct_resamples,
    holm,
    paired_interval,
    verdict,
)
from .metric import LOSS, describe_metric, higher_is_better, oriented
from .scaling import CLAIM_COUNT, MIN_SIZES, ScalingFit
from .summary import SELECTED, VariantSummary
from .variants import PREDICTIONS, VARIANT_GROUPS, VARIANTS

FAMILY_LEVEL = 0.05
SHOWN_MISSING = 6  # runs a row names before "and N more"
# The smallest mean Δ a superiority row may hold (or be contradicted) by, in the metric's units: 0.01 nats is 1 %
# of perplexity and about the seeds' standard deviation of the paired Δ at the miniature's best-measured size
# (4x128, 4.1 M tokens: 0.009 and 0.020); on an accuracy, one point. Below it a difference is negligible however
# many seeds pin it down.
MIN_EFFECT = 0.01
QUANTIZATION_MARGIN = 0.01  # nats of report-half loss: the non-inferiority margin of the quantization rows
SUPERIORITY, NON_INFERIORITY = "superiority", "non-inferiority"  # the families Holm corrects within


@dataclass(frozen=True)
class Thresholds:
    """What a verdict needs beyond its interval: `min_effect`, the floor a superiority row's mean Δ must pass
    (`--min-effect`), and `quantization_margin`, the non-inferiority margin (`--quantization-margin`)."""

    min_effect: float = MIN_EFFECT
    quantization_margin: float = QUANTIZATION_MARGIN

    def __post_init__(self) -> None:
        if not (math.isfinite(self.min_effect) and self.min_effect >= 0):
            raise ValueError(f"--min-effect must be a number >= 0 (the metric's units); got {self.min_effect}")
        if not (math.isfinite(self.quantization_margin) and self.quantization_margin > 0):
            raise ValueError(f"--quantization-margin must be a number of nats > 0; got {self.quantization_margin}")


DEFAULT_THRESHOLDS = Thresholds()


def rule(thresholds: Thresholds, metric: str = LOSS) -> str:
    """How `claims.md` decides: the paragraph before its rows."""
    units = "nats" if metric == LOSS else f"in `{metric}`'s units"
    return (
        "Each variant is taken at its own best learning rate, chosen on the selection half of the held-out blocks "
        "(the lowest mean over the seeds that every rate trained; seeds trained at one rate only, to confirm it, "
        "take no part in the choice and count where that rate is the best), and compared with the other side seed "
        "by seed on the report half: within a seed both started from the same "
        "matrices and read the same batches, so Δ is the measurement. The 95 % interval is Student's t on the "
        "paired differences over seeds. A claim **holds** when the interval excludes 0 on the side the paper "
        f"predicts and the mean Δ lies beyond the floor of {thresholds.min_effect:g} {units} (`--min-effect`: a "
        "smaller mean is negligible however narrow its interval; the floor is on the mean, so the test stays the "
        "test of Δ = 0), is **contradicted** when both hold on the other side, and is **unresolved** otherwise or "
        "when fewer than 3 seeds were paired. An unresolved row whose interval covers 0 states the effect its seeds "
        f"had {POWER * 100:.0f} % power to detect: the true Δ (of either sign) at which the two-sided paired t test "
        "at the 5 % level rejects that often, from the noncentral t with the seeds' own standard deviation taken as "
        "the true one (the interval's half-width is an effect detected only half of the time). A row is "
        "**incomplete** while a run it needs is missing (every learning rate of the grid must have finished or "
        "diverged in every seed for a best rate to count), and **not tested** when the grid lacks the runs. The "
        "scaling claim compares the α of the fits of the scaling table, with no floor; its interval is the "
        f"percentiles of the seed bootstrap, descriptive below {MIN_BOOTSTRAP_SEEDS} seeds (3 seeds have "
        f"{distinct_resamples(3)} distinct resamples), where the row is unresolved. Holm: the same verdicts at a "
        "family-wise error rate of 5 % within each family of rows (adjusted p-value in brackets), one family per "
        f"kind of claim: every row but the quantization rows is in the **{SUPERIORITY}** family (an effect of the "
        "predicted sign)."
    )


@dataclass(frozen=True)
class Claim:
    statement: str
    variants: tuple[str, ...]  # each compared with its reference, as VARIANTS predicts


PAIRED_CLAIMS = (
    Claim("Removing the scale vectors hurts", ("none",)),
    Claim(
        "Decaying input-role scales helps (exempting them hurts)", ("standard-input-exempt", "unified-input-exempt")
    ),
    Claim("Decaying output-role scales hurts", ("unified-output-norm-decayed",)),
    Claim("Branch-specific norm scales help", ("branch",)),
    Claim("Scales on the linear maps' inputs and outputs (placement) help", ("placement",)),
    Claim("The magnitude–direction parametrisation helps", ("magdir",)),
)
LOWEST = "Unified has the lowest terminal loss of the strategies"
QUANTIZES = "Unified quantizes within"  # "… 0.01 nats of standard (int4 weights)"


def quantization_rule(margin: float) -> str:
    """How the quantization rows decide, with their non-inferiority `margin`."""
    return (
        "Quantization rows (`--quantize`): each run's final model is evaluated on the report half unquantized and "
        f"with each scheme's weights; Δ per seed = unified's loss increase − standard's − {margin:g} nats (the "
        "margin, `--quantization-margin`; each at its best learning rate), a non-inferiority test: it **holds** "
        f"when the interval lies below 0 (unified's increase is within {margin:g} nats of standard's), is "
        f"**contradicted** when it lies above (unified's increase exceeds standard's by more than {margin:g} nats), "
        "and is **unresolved** otherwise. A row that holds says nothing about which increase is the smaller. These "
        f"rows are Holm's **{NON_INFERIORITY}** family, corrected apart from the {SUPERIORITY} rows."
    )


SCALING = "Unified scales more favourably than standard"


@dataclass
class ClaimTest:
    claim: str
    size: str  # one size, every size ("all", the scaling claim), or "-" where untested
    runs: str  # the runs compared at their learning rates; what is missing where incomplete; why, if untested
    prediction: str
    expected: str  # "lower" or "higher"
    verdict: str
    differences: dict[int, float] = field(default_factory=dict)  # seed -> Δ
    interval: Interval | None = None
    flags: list[str] = field(default_factory=list)  # best learning rates at an edge of the grid
    holm_p_value: float | None = None
    holm_verdict: str | None = None
    family: str = SUPERIORITY  # the rows Holm corrects it with
    floor: float = 0.0  # the smallest |mean Δ| it may hold or be contradicted by
    detectable_effect: float | None = None  # the |Δ| its seeds had POWER to detect (paired rows, 2 seeds or more)
    reason: str | None = None  # why an unresolved row is, beside its verdict


def claim_verdicts(
    summaries: list[VariantSummary],
    fits: list[ScalingFit],
    sizes: list[str],
    metric: str = LOSS,
    thresholds: Thresholds = DEFAULT_THRESHOLDS,
) -> list[ClaimTest]:
    """Every claim of the paper, at each size of `sizes` where the grid holds its variants (a study of several grids
    may hold some at a few sizes only: a paired claim is tested where both its sides are, the lowest-loss claim
    against the strategies present at each size), then Holm's correction
    within each family of rows tested. The paired claims are judged on `metric` (as `summaries` measured it), its
    direction orienting each prediction, against `thresholds.min_effect`; the scaling claim on the fits of the
    held-out loss; the quantization rows with `thresholds.quantization_margin`."""
    floor = thresholds.min_effect
    chosen = {(s.size, s.variant): s for s in summaries}
    variants = {variant for _, variant in chosen}
    tests = []
    for claim in PAIRED_CLAIMS:
        for name in claim.variants:
            variant = VARIANTS[name]
            both = [size for size in sizes if {(size, name), (size, variant.reference)} <= set(chosen)]
            if both:  # a study of several grids may hold a variant at some sizes only: tested where both sides are
                pairs = [(chosen[size, name], [chosen[size, variant.reference]]) for size in both]
                tests += [_paired(claim.statement, ours, theirs, metric, floor) for ours, theirs in pairs]
            else:
                why = f"needs {name} and {variant.reference}"
                why += " at one size" if {name, variant.reference} <= variants else ""
                tests.append(_untested(claim.statement, why, oriented(variant.expected, metric)))
    strategies = [v for v in VARIANT_GROUPS["strategies"] if v != "unified"]
    lowest_sizes = [s for s in sizes if (s, "unified") in chosen and any((s, v) in chosen for v in strategies)]
    for size in lowest_sizes:  # the strategies present at the size, each named in the row
        others = [chosen[size, v] for v in strategies if (size, v) in chosen]
        tests.append(_paired(LOWEST, chosen[size, "unified"], others, metric, floor))
    if not lowest_sizes:
        tests.append(_untested(LOWEST, "needs unified and another strategy", oriented("lower", metric)))
    tests += _quantization(chosen, sizes, thresholds.quantization_margin)
    tests.append(_scaling(chosen, fits, sizes))
    _correct(tests)
    return tests


def _paired(
    statement: str, ours: VariantSummary, theirs: list[VariantSummary], metric: str, floor: float
) -> ClaimTest:
    """`ours` against its reference (`theirs`: one, Δ as `summarise` paired it), or, for the lowest-loss claim,
    unified against the best of the other strategies in `metric` in each seed."""
    lowest = statement == LOWEST
    expected = oriented("lower" if lowest else VARIANTS[ours.variant].expected, metric)
    compared = [ours, *theirs]
    runs = (
        f"{_at(ours)} − "
        + (f"the {'highest' if higher_is_better(metric) else 'lowest'} of " if lowest else "")
        + ", ".join(_at(s) for s in theirs)
    )
    missing = [f"{s.variant} {run}" for s in compared for run in s.missing]
    if missing:
        return ClaimTest(statement, ours.size, _missing(missing), PREDICTIONS[expected], expected, INCOMPLETE)
    selected = [s for s in theirs if s.status == SELECTED]  # the lowest-loss claim goes on without the others
    if ours.status != SELECTED or not selected:
        unselectable = ", ".join(s.variant for s in compared if s.status != SELECTED)
        why = f"{unselectable}: no learning rate finished with a selection loss (diverged or not evaluated)"
        return ClaimTest(statement, ours.size, why, PREDICTIONS[expected], expected, UNTESTED)
    differences = _from_best(ours, selected, higher_is_better(metric)) if lowest else ours.differences
    flags = [f"{s.variant}: {s.edge}" for s in compared if s.edge]
    return _test(statement, ours.size, runs, expected, differences, flags, floor)


def _from_best(unified: VariantSummary, others: list[VariantSummary], highest: bool) -> dict[int, float]:
    """Seed -> unified's report figure minus the best of `others`' in that seed (the lowest, or the `highest`)."""
    ours = unified.report_losses
    losses = [other.report_losses for other in others]
    best = max if highest else min
    return {
        seed: loss - best(other[seed] for other in losses)
        for seed, loss in ours.items()
        if all(seed in o for o in losses)
    }


def _quantization(chosen: dict[tuple[str, str], VariantSummary], sizes: list[str], margin: float) -> list[ClaimTest]:
    """Per scheme any run was quantized with, per size: unified's loss increase against standard's plus `margin`,
    on the loss whatever --metric is (none without --quantize)."""
    schemes = sorted({scheme for s in chosen.values() for scheme in s.quantization_increase})
    tests = []
    for scheme, size in ((scheme, size) for scheme in schemes for size in sizes):
        statement = f"{QUANTIZES} {margin:g} nats of standard ({scheme} weights)"
        if not {(size, "unified"), (size, "standard")} <= set(chosen):
            tests.append(_untested(statement, "needs unified and standard", "lower", family=NON_INFERIORITY))
            continue
        ours, theirs = chosen[size, "unified"], chosen[size, "standard"]
        if missing := [f"{s.variant} {run}" for s in (ours, theirs) for run in s.missing]:
            missing_runs = _missing(missing)
            incomplete = ClaimTest(statement, size, missing_runs, PREDICTIONS["lower"], "lower", INCOMPLETE)
            tests.append(replace(incomplete, family=NON_INFERIORITY))
            continue
        if ours.status != SELECTED or theirs.status != SELECTED:
            why = "unified or standard: no learning rate finished with a selection loss"
            tests.append(_untested(statement, why, "lower", family=NON_INFERIORITY, size=size))
            continue
        unified, standard = (s.quantization_increase.get(scheme, {}) for s in (ours, theirs))
        differences = {seed: unified[seed] - standard[seed] - margin for seed in unified if seed in standard}
        runs = (
            f"{scheme} loss increase of {_at(ours)} − that of {_at(theirs)} − {margin:g} "
            "(non-inferiority margin), report half"
        )
        flags = [f"{s.variant}: {s.edge}" for s in (ours, theirs) if s.edge]
        tests.append(_test(statement, size, runs, "lower", differences, flags, 0.0, NON_INFERIORITY))
    return tests


def _scaling(chosen: dict, fits: list[ScalingFit], sizes: list[str]) -> ClaimTest:
    def untested(why: str) -> ClaimTest:
        return _untested(SCALING, why, "higher", "Δα > 0")

    if len(sizes) < MIN_SIZES:
        return untested(f"needs {MIN_SIZES} sizes or more; the grid has {len(sizes)}")
    if not all(any((size, v) in chosen for size in sizes) for v in ("unified", "standard")):
        return untested("needs unified and standard")
    # a study of several grids: the sizes that hold both, and only if neither is fitted over other sizes as well
    held = {v: [size for size in sizes if (size, v) in chosen] for v in ("unified", "standard")}
    if held["unified"] != held["standard"] or len(held["unified"]) < MIN_SIZES:
        both = [size for size in held["unified"] if size in held["standard"]]
        return untested(f"needs unified and standard at the same {MIN_SIZES} sizes or more; they share {len(both)}")
    sizes = held["unified"]
    sides = [chosen[size, v] for size in sizes for v in ("unified", "standard")]
    if missing := [f"{s.size} {s.variant} {run}" for s in sides for run in s.missing]:
        return ClaimTest(SCALING, "all", _missing(missing), "Δα > 0", "higher", INCOMPLETE)
    found = {fit.variant: fit for fit in fits if fit.counted == CLAIM_COUNT}
    if not {"unified", "standard"} <= set(found):
        return untested("no fit of unified and standard at every size (a size without a best learning rate)")
    unified, standard = found["unified"], found["standard"]
    replicates = np.array(unified.replicate_alphas) - np.array(standard.replicate_alphas)
    low, high = np.percentile(replicates, [2.5, 97.5]).tolist()
    beyond = min(int(np.sum(replicates <= 0)), int(np.sum(replicates >= 0)))  # on the far side of 0
    p_value = min(1.0, 2 * (beyond + 1) / (len(replicates) + 1))
    interval = Interval(len(unified.seeds), unified.alpha - standard.alpha, low, high, p_value)
    runs = (
        f"α of E + A·N^-α ({CLAIM_COUNT} parameters) over sizes {', '.join(sizes)}, each at its best learning rate: "
        f"unified {unified.alpha:.4f} − standard {standard.alpha:.4f}; seed bootstrap"
    )
    flags = [f"{s.size} {s.variant}: {s.edge}" for s in sides if s.edge]
    pinned = [f"{fit.variant}'s α = {fit.alpha_bound:g}" for fit in (unified, standard) if fit.alpha_bound is not None]
    if pinned:  # an α on a bound of the search is not measured, nor is its interval
        runs += f"; {' and '.join(pinned)}, a bound of the fit: α not measured"
    seeds = len(unified.seeds)
    if seeds < MIN_BOOTSTRAP_SEEDS:  # too few resamples for the percentiles to be an interval
        reason = f"a descriptive bootstrap; needs {MIN_BOOTSTRAP_SEEDS} seeds"
    elif pinned:
        reason = "an α on a bound of the fit"
    else:
        reason = None
    judged = UNRESOLVED if reason else verdict(interval, "higher")
    test = ClaimTest(SCALING, "all", runs, "Δα > 0", "higher", judged, {}, interval, flags)
    test.reason = reason or ("the interval covers 0" if judged == UNRESOLVED else None)
    return test


def _missing(runs: list[str]) -> str:
    more = len(runs) - SHOWN_MISSING
    return "missing: " + ", ".join(runs[:SHOWN_MISSING]) + (f" and {more} more" if more > 0 else "")


def _at(summary: VariantSummary) -> str:
    rate = "-" if summary.best_learning_rate is None else f"{summary.best_learning_rate:g}"
    return f"{summary.variant} (lr {rate})"


def _test(claim, size, runs, expected, differences, flags, floor, family=SUPERIORITY) -> ClaimTest:
    if not differences:
        why = f"{runs}: no seed with both report losses"
        return ClaimTest(claim, size, why, PREDICTIONS[expected], expected, UNTESTED, family=family)
    interval = paired_interval(list(differences.values()))
    result = verdict(interval, expected, floor=floor)
    test = ClaimTest(claim, size, runs, PREDICTIONS[expected], expected, result, differences, interval, flags)
    test.family, test.floor = family, floor
    test.detectable_effect = None if interval.n < 2 else detectable_effect(interval)
    if result != UNRESOLVED:
        return test
    n = interval.n
    if n < MIN_SEEDS:
        test.reason = f"{n} seed{'s' * (n > 1)}; needs {MIN_SEEDS}"
    elif interval.low > 0 or interval.high < 0:  # significant, but the mean is within the floor
        test.reason = f"mean Δ {interval.mean:+.4f} within the ±{floor:g} floor"
    else:
        test.reason = f"{POWER * 100:.0f} % power only for Δ beyond ±{test.detectable_effect:.4f}"
    return test


def _untested(
    claim: str, why: str, expected: str, prediction: str | None = None, family: str = SUPERIORITY, size: str = "-"
) -> ClaimTest:
    return ClaimTest(claim, size, why, prediction or PREDICTIONS[expected], expected, UNTESTED, family=family)


def _correct(tests: list[ClaimTest]) -> None:
    """Holm's adjusted p-value and verdict on every tested row (those with an interval), within its family."""
    for family in (SUPERIORITY, NON_INFERIORITY):
        tested = [t for t in tests if t.verdict in TESTED and t.family == family]
        for test, adjusted in zip(tested, holm([t.interval.p_value for t in tested])):
            test.holm_p_value = adjusted
            judged = verdict(test.interval, test.expected, significant=adjusted < FAMILY_LEVEL, floor=test.floor)
            test.holm_verdict = UNRESOLVED if test.verdict == UNRESOLVED else judged  # e.g. a pinned α


def claims_markdown(
    tests: list[ClaimTest], grid: str, runs: list[str], metric: str = LOSS, thresholds: Thresholds = DEFAULT_THRESHOLDS
) -> str:
    """`claims.md`: `runs`, the lines that say which runs finished, diverged and are missing, lead; then the rule
    (with `thresholds`) and the metric the rows are judged on."""
    tested = [t for t in tests if t.verdict in TESTED]
    counts = {v: sum(t.verdict == v for t in tests) for v in (*TESTED, INCOMPLETE, UNTESTED)}
    tally = ", ".join(f"{count} {name}" for name, count in counts.items())
    families = {f: sum(t.family == f for t in tested) for f in (SUPERIORITY, NON_INFERIORITY)}
    within = ", ".join(f"{family} over its {count}" for family, count in families.items() if count)
    quantized = any(t.claim.startswith(QUANTIZES) for t in tests)
    rows = [
        "# The paper's claims, tested by this grid",
        "",
        f"Grid: {grid}.",
        "",
        *runs,
        "",
        rule(thresholds, metric),
        "",
        describe_metric(metric),
        "",
        *([quantization_rule(thresholds.quantization_margin), ""] if quantized else []),
        f"Rows: {len(tests)}, of which {len(tested)} tested ({tally}); Holm's correction is within each family: "
        f"{within or 'none tested'}.",
        "",
        "| claim | size | runs compared (learning rate) | prediction | Δ per seed | mean Δ [95 % interval] | verdict "
        "| Holm in its family (adjusted p) | learning-rate grid |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for t in tests:
        differences = ", ".join(f"{seed}: {d:+.4f}" for seed, d in t.differences.items()) or "-"
        holm_cell = "-" if t.holm_verdict is None else f"{t.holm_verdict} ({t.holm_p_value:.3g})"
        interval = interval_text(t.interval)
        if t.claim == SCALING and t.interval is not None and t.interval.n < MIN_BOOTSTRAP_SEEDS:
            interval += f" (descriptive: {t.interval.n} seeds, {distinct_resamples(t.interval.n)} resamples)"
        verdict_cell = t.verdict if t.reason is None else f"{t.verdict} ({t.reason})"
        rows.append(
            f"| {t.claim} | {t.size} | {t.runs} | {t.prediction} | {differences} | {interval} "
            f"| {verdict_cell} | {holm_cell} | {'; '.join(t.flags) or '-'} |"
        )
    return "\n".join(rows) + "\n"


def interval_text(interval: Interval | None) -> str:
    if interval is None:
        return "-"
    if interval.n < 2:
        return f"{interval.mean:+.4f} (1 seed)"
    return f"{interval.mean:+.4f} [{interval.low:+.4f}, {interval.high:+.4f}]"
