"""The paper's claims, each tested by the runs of the grid that bear on it, with a verdict per size (`intervals`)."""

from dataclasses import dataclass, field

import numpy as np

from .intervals import INCOMPLETE, MIN_SEEDS, TESTED, UNRESOLVED, UNTESTED, Interval, holm, paired_interval, verdict
from .metric import LOSS, describe_metric, higher_is_better, oriented
from .scaling import CLAIM_COUNT, MIN_SIZES, ScalingFit
from .summary import SELECTED, VariantSummary
from .variants import PREDICTIONS, VARIANT_GROUPS, VARIANTS

FAMILY_LEVEL = 0.05
SHOWN_MISSING = 6  # runs a row names before "and N more"
RULE = (
    "Each variant is taken at its own best learning rate, chosen on the selection half of the held-out blocks, and "
    "compared with the other side seed by seed on the report half: within a seed both started from the same "
    "matrices and read the same batches, so Δ is the measurement. The 95 % interval is Student's t on the paired "
    "differences over seeds. A claim **holds** when the interval excludes 0 on the side the paper predicts, is "
    "**contradicted** when it excludes 0 on the other side, and is **unresolved** when it covers 0 (the row gives "
    "its half-width: the smallest effect these seeds could resolve) or fewer than 3 seeds were paired. A row is "
    "**incomplete** while a run it needs is missing (every learning rate of the grid must have finished or diverged "
    "in every seed for a best rate to count), and **not tested** when the grid lacks the runs. The scaling claim "
    "compares the α of the fits of the scaling table, its interval the percentiles of the seed bootstrap. Holm: "
    "the same verdicts at a family-wise error rate of 5 % over every tested row (adjusted p-value in brackets)."
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
QUANTIZES = "Unified quantizes as well as standard"
QUANTIZATION_MARGIN = 0.01  # nats of report-half loss: the non-inferiority margin of the quantization rows
QUANTIZATION_RULE = (
    f"Quantization rows (`--quantize`): each run's final model is evaluated on the report half unquantized and with "
    f"each scheme's weights; Δ per seed = unified's loss increase − standard's − {QUANTIZATION_MARGIN} nats (each at "
    "its best learning rate), a non-inferiority test with that margin: it **holds** when the interval lies below 0 "
    f"(unified loses at most {QUANTIZATION_MARGIN} nats more than standard), is **contradicted** when it lies above "
    f"(unified loses more than standard by over {QUANTIZATION_MARGIN}), and is **unresolved** otherwise."
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


def claim_verdicts(
    summaries: list[VariantSummary], fits: list[ScalingFit], sizes: list[str], metric: str = LOSS
) -> list[ClaimTest]:
    """Every claim of the paper, at each size of `sizes` where the grid holds its variants, then Holm's correction
    over the rows tested. The paired claims are judged on `metric` (as `summaries` measured it), its direction
    orienting each prediction; the scaling claim on the fits of the held-out loss."""
    chosen = {(s.size, s.variant): s for s in summaries}
    variants = {variant for _, variant in chosen}
    tests = []
    for claim in PAIRED_CLAIMS:
        for name in claim.variants:
            variant = VARIANTS[name]
            if {name, variant.reference} <= variants:
                pairs = [(chosen[size, name], [chosen[size, variant.reference]]) for size in sizes]
                tests += [_paired(claim.statement, ours, theirs, metric) for ours, theirs in pairs]
            else:
                why = f"needs {name} and {variant.reference}"
                tests.append(_untested(claim.statement, why, oriented(variant.expected, metric)))
    others = [v for v in VARIANT_GROUPS["strategies"] if v != "unified" and v in variants]
    if "unified" in variants and others:
        for size in sizes:
            tests.append(_paired(LOWEST, chosen[size, "unified"], [chosen[size, v] for v in others], metric))
    else:
        tests.append(_untested(LOWEST, "needs unified and another strategy", oriented("lower", metric)))
    tests += _quantization(chosen, sizes)
    tests.append(_scaling(chosen, fits, sizes))
    _correct(tests)
    return tests


def _paired(statement: str, ours: VariantSummary, theirs: list[VariantSummary], metric: str) -> ClaimTest:
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
    return _test(statement, ours.size, runs, expected, differences, flags)


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


def _quantization(chosen: dict[tuple[str, str], VariantSummary], sizes: list[str]) -> list[ClaimTest]:
    """Per scheme any run was quantized with, per size: unified's loss increase against standard's, on the loss
    whatever --metric is (none without --quantize)."""
    schemes = sorted({scheme for s in chosen.values() for scheme in s.quantization_increase})
    tests = []
    for scheme, size in ((scheme, size) for scheme in schemes for size in sizes):
        statement = f"{QUANTIZES} ({scheme} weights)"
        if not {(size, "unified"), (size, "standard")} <= set(chosen):
            tests.append(_untested(statement, "needs unified and standard", "lower"))
            continue
        ours, theirs = chosen[size, "unified"], chosen[size, "standard"]
        if missing := [f"{s.variant} {run}" for s in (ours, theirs) for run in s.missing]:
            tests.append(ClaimTest(statement, size, _missing(missing), PREDICTIONS["lower"], "lower", INCOMPLETE))
            continue
        if ours.status != SELECTED or theirs.status != SELECTED:
            why = "unified or standard: no learning rate finished with a selection loss"
            tests.append(ClaimTest(statement, size, why, PREDICTIONS["lower"], "lower", UNTESTED))
            continue
        unified, standard = (s.quantization_increase.get(scheme, {}) for s in (ours, theirs))
        differences = {
            seed: unified[seed] - standard[seed] - QUANTIZATION_MARGIN for seed in unified if seed in standard
        }
        runs = (
            f"{scheme} loss increase of {_at(ours)} − that of {_at(theirs)} − {QUANTIZATION_MARGIN} "
            "(non-inferiority margin), report half"
        )
        flags = [f"{s.variant}: {s.edge}" for s in (ours, theirs) if s.edge]
        tests.append(_test(statement, size, runs, "lower", differences, flags))
    return tests


def _scaling(chosen: dict, fits: list[ScalingFit], sizes: list[str]) -> ClaimTest:
    def untested(why: str) -> ClaimTest:
        return _untested(SCALING, why, "higher", "Δα > 0")

    if len(sizes) < MIN_SIZES:
        return untested(f"needs {MIN_SIZES} sizes or more; the grid has {len(sizes)}")
    if not all((size, v) in chosen for size in sizes for v in ("unified", "standard")):
        return untested("needs unified and standard")
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
    judged = UNRESOLVED if pinned else verdict(interval, "higher")
    return ClaimTest(SCALING, "all", runs, "Δα > 0", "higher", judged, {}, interval, flags)


def _missing(runs: list[str]) -> str:
    more = len(runs) - SHOWN_MISSING
    return "missing: " + ", ".join(runs[:SHOWN_MISSING]) + (f" and {more} more" if more > 0 else "")


def _at(summary: VariantSummary) -> str:
    rate = "-" if summary.best_learning_rate is None else f"{summary.best_learning_rate:g}"
    return f"{summary.variant} (lr {rate})"


def _test(claim, size, runs, expected, differences, flags) -> ClaimTest:
    if not differences:
        return ClaimTest(
            claim, size, f"{runs}: no seed with both report losses", PREDICTIONS[expected], expected, UNTESTED
        )
    interval = paired_interval(list(differences.values()))
    result = verdict(interval, expected)
    return ClaimTest(claim, size, runs, PREDICTIONS[expected], expected, result, differences, interval, flags)


def _untested(claim: str, why: str, expected: str, prediction: str | None = None) -> ClaimTest:
    return ClaimTest(claim, "-", why, prediction or PREDICTIONS[expected], expected, UNTESTED)


def _correct(tests: list[ClaimTest]) -> None:
    """Holm's adjusted p-value and verdict on every tested row (those with an interval)."""
    tested = [t for t in tests if t.verdict in TESTED]
    for test, adjusted in zip(tested, holm([t.interval.p_value for t in tested])):
        test.holm_p_value = adjusted
        judged = verdict(test.interval, test.expected, significant=adjusted < FAMILY_LEVEL)
        test.holm_verdict = UNRESOLVED if test.verdict == UNRESOLVED else judged  # a pinned α stays unresolved


def claims_markdown(tests: list[ClaimTest], grid: str, runs: list[str], metric: str = LOSS) -> str:
    """`claims.md`: `runs`, the lines that say which runs finished, diverged and are missing, lead; then the rule
    and the metric the rows are judged on."""
    tested = [t for t in tests if t.verdict in TESTED]
    counts = {v: sum(t.verdict == v for t in tests) for v in (*TESTED, INCOMPLETE, UNTESTED)}
    tally = ", ".join(f"{count} {name}" for name, count in counts.items())
    rows = [
        "# The paper's claims, tested by this grid",
        "",
        f"Grid: {grid}.",
        "",
        *runs,
        "",
        RULE,
        "",
        describe_metric(metric),
        "",
        *([QUANTIZATION_RULE, ""] if any(t.claim.startswith(QUANTIZES) for t in tests) else []),
        f"Rows: {len(tests)}, of which {len(tested)} tested ({tally}); Holm's correction is over those {len(tested)}.",
        "",
        "| claim | size | runs compared (learning rate) | prediction | Δ per seed | mean Δ [95 % interval] | verdict "
        "| Holm (adjusted p) | learning-rate grid |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for t in tests:
        differences = ", ".join(f"{seed}: {d:+.4f}" for seed, d in t.differences.items()) or "-"
        holm_cell = "-" if t.holm_verdict is None else f"{t.holm_verdict} ({t.holm_p_value:.3g})"
        rows.append(
            f"| {t.claim} | {t.size} | {t.runs} | {t.prediction} | {differences} | {interval_text(t.interval)} "
            f"| {_verdict_text(t)} | {holm_cell} | {'; '.join(t.flags) or '-'} |"
        )
    return "\n".join(rows) + "\n"


def interval_text(interval: Interval | None) -> str:
    if interval is None:
        return "-"
    if interval.n < 2:
        return f"{interval.mean:+.4f} (1 seed)"
    return f"{interval.mean:+.4f} [{interval.low:+.4f}, {interval.high:+.4f}]"


def _verdict_text(test: ClaimTest) -> str:
    if test.verdict != UNRESOLVED:
        return test.verdict
    if test.interval.n < MIN_SEEDS:
        return f"{UNRESOLVED} ({test.interval.n} seed{'s' * (test.interval.n > 1)}; needs {MIN_SEEDS})"
    return f"{UNRESOLVED} (resolves ±{test.interval.half_width:.4f})"
