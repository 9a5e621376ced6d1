"""How the loss falls with model size: per variant, L = E + A·N^-α fitted to the report-half loss of every seed at
each size's best learning rate, with bootstrap intervals, and `scaling.png`.

The fit is the study's one Huber fit of log L (`huber.py`, the one of L(N, D) too), with E bounded to [0, the
lowest loss] and α to [0, 3]; a fit whose E or α ends at a bound says so (an α at a bound is not measured: the
scaling claim is then unresolved). Its 95 % intervals on α and E are percentiles of `REPLICATES` refits on the seeds
resampled with replacement (every size keeps its seed pairing, and every variant is refitted on the same resamples,
so that the difference of two variants' α has an interval of its own). A fit needs `MIN_SIZES` sizes or more, each
with every seed at its best learning rate; with fewer, there is none. N is counted three ways, each fitted:
non-embedding parameters (Kaplan's N), total parameters (Chinchilla's; the scaling claim's, following Pearce & Song
2024, who show that non-embedding counts bias small-scale exponents), and for MoE models the parameters a token
uses."""

import statistics
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ...atomic import write_figure_atomically
from .huber import EXPONENT_BOUNDS, PowerLawData, estimates, fit_power_laws
from .records import RunRecord
from .summary import Key, report_losses

MIN_SIZES = 4
REPLICATES = 200
COUNTS = {  # how N is counted -> the record's field
    "non-embedding": "non_embedding_parameters",
    "total": "total_parameters",
    "active": "active_parameters",
}
CLAIM_COUNT = "total"
_ZERO = 1e-9  # an E below this share of the lowest loss is on the search's lower bound, which stands for 0


@dataclass
class ScalingFit:
    variant: str
    counted: str  # a key of COUNTS
    E: float  # irreducible loss
    A: float
    alpha: float
    parameters: list[int]  # N of each size fitted
    losses: list[float]  # the mean report-half loss at each, over the seeds
    seeds: list[int]
    rms: float  # root mean square of the residuals of those means, in nats
    at_bound: list[str]  # "E = 0", "E = the lowest loss", "α = 3": where the fit ended at a bound of its search
    alpha_interval: tuple[float, float] = (float("nan"), float("nan"))
    E_interval: tuple[float, float] = (float("nan"), float("nan"))
    replicate_alphas: list[float] = field(default_factory=list, repr=False)

    def predict(self, parameters) -> np.ndarray:
        return self.E + self.A * np.asarray(parameters, dtype=float) ** -self.alpha

    @property
    def alpha_bound(self) -> float | None:
        """The bound of the search α ended on (not a measurement, then), or None."""
        return _alpha_bound(self.alpha)


def fit_power_law(
    parameters: np.ndarray, losses: np.ndarray, start: np.ndarray | None = None
) -> tuple[np.ndarray, float, float, float]:
    """The Huber fit (`huber.py`) of E + A·N^-α to `losses` at `parameters`, E searched from 0 (1e-12 of the lowest
    loss, which it stands for: E is fitted in logs) to the lowest loss; from `start` (a `theta`) alone, or else from
    the best starts of a grid. Returns its `theta`, E, A and α."""
    lowest = float(losses.min())
    theta = fit_power_laws(PowerLawData.of([parameters], losses), (1e-12 * lowest, lowest * (1 - 1e-9)), start)
    floor, ((coefficient, alpha),) = estimates(theta)
    return theta, 0.0 if floor <= _ZERO * lowest else floor, coefficient, alpha


def _at_bound(floor: float, alpha: float, lowest_loss: float) -> list[str]:
    bounds = []
    if floor <= _ZERO * lowest_loss:
        bounds.append("E = 0")
    elif floor >= lowest_loss * (1 - 1e-6):
        bounds.append("E = the lowest loss")
    if (edge := _alpha_bound(alpha)) is not None:
        bounds.append(f"α = {edge:g}")
    return bounds


def _alpha_bound(alpha: float) -> float | None:
    """The bound of the search that `alpha` ended on, if any."""
    return next((edge for edge in EXPONENT_BOUNDS if abs(alpha - edge) <= 1e-6), None)


