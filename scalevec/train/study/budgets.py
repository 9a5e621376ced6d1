"""Loss against tokens: the budgets that `--decay-at` branches from each run, a table of them per size, and a fit
of L(N, D) = E + A·N^-α + B·D^-β over sizes and budgets, with bootstrap intervals.

The fit is the study's one Huber fit of log L (`huber.py`), every run at every budget a point, E searched from 1e-3
to e^5. Its intervals resample seeds, not points: a seed's
runs share their data order and initial weights, so its points are not independent. With fewer than 4 sizes of 3
budgets each the fit is "not tested"; with fewer than 3 seeds it has no interval. Pure functions over `BudgetRow`s,
apart from `read_budgets`, which reads a run folder's budgets."""

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ...run_records import BRANCH_PREFIX, finished_step, read_run_records
from .huber import PowerLawData, estimates, fit_power_laws, log_residuals, on_bound, search_bounds
from .intervals import MIN_BOOTSTRAP_SEEDS, bootstrap_caveat

MIN_SIZES, MIN_BUDGETS = 4, 3  # sizes with at least MIN_BUDGETS budgets each
MIN_SEEDS_FOR_INTERVALS = 3
VANISHED = 1e-4  # nats: a term smaller at every point is reported as dropped by the fit
RESAMPLES = 200
FITTED, NOT_TESTED = "fitted", "not tested"
PARAMETERS = ("E", "A", "alpha", "B", "beta")
_FLOOR = (1e-3, math.exp(5.0))  # the search's bounds on E; a fit that ends on one of its bounds is reported


@dataclass(frozen=True)
class BudgetRecord:
    """One budget of a run folder: the run itself (fraction 1) or a branch of it (`budget-F`)."""

    fraction: float
    tokens: int
    eval_loss: float | None
    output_dir: str


@dataclass(frozen=True)
class BudgetRow:
    """One run's loss at one budget: a point of the fit."""

    variant: str
    size: str
    non_embedding_parameters: int
    tokens: int
    seed: int
    loss: float
    fraction: float = 1.0


def read_budgets(run_folder: str | Path, metric: str = "eval_loss") -> list[BudgetRecord]:
    """The finished budgets of the run in `run_folder`, fewest tokens first: each finished `budget-F` branch and
    the run itself (fraction 1) where it finished; tokens as the run counted them, the final eval metric `metric`
    (e.g. the loss on the held-out half the report uses; None where it was not evaluated)."""
    run_folder = Path(run_folder)
    folders = [(1.0, run_folder)]
    for branch in run_folder.glob(f"{BRANCH_PREFIX}*"):
        try:
            folders.append((float(branch.name.removeprefix(BRANCH_PREFIX)), branch))
        except ValueError:  # not a branch of --decay-at: someone's own folder
            continue
    budgets = []
    for fraction, folder in folders:
        if finished_step(folder, 0) is None:
            continue
        records = read_run_records(folder)
        tokens = int((records.summary or {}).get("tokens_seen") or records.state.get("num_input_tokens_seen", 0))
        budgets.append(BudgetRecord(fraction, tokens, records.eval_metrics.get(metric), str(folder)))
    return sorted(budgets, key=lambda budget: budget.tokens)


# --- loss against tokens ----------------------------------------------------------------------------------------


@dataclass
class LossAtBudget:
    """The losses of one variant at one size and budget, over seeds."""

    variant: str
    size: str
    non_embedding_parameters: int
    tokens: int
    fraction: float
    losses: dict[int, float]  # seed -> loss

    @property
    def mean(self) -> float:
        return statistics.mean(self.losses.values())

    @property
    def spread(self) -> float | None:
        """The standard deviation over seeds (None with one seed)."""
        return statistics.stdev(self.losses.values()) if len(self.losses) > 1 else None


def loss_table(rows: list[BudgetRow]) -> list[LossAtBudget]:
    """The rows grouped by variant, size and budget; sizes from the fewest parameters, budgets from the fewest
    tokens."""
    groups: dict[tuple, LossAtBudget] = {}
    for row in rows:
        key = (row.variant, row.size, row.tokens)
        group = groups.setdefault(
            key, LossAtBudget(row.variant, row.size, row.non_embedding_parameters, row.tokens, row.fraction, {})
        )
        group.losses[row.seed] = row.loss
    return sorted(groups.values(), key=lambda g: (g.non_embedding_parameters, g.size, g.tokens, g.variant))


def markdown_table(rows: list[BudgetRow]) -> str:
    """Final eval loss against training tokens: one line per size and budget, one column per variant (mean ± the
    standard deviation over seeds, and their number)."""
    if not rows:
        return "No budgets with an eval loss: nothing to tabulate."
    table = loss_table(rows)
    variants = list(dict.fromkeys(row.variant for row in rows))
    lines = [
        f"| size | N | budget | tokens | tokens / N | {' | '.join(variants)} |",
        "|---|---:|---:|---:|---:|" + "---:|" * len(variants),
    ]
    budgets = dict.fromkeys((g.size, g.non_embedding_parameters, g.tokens, g.fraction) for g in table)
    cells = {(g.size, g.tokens, g.variant): g for g in table}
    for size, parameters, tokens, fraction in budgets:
        values = [_cell(cells.get((size, tokens, variant))) for variant in variants]
        budget = f"| {size} | {parameters:,} | {fraction:g} | {tokens:,} | {tokens / parameters:.3g} |"
        lines.append(f"{budget} {' | '.join(values)} |")
    return "\n".join(lines)


