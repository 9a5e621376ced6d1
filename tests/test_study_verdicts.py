"""The verdicts as a reviewer reads them: an unresolved row states the effect its seeds had 80 % power to detect, a
mean under the `--min-effect` floor never holds, the quantization margin is a flag stated in each row, Holm's
correction runs within each family of claims, and a seed bootstrap over fewer than 5 seeds is called descriptive.
Synthetic records, no training."""

import json
import math
from itertools import combinations_with_replacement

import numpy as np
import pytest
from scipy import stats

from scalevec.train import ablate
from scalevec.train.study.budgets import FITTED, SurfaceFit, fits_markdown
from scalevec.train.study.claims import (
    DEFAULT_THRESHOLDS,
    LOWEST,
    NON_INFERIORITY,
    QUANTIZES,
    SCALING,
    SUPERIORITY,
    Thresholds,
    claim_verdicts,
    claims_markdown,
)
from scalevec.train.study.intervals import bootstrap_caveat, distinct_resamples
from scalevec.train.study.report import write_report
from scalevec.train.study.summary import summarise

from ._helpers import train_argv
from .test_study import REMOVING, synthetic_grid, synthetic_records, verdicts


def paired(effects: list[float], variants=("none", "standard")):
    """A grid of one size whose first variant's report loss exceeds the reference's by `effects[seed]`."""
    grid = synthetic_grid(variants=variants, seeds=tuple(range(len(effects))))

    def outcome(point):
        return 3.0, 3.0 + (effects[point.seed] if point.variant == "none" else 0.0), 3.0

    return grid, synthetic_records(grid, outcome)


def row_text(test, thresholds: Thresholds = DEFAULT_THRESHOLDS) -> str:
    return claims_markdown([test], "synthetic", [], thresholds=thresholds).splitlines()[-1]


def test_an_unresolved_row_states_the_effect_its_seeds_had_80_percent_power_to_detect():
    effects = [0.06, -0.02, 0.01]
    grid, records = paired(effects)
    test = verdicts(records, grid)[REMOVING, "1x16"]
    assert test.verdict == "unresolved" and test.interval.low < 0 < test.interval.high
    n, spread = len(effects), float(np.std(effects, ddof=1))
    critical = stats.t.ppf(0.975, n - 1)
    # the power of the two-sided paired t test at that effect, from the noncentral t's distribution function
    shift = test.detectable_effect / (spread / math.sqrt(n))
    power = 1 - stats.nct.cdf(critical, n - 1, shift) + stats.nct.cdf(-critical, n - 1, shift)
    assert power == pytest.approx(0.8, abs=1e-6)
    # and by simulation: seeds drawn with that mean and spread, tested as the row is, reject 80 % of the time
    samples = np.random.default_rng(0).normal(test.detectable_effect, spread, size=(40_000, n))
    assert np.mean(stats.ttest_1samp(samples, 0.0, axis=1).pvalue < 0.05) == pytest.approx(0.8, abs=0.01)
    # the (t + t) approximation falls short by about 5 % at 3 seeds; the half-width is far below (about 50 % power)
    approximation = (critical + stats.t.ppf(0.8, n - 1)) * spread / math.sqrt(n)
    assert test.detectable_effect / approximation == pytest.approx(1.054, abs=0.002)
    assert test.interval.half_width < 0.8 * test.detectable_effect
    assert f"| unresolved (80 % power only for Δ beyond ±{test.detectable_effect:.4f}) |" in row_text(test)
    assert "could resolve" not in claims_markdown([test], "synthetic", [])


@pytest.mark.parametrize("sign, verdict", [(+1, "holds"), (-1, "contradicted")])
def test_a_difference_under_the_floor_neither_holds_nor_contradicts(sign, verdict):
    grid, records = paired([sign * e for e in (0.0003, 0.0002, 0.0004, 0.0003)])
    summaries = summarise(records, grid)
    test = next(t for t in claim_verdicts(summaries, [], ["1x16"]) if t.claim == REMOVING)
    assert test.interval.low > 0 or test.interval.high < 0  # the interval excludes 0: only the floor decides
    assert (test.verdict, test.holm_verdict, test.floor) == ("unresolved", "unresolved", 0.01)
    assert f"| unresolved (mean Δ {sign * 0.0003:+.4f} within the ±0.01 floor) |" in row_text(test)
    unfloored = Thresholds(min_effect=0)
    test = next(t for t in claim_verdicts(summaries, [], ["1x16"], thresholds=unfloored) if t.claim == REMOVING)
    assert (test.verdict, test.holm_verdict) == (verdict, verdict)


