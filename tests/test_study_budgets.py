"""Loss against tokens and the fit of L(N, D) = E + A·N^-α + B·D^-β (scalevec/train/study/budgets.py), on synthetic
ladders with known parameters: exact recovery without noise, the truth inside the seed-bootstrap intervals with
noise, and "not tested" where sizes or budgets are too few to say anything."""

import math
import statistics

import numpy as np
import pytest

from scalevec.train.study.budgets import (
    FITTED,
    NOT_TESTED,
    BudgetRow,
    fit_surface,
    fit_surfaces,
    fits_markdown,
    loss_table,
    markdown_table,
)

TRUTH = {"E": 2.0, "A": 60.0, "alpha": 0.3, "B": 120.0, "beta": 0.25}
SIZES = [2e5, 6e5, 2e6, 6e6, 2e7]
FRACTIONS = (0.25, 0.5, 1.0)


def ladder(
    sizes=SIZES, fractions=FRACTIONS, seeds=range(5), noise: float = 0.0, variant: str = "unified", truth=TRUTH
) -> list[BudgetRow]:
    """Every size trained to 20 tokens a parameter with budgets at `fractions` of it, each seed's loss off the
    law by a factor exp(noise · standard normal) (a generator seeded by 1)."""
    generator = np.random.default_rng(1)
    rows = []
    for index, n in enumerate(sizes):
        for fraction in fractions:
            tokens = int(20 * n * fraction)
            law = truth["E"] + truth["A"] * n ** -truth["alpha"] + truth["B"] * tokens ** -truth["beta"]
            for seed in seeds:
                loss = law * math.exp(noise * generator.standard_normal())
                rows.append(BudgetRow(variant, f"size{index}", int(n), tokens, seed, loss, fraction))
    return rows


def test_the_fit_recovers_a_noiseless_law_exactly():
    fit = fit_surface(ladder(seeds=[0]))
    assert fit.status == FITTED and fit.at_bound == []
    for name, value in TRUTH.items():
        assert fit.estimates[name] == pytest.approx(value, rel=1e-3), name
    assert fit.rms_log_residual < 1e-6
    assert fit.intervals == {} and "1 seed(s), the bootstrap over seeds needs 3 or more" in fit.reason


def test_the_bootstrap_intervals_over_seeds_hold_the_true_exponents():
    """1 % noise on each run's loss, 5 seeds: α and β fall inside their 95 % intervals, which are narrow enough to
    tell α from β's neighbourhood (a law with α off by 0.1 would be outside)."""
    fit = fit_surface(ladder(noise=0.01), resamples=100)
    assert fit.status == FITTED and (fit.points, fit.sizes, fit.seeds, fit.resamples) == (75, 5, 5, 100)
    for name in ("alpha", "beta", "E"):
        low, high = fit.intervals[name]
        assert low < TRUTH[name] < high, (name, low, high)
        assert low <= fit.estimates[name] <= high
    for name in ("alpha", "beta"):
        low, high = fit.intervals[name]
        assert high - low < 0.15 and not low < TRUTH[name] + 0.1 < high and not low < TRUTH[name] - 0.1 < high
    text = fits_markdown({"unified": fit})
    alpha_low, alpha_high = fit.intervals["alpha"]
    assert f"α = {fit.estimates['alpha']:.4g} [{alpha_low:.4g}, {alpha_high:.4g}]" in text
    assert "75 points, 5 sizes, 5 seeds" in text and "100 resamples" in text


def test_resampling_is_over_seeds_not_points():
    """Each seed's runs off the law by one factor 1 + δ, δ one of -0.04, -0.02, 0, 0.02, 0.04: that scales E, A and
    B, not the exponents. The Huber loss at residuals this far above δ = 1e-3 is nearly an absolute loss, so E comes
    out near 2 × (1 + the median δ of the sample). Resampling the 5 seeds, that median is ±0.04 often enough for
    the 95 % interval of E to reach 2 × (1 ± 0.04), 0.16 wide. Resampling the 75 points instead drops whole cells
    of (N, D) from some samples, where E is not identified: its interval then ran from the search's bound 0.001 to
    2.38 on this ladder."""
    offsets = {seed: 1 + 0.02 * (seed - 2) for seed in range(5)}
    shifted = [BudgetRow(**{**row.__dict__, "loss": row.loss * offsets[row.seed]}) for row in ladder()]
    fit = fit_surface(shifted, resamples=100)
    low, high = fit.intervals["E"]
    assert 0.12 < high - low < 0.2
    low, high = fit.intervals["alpha"]
    assert low - 1e-4 < TRUTH["alpha"] < high + 1e-4 and high - low < 2e-3