def _cell(group: LossAtBudget | None) -> str:
    if group is None:
        return "–"
    spread = f" ± {group.spread:.4f}" if group.spread is not None else ""
    return f"{group.mean:.4f}{spread} ({len(group.losses)})"


# --- the fit of L(N, D) -----------------------------------------------------------------------------------------


@dataclass
class SurfaceFit:
    """L(N, D) = E + A·N^-α + B·D^-β for one variant, or why it was not fitted."""

    variant: str
    status: str  # FITTED or NOT_TESTED
    reason: str | None = None  # why not tested, or why no intervals
    estimates: dict[str, float] = field(default_factory=dict)  # E, A, alpha, B, beta
    intervals: dict[str, tuple[float, float]] = field(default_factory=dict)  # 95 %, percentile bootstrap
    at_bound: list[str] = field(default_factory=list)  # parameters (of PARAMETERS) on a bound of the search
    vanished: list[str] = field(default_factory=list)  # "N", "D": a term below VANISHED nats at every point
    points: int = 0
    sizes: int = 0
    seeds: int = 0
    resamples: int = 0
    rms_log_residual: float | None = None

    def predict(self, parameters, tokens) -> np.ndarray:
        e = self.estimates
        n, d = np.asarray(parameters, dtype=float), np.asarray(tokens, dtype=float)
        return e["E"] + e["A"] * n ** -e["alpha"] + e["B"] * d ** -e["beta"]


def fit_surface(rows: list[BudgetRow], resamples: int = RESAMPLES, seed: int = 0) -> SurfaceFit:
    """The fit over `rows` (one variant's; every run's loss at every budget a point) with 95 % intervals from
    `resamples` bootstrap samples of its seeds (random generator seeded by `seed`); "not tested" with fewer than 4
    sizes of 3 budgets each, no intervals with fewer than 3 seeds."""
    variants = sorted({row.variant for row in rows})
    if len(variants) > 1:
        raise ValueError(f"fit_surface fits one variant at a time; got {', '.join(variants)} (use fit_surfaces)")
    variant = variants[0] if variants else ""
    rows = [row for row in rows if math.isfinite(row.loss) and row.loss > 0]
    budgets_per_size: dict[str, set[int]] = {}
    for row in rows:
        budgets_per_size.setdefault(row.size, set()).add(row.tokens)
    enough = [size for size, budgets in budgets_per_size.items() if len(budgets) >= MIN_BUDGETS]
    if len(enough) < MIN_SIZES:
        shape = ", ".join(f"{size}: {len(b)}" for size, b in budgets_per_size.items()) or "no runs"
        return SurfaceFit(
            variant,
            NOT_TESTED,
            f"needs {MIN_SIZES} sizes with {MIN_BUDGETS} budgets or more each; has {len(enough)} "
            f"(budgets per size: {shape})",
        )
    data, seeds = _data(rows), sorted({row.seed for row in rows})
    theta = fit_power_laws(data, _FLOOR)
    fit = SurfaceFit(variant, FITTED, points=len(rows), sizes=len(budgets_per_size), seeds=len(seeds))
    fit.estimates = _estimates(theta)
    bounds = search_bounds(2, _FLOOR)
    fit.at_bound = [name for name, value, bound in zip(_FITTED, theta, bounds) if on_bound(value, bound)]
    fit.vanished = _vanished_terms(fit.estimates, rows)
    fit.rms_log_residual = float(np.sqrt(np.mean(log_residuals(theta, data) ** 2)))
    if len(seeds) < MIN_SEEDS_FOR_INTERVALS:
        fit.reason = f"no intervals: {len(seeds)} seed(s), the bootstrap over seeds needs 3 or more"
        return fit
    fit.intervals, fit.resamples = _bootstrap(rows, seeds, theta, resamples, seed), resamples
    return fit


def fit_surfaces(rows: list[BudgetRow], resamples: int = RESAMPLES, seed: int = 0) -> dict[str, SurfaceFit]:
    """`fit_surface` for each variant of `rows`, in their order."""
    by_variant: dict[str, list[BudgetRow]] = {}
    for row in rows:
        by_variant.setdefault(row.variant, []).append(row)
    return {variant: fit_surface(group, resamples, seed) for variant, group in by_variant.items()}


