"""How the loss falls with model size: per variant, L = E + A·N^-α fitted to the report-half loss of every seed at
each size's best learning rate, with bootstrap intervals, and `scaling.png`.

The fit is Chinchilla's approach 3 as Besiroglu et al. (2024) corrected it: a Huber loss (δ = 1e-3) on the residuals
of log L, minimised by L-BFGS-B from a grid of starts, with E bounded to [0, the lowest loss] and α to [0, 3]; a fit
whose E or α ends at a bound says so (an α at a bound is not measured: the scaling claim is then unresolved). Its
95 % intervals on α and E are percentiles of `REPLICATES` refits on the seeds resampled with
replacement (every size keeps its seed pairing, and every variant is refitted on the same resamples, so that the
difference of two variants' α has an interval of its own). A fit needs `MIN_SIZES` sizes or more, each with every
seed at its best learning rate; with fewer, there is none. N is counted three ways, each fitted: non-embedding
parameters (Kaplan's N), total parameters (Chinchilla's; the scaling claim's, following Pearce & Song 2024, who show
that non-embedding counts bias small-scale exponents), and for MoE models the parameters a token uses."""

import statistics
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from scipy.optimize import minimize

from ...atomic import write_figure_atomically
from .records import RunRecord
from .summary import Key, report_losses

MIN_SIZES = 4
REPLICATES = 200
HUBER_DELTA = 1e-3
COUNTS = {  # how N is counted -> the record's field
    "non-embedding": "non_embedding_parameters",
    "total": "total_parameters",
    "active": "active_parameters",
}
CLAIM_COUNT = "total"
_ALPHA_BOUNDS = (0.0, 3.0)


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


def huber_fit(parameters: np.ndarray, losses: np.ndarray, start: tuple | None = None) -> tuple[float, float, float]:
    """(E, A, α) minimising the Huber loss of log(E + A·N^-α) - log L; from `start` (E, log A, α) alone, or else
    from a grid of starts."""
    log_n, log_l = np.log(parameters), np.log(losses)
    ceiling = float(losses.min()) * (1 - 1e-9)

    def objective(x: np.ndarray) -> tuple[float, np.ndarray]:
        floor, log_a, alpha = x
        power = np.exp(log_a - alpha * log_n)
        predicted = floor + power
        residual = np.log(predicted) - log_l
        small = np.abs(residual) <= HUBER_DELTA
        value = np.where(small, 0.5 * residual**2, HUBER_DELTA * (np.abs(residual) - 0.5 * HUBER_DELTA))
        slope = np.where(small, residual, HUBER_DELTA * np.sign(residual)) / predicted
        gradient = np.array([slope.sum(), (slope * power).sum(), -(slope * power * log_n).sum()])
        return float(value.sum()) / HUBER_DELTA**2, gradient / HUBER_DELTA**2  # residuals in units of δ

    if start is None:  # each (E, α) of a small grid, with the log A that fits it best on average
        pairs = [(f * ceiling, alpha) for f in (0.0, 0.5, 0.9) for alpha in (0.1, 0.3, 0.6)]
        starts = [(floor, float(np.mean(np.log(losses - floor) + alpha * log_n)), alpha) for floor, alpha in pairs]
    else:
        starts = [start]
    bounds = [(0.0, ceiling), (-30.0, 60.0), _ALPHA_BOUNDS]
    options = {"ftol": 1e-15, "gtol": 1e-10, "maxiter": 2000}
    fits = [
        minimize(objective, np.array(x0), jac=True, method="L-BFGS-B", bounds=bounds, options=options) for x0 in starts
    ]
    best = min(fits, key=lambda fit: fit.fun).x
    return float(best[0]), float(np.exp(best[1])), float(best[2])


def _at_bound(floor: float, alpha: float, lowest_loss: float) -> list[str]:
    bounds = []
    if floor <= 1e-9 * lowest_loss:
        bounds.append("E = 0")
    elif floor >= lowest_loss * (1 - 1e-6):
        bounds.append("E = the lowest loss")
    if (edge := _alpha_bound(alpha)) is not None:
        bounds.append(f"α = {edge:g}")
    return bounds


def _alpha_bound(alpha: float) -> float | None:
    """The bound of the search that `alpha` ended on, if any."""
    return next((edge for edge in _ALPHA_BOUNDS if abs(alpha - edge) <= 1e-6), None)


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
    floor, coefficient, alpha = huber_fit(np.repeat(n, len(seeds)), table.ravel())
    means = table.mean(axis=1)
    fit = ScalingFit(variant, counted, floor, coefficient, alpha, counts, means.tolist(), seeds, 0.0, [])
    fit.at_bound = _at_bound(floor, alpha, float(table.min()))
    fit.rms = float(np.sqrt(np.mean((fit.predict(n) - means) ** 2)))
    start = (floor, float(np.log(coefficient)), alpha)
    replicates = [huber_fit(np.repeat(n, len(seeds)), table[:, draw % len(seeds)].ravel(), start) for draw in draws]
    floors, alphas = np.array([r[0] for r in replicates]), np.array([r[2] for r in replicates])
    fit.alpha_interval = tuple(np.percentile(alphas, [2.5, 97.5]).tolist())
    fit.E_interval = tuple(np.percentile(floors, [2.5, 97.5]).tolist())
    fit.replicate_alphas = alphas.tolist()
    return fit


def seed_draws(seeds: int, replicates: int = REPLICATES) -> np.ndarray:
    """Resamples of `seeds` positions with replacement, the same on every call (a fixed generator)."""
    return np.random.default_rng(0).integers(0, max(seeds, 1), size=(replicates, seeds))


def scaling_fits(best: dict[Key, list[RunRecord]], sizes: list[str], seeds: int) -> list[ScalingFit]:
    """Every variant's fits (one per way of counting N), for the variants at their best rate at every size of
    `sizes` (the grid's); `seeds`: how many the grid has."""
    draws = seed_draws(seeds)
    variants = list(dict.fromkeys(variant for _, variant in best))
    fits = []
    for variant in variants:
        if all((size, variant) in best for size in sizes):
            runs = [best[size, variant] for size in sizes]
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