def test_an_irreducible_loss_at_the_bound_of_the_search_is_named():
    """Without an irreducible loss (E = 0) the fit puts E on the search's lower bound, 0.001, and says so."""
    fit = fit_surface(ladder(seeds=[0], truth={**TRUTH, "E": 0.0}))
    assert fit.at_bound == ["E"] and fit.estimates["E"] == pytest.approx(1e-3)
    assert fit.estimates["alpha"] == pytest.approx(TRUTH["alpha"], abs=0.01)
    text = fits_markdown({"unified": fit})
    assert "E = 0.001; A = " in text and "at a bound of the search, without an interval: E" in text


def test_a_term_the_fit_drops_is_named():
    """A loss of tokens alone, B·D^-β (as the miniature's ladder gave, its tokens a fixed multiple of N at every
    budget): the fit drives A·N^-α to nothing and says that A and α are not measured, printing neither (any values
    that keep the term below 1e-4 nats fit alike), where the full law's drops nothing."""
    assert fit_surface(ladder(seeds=[0])).vanished == []
    fit = fit_surface(ladder(seeds=[0], truth={**TRUTH, "A": 0.0, "E": 0.0}))
    assert fit.vanished == ["N"] and fit.estimates["beta"] == pytest.approx(TRUTH["beta"], abs=0.01)
    text = fits_markdown({"unified": fit})
    assert "the N term is below 0.0001 nats at every point: its A and α are not measured" in text
    assert (
        "**unified**: E = 0.001; B = " in text and "A =" not in text and "α =" not in text
    )  # only what is determined


@pytest.mark.parametrize(
    "sizes, fractions, expected",
    [
        (SIZES[:3], FRACTIONS, "has 3 (budgets per size: size0: 3, size1: 3, size2: 3)"),
        (SIZES, (0.5, 1.0), "has 0 (budgets per size: size0: 2, size1: 2, size2: 2, size3: 2, size4: 2)"),
    ],
)
def test_fewer_than_four_sizes_of_three_budgets_is_not_tested(sizes, fractions, expected):
    fit = fit_surface(ladder(sizes=sizes, fractions=fractions))
    assert fit.status == NOT_TESTED and fit.estimates == {}
    assert fit.reason == f"needs 4 sizes with 3 budgets or more each; {expected}"
    assert f"- **unified**: not tested ({fit.reason})" in fits_markdown({"unified": fit})


def test_fits_are_per_variant_and_one_variant_at_a_time():
    rows = ladder(seeds=[0]) + ladder(sizes=SIZES[:2], seeds=[0], variant="none")
    fits = fit_surfaces(rows, resamples=10)
    assert list(fits) == ["unified", "none"]
    assert (fits["unified"].status, fits["none"].status) == (FITTED, NOT_TESTED)
    with pytest.raises(ValueError, match="fit_surface fits one variant at a time; got none, unified"):
        fit_surface(rows)


def test_the_loss_table_gives_each_size_and_budget_its_mean_over_seeds():
    rows = ladder(sizes=SIZES[:2], seeds=[0, 1, 2], noise=0.01) + ladder(sizes=SIZES[:1], seeds=[0], variant="none")
    table = loss_table(rows)
    assert [(g.variant, g.size, g.fraction) for g in table[:4]] == [
        ("none", "size0", 0.25),
        ("unified", "size0", 0.25),
        ("none", "size0", 0.5),
        ("unified", "size0", 0.5),
    ]
    text = markdown_table(rows).splitlines()
    assert text[0] == "| size | N | budget | tokens | tokens / N | unified | none |"
    losses = [r.loss for r in rows if (r.variant, r.size, r.fraction) == ("unified", "size1", 0.5)]
    mean, spread = statistics.mean(losses), statistics.stdev(losses)
    assert f"| size1 | 600,000 | 0.5 | 6,000,000 | 10 | {mean:.4f} ± {spread:.4f} (3) | – |" in text
    alone = next(r.loss for r in rows if r.variant == "none" and r.fraction == 1.0)
    assert text[4].startswith("| size0 | 200,000 | 1 | 4,000,000 | 20 |") and text[4].endswith(f"| {alone:.4f} (1) |")
    assert markdown_table([]) == "No budgets with an eval loss: nothing to tabulate."