def fits_markdown(fits: dict[str, SurfaceFit]) -> str:
    """The fits as markdown: per variant its estimates with their 95 % intervals, or why it was not tested."""
    resampled = min([fit.seeds for fit in fits.values() if fit.resamples], default=MIN_BOOTSTRAP_SEEDS)
    lines = [
        "L(N, D) = E + A·N^-α + B·D^-β (N: non-embedding parameters, D: training tokens); Huber loss (δ = 1e-3) on "
        "log L over every run's final eval loss at every budget; 95 % intervals: percentile bootstrap over seeds."
        + (f" {caveat}" if (caveat := bootstrap_caveat(resampled)) else ""),
        "",
    ]
    for variant, fit in fits.items():
        if fit.status == NOT_TESTED:
            lines.append(f"- **{variant}**: not tested ({fit.reason})")
            continue
        notes = [f"{fit.points} points, {fit.sizes} sizes, {fit.seeds} seeds"]
        notes.append(f"rms residual of log L {fit.rms_log_residual:.2g}")
        if fit.resamples:
            notes.append(f"{fit.resamples} resamples")
        if fit.reason:
            notes.append(fit.reason)
        if fit.at_bound:
            bound = ", ".join(_SYMBOLS[name] for name in fit.at_bound)
            notes.append(f"at a bound of the search, without an interval: {bound}")
        for term in fit.vanished:
            coefficient, exponent = (_SYMBOLS[name] for name in _TERMS[term])
            notes.append(
                f"the {term} term is below {VANISHED:g} nats at every point: its {coefficient} and {exponent} are not "
                "measured"
            )
        lines.append(f"- **{variant}**: {'; '.join(_determined(fit))} ({'; '.join(notes)})")
    return "\n".join(lines)


def _determined(fit: SurfaceFit) -> list[str]:
    """The fit's parameters that the data determine, each with its interval: not those of a term the fit dropped
    (any value that keeps it below `VANISHED` fits alike), nor an interval for a parameter on a bound; a term whose
    exponent ended at 0 is a constant, given as its sum with E."""
    hidden = {name for term in fit.vanished for name in _TERMS[term]}
    parts = []
    for term, (coefficient, exponent) in _TERMS.items():
        if term not in fit.vanished and exponent in fit.at_bound and fit.estimates[exponent] < 0.5:
            hidden |= {coefficient, exponent, "E"}
            total = fit.estimates["E"] + fit.estimates[coefficient]
            parts.append(f"E + {_SYMBOLS[coefficient]} = {total:.4g} ({_SYMBOLS[exponent]} = 0: a constant term)")
    for name in PARAMETERS:
        if name not in hidden:
            shown = f"{fit.estimates[name]:.4g}" if name in fit.at_bound else _interval_text(fit, name)
            parts.append(f"{_SYMBOLS[name]} = {shown}")
    return parts


_SYMBOLS = {"E": "E", "A": "A", "alpha": "α", "B": "B", "beta": "β"}
_TERMS = {"N": ("A", "alpha"), "D": ("B", "beta")}  # each term's coefficient and exponent
_FITTED = ("A", "alpha", "B", "beta", "E")  # what each of `theta`'s coordinates (a, α, b, β, e) gives


def _vanished_terms(estimates: dict[str, float], rows: list[BudgetRow]) -> list[str]:
    """The terms the fit dropped: where tokens grow with N at every budget (a ladder at a fixed number of tokens per
    parameter), one power law can carry both, and the other's coefficient goes to 0."""
    n = np.array([row.non_embedding_parameters for row in rows], dtype=float)
    d = np.array([row.tokens for row in rows], dtype=float)
    terms = {"N": estimates["A"] * n ** -estimates["alpha"], "D": estimates["B"] * d ** -estimates["beta"]}
    return [name for name, values in terms.items() if values.max() < VANISHED]


def _interval_text(fit: SurfaceFit, name: str) -> str:
    value = f"{fit.estimates[name]:.4g}"
    if name in fit.intervals:
        low, high = fit.intervals[name]
        value += f" [{low:.4g}, {high:.4g}]"
    return value


def _bootstrap(
    rows: list[BudgetRow], seeds: list[int], theta: np.ndarray, resamples: int, seed: int
) -> dict[str, tuple[float, float]]:
    """95 % percentile intervals of the parameters over fits to `resamples` samples of the seeds (drawn with
    replacement, each drawn seed bringing all its runs), each started from the fit to all the data."""
    generator = np.random.default_rng(seed)
    by_seed = {s: [row for row in rows if row.seed == s] for s in seeds}
    samples = []
    for _ in range(resamples):
        drawn = generator.choice(seeds, size=len(seeds), replace=True)
        data = _data([row for s in drawn for row in by_seed[int(s)]])
        samples.append(_estimates(fit_power_laws(data, _FLOOR, theta)))
    return {
        name: (
            float(np.percentile([s[name] for s in samples], 2.5)),
            float(np.percentile([s[name] for s in samples], 97.5)),
        )
        for name in PARAMETERS
    }


def _data(rows: list[BudgetRow]) -> PowerLawData:
    return PowerLawData.of(
        [[r.non_embedding_parameters for r in rows], [r.tokens for r in rows]], [r.loss for r in rows]
    )


def _estimates(theta: np.ndarray) -> dict[str, float]:
    floor, ((a, alpha), (b, beta)) = estimates(theta)
    return {"E": floor, "A": a, "alpha": alpha, "B": b, "beta": beta}