def test_the_floor_is_on_the_mean_not_on_the_interval():
    grid, records = paired([0.005, 0.02, 0.012, 0.015])
    test = verdicts(records, grid)[REMOVING, "1x16"]
    assert 0 < test.interval.low < 0.01 < test.interval.mean and test.verdict == "holds"
    raised = Thresholds(min_effect=0.02)
    test = next(
        t for t in claim_verdicts(summarise(records, grid), [], ["1x16"], thresholds=raised) if t.claim == REMOVING
    )
    assert test.verdict == "unresolved" and "floor of 0.02 nats (`--min-effect`" in claims_markdown(
        [test], "synthetic", [], thresholds=raised
    )


def quantized(extra: list[float]):
    """none, standard and unified, unified 0.1 below standard in every seed, its int4 and int8 increases above
    standard's by `extra[seed]`; the none − standard difference grows with the seed."""
    grid = synthetic_grid(variants=("none", "standard", "unified"), seeds=tuple(range(len(extra))))

    def outcome(point):
        shift = {"none": 0.2 + 0.03 * point.seed, "standard": 0.0, "unified": -0.1 - 0.02 * (point.seed % 2)}
        return 3.0, 3.2 + shift[point.variant], 3.0

    records = synthetic_records(grid, outcome)
    for r in records:
        increase = 0.05 + (extra[r.seed] if r.variant == "unified" else 0.0)
        r.quantized_report_loss = {"none": 3.2, "int4": 3.2 + increase, "int8": 3.2 + increase / 2}
    return grid, records


def test_the_quantization_margin_is_a_flag_stated_in_each_row_and_it_decides(tmp_path, capsys):
    grid, records = quantized([0.015, 0.016, 0.014, 0.015])
    summaries = summarise(records, grid)
    for margin, verdict in ((0.01, "contradicted"), (0.02, "holds")):
        thresholds = Thresholds(quantization_margin=margin)
        tests = claim_verdicts(summaries, [], ["1x16"], thresholds=thresholds)
        row = next(t for t in tests if t.claim == f"{QUANTIZES} {margin:g} nats of standard (int4 weights)")
        assert row.verdict == verdict and f"− {margin:g} (non-inferiority margin)" in row.runs
        assert row.differences == pytest.approx({s: e - margin for s, e in enumerate([0.015, 0.016, 0.014, 0.015])})
        text = claims_markdown(tests, "synthetic", [], thresholds=thresholds)
        assert f"(unified's increase is within {margin:g} nats of standard's)" in text
        assert f"| Unified quantizes within {margin:g} nats of standard (int4 weights) | 1x16 |" in text
    # through the command: a report of these records with both flags
    root = tmp_path / "study"
    write_report(records, grid, root, figures=False, budget_fits=False)
    argv = ["--sizes", "1x16", "--variants", "none,standard,unified", "--seeds", "0,1,2,3"]
    argv += ["--learning-rates", "0.001,0.003", "--report-only", "true"]
    argv += train_argv(root, "--config-overrides", "{}", "--max-eval-documents", "2", "--scale-stats", "false")
    assert ablate.main([*argv, "--quantization-margin", "0.02", "--min-effect", "0.5"]) == 0
    claims = (root / "claims.md").read_text()
    assert "| Unified quantizes within 0.02 nats of standard (int4 weights) | 1x16 |" in claims
    assert "floor of 0.5 nats (`--min-effect`" in claims
    # none − standard is 0.2 to 0.29 nats: significant, but under a 0.5 floor
    assert f"| {REMOVING} | 1x16 |" in claims and "within the ±0.5 floor) |" in claims
    capsys.readouterr()
    before = (root / "claims.md").read_bytes()
    for flag, value, message in (
        ("--min-effect", "-1", "--min-effect must be a number >= 0 (the metric's units); got -1.0"),
        ("--quantization-margin", "0", "--quantization-margin must be a number of nats > 0; got 0.0"),
        ("--min-effect", "nan", "--min-effect must be a number >= 0 (the metric's units); got nan"),
    ):
        assert ablate.main([*argv, flag, value]) == 1
        assert message in capsys.readouterr().err
    assert (root / "claims.md").read_bytes() == before