def fit_variant(
    variant: str, runs_by_size: list[list[RunRecord]], counted: str, draws: np.ndarray
) -> ScalingFit | None:
    """The fit of one variant over its sizes (`runs_by_size`: each size's runs at its best learning rate), N counted
    as `counted`; `draws`: the bootstrap's seed resamples (positions in the seeds' order). None without every seed's
    report loss and N at `MIN_SIZES` sizes."""
    seeds = sorted(set.intersection(*(set(report_losses(runs)) for runs in runs_by_size))) if runs_by_size else []
    counts = [getattr(runs[0], COUNTS[counted]) for runs in runs_by_size]
    if len(runs_by_size) < MIN_SIZES or not seeds or None in counts or len(set(counts)) < MIN_SIZES:
        return None
    table = np.array([[report_losses(runs)[seed] for seed in seeds] for runs in runs_by_size])  # sizes x seeds
    n = np.array(counts, dtype=float)
    theta, floor, coefficient, alpha = fit_power_law(np.repeat(n, len(seeds)), table.ravel())
    means = table.mean(axis=1)
    fit = ScalingFit(variant, counted, floor, coefficient, alpha, counts, means.tolist(), seeds, 0.0, [])
    fit.at_bound = _at_bound(floor, alpha, float(table.min()))
    fit.rms = float(np.sqrt(np.mean((fit.predict(n) - means) ** 2)))
    replicates = [
        fit_power_law(np.repeat(n, len(seeds)), table[:, draw % len(seeds)].ravel(), theta) for draw in draws
    ]
    floors, alphas = np.array([r[1] for r in replicates]), np.array([r[3] for r in replicates])
    fit.alpha_interval = tuple(np.percentile(alphas, [2.5, 97.5]).tolist())
    fit.E_interval = tuple(np.percentile(floors, [2.5, 97.5]).tolist())
    fit.replicate_alphas = alphas.tolist()
    return fit


def seed_draws(seeds: int, replicates: int = REPLICATES) -> np.ndarray:
    """Resamples of `seeds` positions with replacement, the same on every call (a fixed generator)."""
    return np.random.default_rng(0).integers(0, max(seeds, 1), size=(replicates, seeds))


def scaling_fits(
    best: dict[Key, list[RunRecord]], sizes: list[str], seeds: int, held: set[Key] | None = None
) -> list[ScalingFit]:
    """Every variant's fits (one per way of counting N), for the variants at their best rate at every size of
    `sizes` (the grid's) that holds them (`held`: the grid's (size, variant) pairs; None: every pair, one grid's);
    `seeds`: how many the grid has."""
    draws = seed_draws(seeds)
    variants = list(dict.fromkeys(variant for _, variant in best))
    fits = []
    for variant in variants:
        ours = [size for size in sizes if held is None or (size, variant) in held]
        if all((size, variant) in best for size in ours):
            runs = [best[size, variant] for size in ours]
            for counted in COUNTS:
                if counted == "active" and all(r[0].active_parameters == r[0].total_parameters for r in runs):
                    continue  # dense: active is total
                fits.append(fit_variant(variant, runs, counted, draws))
    return [fit for fit in fits if fit is not None]


def plot_scaling(best: dict[Key, list[RunRecord]], fits: list[ScalingFit], path: Path) -> Path:
    """Log-log against N counted as the claim counts it: each seed's report loss at its size's best learning rate
    (dots), the mean over seeds (circles), and each variant's fit (line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, axis = plt.subplots(figsize=(8, 5.5))
    shown = {fit.variant: fit for fit in fits if fit.counted == CLAIM_COUNT}
    for index, variant in enumerate(dict.fromkeys(variant for _, variant in best)):
        colour, label = f"C{index}", variant
        for (_, name), runs in best.items():
            losses = list(report_losses(runs).values())
            n = getattr(runs[0], COUNTS[CLAIM_COUNT])
            if name != variant or not losses or n is None:
                continue
            axis.scatter([n] * len(losses), losses, color=colour, alpha=0.35, s=14)
            axis.scatter([n], [statistics.fmean(losses)], color=colour)
        if (fit := shown.get(variant)) is not None:
            grid = np.geomspace(min(fit.parameters) / 1.3, max(fit.parameters) * 1.3, 100)
            axis.plot(grid, fit.predict(grid), color=colour, linewidth=1.2)
            low, high = fit.alpha_interval
            label = f"{variant}: α = {fit.alpha:.3f} [{low:.3f}, {high:.3f}]"
        axis.plot([], [], "o-", color=colour, label=label)
    axis.set(xscale="log", yscale="log", xlabel=f"{CLAIM_COUNT} parameters N", ylabel="report-half eval loss")
    plain = FuncFormatter(lambda value, _: f"{value:g}")  # a loss spans less than a decade: no 8 x 10^0
    axis.yaxis.set_major_formatter(plain)
    axis.yaxis.set_minor_formatter(plain)
    axis.set_title("each size at its best learning rate; line: E + A·N^-α (Huber on log L)", fontsize=10)
    axis.legend(fontsize="small")
    fig.tight_layout()
    return write_figure_atomically(fig, path)