def holm_by_hand(p_values: list[float]) -> list[float]:
    """Holm's step-down adjustment written out for the families here (two rows each)."""
    assert len(p_values) == 2
    low, high = sorted(p_values)
    adjusted = {low: min(1.0, 2 * low), high: max(min(1.0, 2 * low), min(1.0, high))}
    return [adjusted[p] for p in p_values]


def test_holm_corrects_each_family_of_claims_apart():
    grid, records = quantized([0.001, -0.002, 0.0, 0.002])
    tests = [t for t in claim_verdicts(summarise(records, grid), [], ["1x16"]) if t.verdict != "not tested"]
    families = {SUPERIORITY: [REMOVING, LOWEST], NON_INFERIORITY: [f"{QUANTIZES} 0.01 nats of standard"] * 2}
    for family, prefixes in families.items():
        rows = [t for t in tests if t.family == family]
        assert len(rows) == 2 and all(t.claim.startswith(p) for t, p in zip(rows, prefixes))
        p_values = [stats.ttest_1samp(list(t.differences.values()), 0.0).pvalue for t in rows]
        assert [t.interval.p_value for t in rows] == pytest.approx(p_values, rel=1e-9)
        assert [t.holm_p_value for t in rows] == pytest.approx(holm_by_hand(p_values), rel=1e-9)
    # one family of four would have multiplied the smallest p-value by 4, not 2
    smallest = min(tests, key=lambda t: t.interval.p_value)
    assert smallest.holm_p_value == pytest.approx(2 * smallest.interval.p_value)
    text = claims_markdown(tests, "synthetic", [])
    assert "Holm's correction is within each family: superiority over its 2, non-inferiority over its 2." in text
    assert "Holm's **non-inferiority** family, corrected apart from the superiority rows" in text


def test_a_seed_bootstrap_over_fewer_than_5_seeds_is_descriptive(tmp_path):
    assert [distinct_resamples(n) for n in (1, 2, 3, 4, 5)] == [
        len(set(combinations_with_replacement(range(n), n))) for n in (1, 2, 3, 4, 5)
    ]
    assert distinct_resamples(3) == 10 and bootstrap_caveat(5) == ""
    sizes = ("1x16", "1x32", "2x32", "2x64", "4x64")
    grid = synthetic_grid(sizes=sizes, variants=("standard", "unified"), rates=(1e-3,), seeds=(0, 1, 2))
    alphas = {"standard": 0.3, "unified": 0.45}

    def outcome(point):  # unified's α clearly larger: the bootstrap's percentiles exclude 0 and still decide nothing
        n = 2 * grid.size(point.size).non_embedding_parameters
        loss = (2.0 + 40.0 * n ** -alphas[point.variant]) * (1 + 2e-3 * ((point.seed + sizes.index(point.size)) % 3))
        return loss, loss, loss

    results, claims = write_report(synthetic_records(grid, outcome), grid, tmp_path, figures=False, budget_fits=False)
    scaling = next(c for c in json.loads((tmp_path / "results.json").read_text())["claims"] if c["claim"] == SCALING)
    assert scaling["interval"]["low"] > 0 and scaling["verdict"] == scaling["holm_verdict"] == "unresolved"
    row = next(line for line in claims.splitlines() if line.startswith(f"| {SCALING} | all |"))
    assert "(descriptive: 3 seeds, 10 resamples) | unresolved (a descriptive bootstrap; needs 5 seeds) |" in row
    scaling_section = results[results.index("## Scaling") :]
    assert "Over 3 seeds these intervals are descriptive, not 95 % intervals: 3 seeds have 10 distinct" in (
        scaling_section
    )
    estimates = {"E": 2.0, "A": 40.0, "alpha": 0.3, "B": 100.0, "beta": 0.3}
    fit = SurfaceFit("unified", FITTED, estimates=estimates, intervals={k: (v, v) for k, v in estimates.items()})
    fit.points, fit.sizes, fit.seeds, fit.resamples, fit.rms_log_residual = 60, 4, 3, 200, 1e-3
    assert "Over 3 seeds these intervals are descriptive" in fits_markdown({"unified": fit})
    fit.seeds = 5
    assert "descriptive" not in fits_markdown({"unified": fit})
