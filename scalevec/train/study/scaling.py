"""How final eval loss falls with model size: per variant, a fit of the loss at each size's best learning rate
against N (non-embedding parameters), and `scaling.png`. numpy only.

With 4 sizes or more, Chinchilla's form L = E + A·N^-α: for each irreducible loss E on a fine grid below the
lowest loss, log(L - E) is a straight line in log N (least squares gives A and α), and the E of the least squared
error in L is kept, the grid refined around it. With 2 or 3 sizes the saturating form has as many parameters as
points or more, so a plain power law L = A·N^-α (Kaplan's, a straight line in log-log) is fitted instead."""

import statistics
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..diagnostics import save_figure
from .records import RunRecord
from .summary import Key, eval_losses

SATURATING = "E + A·N^-α"
POWER_LAW = "A·N^-α"
SATURATING_FROM = 4  # sizes


@dataclass
class ScalingFit:
    form: str
    E: float | None  # irreducible loss; None for the power law
    A: float
    alpha: float
    parameters: list[int]  # N of each size fitted
    losses: list[float]  # the mean final eval loss fitted at each
    rms: float  # root mean square of the residuals, in nats

    def predict(self, parameters: np.ndarray) -> np.ndarray:
        return (self.E or 0.0) + self.A * np.asarray(parameters, dtype=float) ** -self.alpha


def fit_scaling(parameters: list[int], losses: list[float]) -> ScalingFit | None:
    """The saturating fit with 4 distinct sizes or more, the power law with 2 or 3, None with fewer."""
    distinct = len(set(parameters))
    if distinct >= SATURATING_FROM:
        return fit_saturating(parameters, losses)
    return fit_power_law(parameters, losses) if distinct >= 2 else None


def fit_power_law(parameters: list[int], losses: list[float]) -> ScalingFit:
    slope, intercept = np.polyfit(np.log(parameters), np.log(losses), 1)
    return _fit(POWER_LAW, None, float(np.exp(intercept)), float(-slope), parameters, losses)


def fit_saturating(parameters: list[int], losses: list[float], points: int = 200, rounds: int = 4) -> ScalingFit:
    log_n, loss = np.log(parameters), np.asarray(losses, dtype=float)

    def line(floor: float) -> tuple[float, float, float]:  # (squared error in L, A, alpha) with E = floor
        slope, intercept = np.polyfit(log_n, np.log(loss - floor), 1)
        return float(np.sum((floor + np.exp(intercept + slope * log_n) - loss) ** 2)), np.exp(intercept), -slope

    low, high = 0.0, float(loss.min()) * (1 - 1e-9)
    for _ in range(rounds):
        floors = np.linspace(low, high, points)
        best = min(range(points), key=lambda i: line(floors[i])[0])
        low, high = floors[max(best - 2, 0)], floors[min(best + 2, points - 1)]
    floor = float(floors[best])
    _, coefficient, alpha = line(floor)
    return _fit(SATURATING, floor, float(coefficient), float(alpha), parameters, losses)


def _fit(form, floor, coefficient, alpha, parameters, losses) -> ScalingFit:
    fit = ScalingFit(form, floor, coefficient, alpha, list(parameters), list(losses), 0.0)
    fit.rms = float(np.sqrt(np.mean((fit.predict(parameters) - np.asarray(losses)) ** 2)))
    return fit


def scaling_fits(best: dict[Key, list[RunRecord]]) -> dict[str, ScalingFit]:
    """Variant -> the fit of its mean final eval loss at each size's best learning rate (variants run at one size
    only are left out)."""
    points = {}
    for (_, variant), runs in best.items():
        if evals := list(eval_losses(runs).values()):
            points.setdefault(variant, []).append((runs[0].non_embedding_parameters, statistics.mean(evals)))
    fits = {variant: fit_scaling(*zip(*pairs)) for variant, pairs in points.items()}
    return {variant: fit for variant, fit in fits.items() if fit is not None}


def exponents_per_seed(best: dict[Key, list[RunRecord]], variant: str) -> dict[int, float]:
    """Seed -> α of the power law through that seed's runs of `variant` over the sizes (at their best learning
    rates), for the seeds run at 2 sizes or more."""
    points = {}
    for (_, name), runs in best.items():
        for r in runs:
            if name == variant and r.eval_loss is not None:
                points.setdefault(r.seed, []).append((r.non_embedding_parameters, r.eval_loss))
    return {
        seed: fit_power_law(*zip(*pairs)).alpha for seed, pairs in points.items() if len({n for n, _ in pairs}) > 1
    }


def plot_scaling(best: dict[Key, list[RunRecord]], fits: dict[str, ScalingFit], path: Path) -> Path:
    """Log-log: each run at its size's best learning rate (dots), the mean over seeds with its min–max (bars), and
    each variant's fit (line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    fig, axis = plt.subplots(figsize=(8, 5.5))
    variants = list(dict.fromkeys(variant for _, variant in best))
    for index, variant in enumerate(variants):
        colour = f"C{index}"
        label = variant
        for (_, name), runs in best.items():
            evals = list(eval_losses(runs).values())
            if name != variant or not evals:
                continue
            n = runs[0].non_embedding_parameters
            mean = statistics.mean(evals)
            axis.scatter([n] * len(evals), evals, color=colour, alpha=0.35, s=14)
            axis.errorbar([n], [mean], yerr=[[mean - min(evals)], [max(evals) - mean]], fmt="o", color=colour)
        if variant in fits:
            fit = fits[variant]
            grid = np.geomspace(min(fit.parameters) / 1.3, max(fit.parameters) * 1.3, 100)
            axis.plot(grid, fit.predict(grid), color=colour, linewidth=1.2)
            label = f"{variant}: α = {fit.alpha:.3f} ({fit.form})"
        axis.plot([], [], "o-", color=colour, label=label)
    axis.set(xscale="log", yscale="log", xlabel="non-embedding parameters N", ylabel="final eval loss (nats/token)")
    plain = FuncFormatter(lambda value, _: f"{value:g}")  # a loss spans less than a decade: no 8 x 10^0
    axis.yaxis.set_major_formatter(plain)
    axis.yaxis.set_minor_formatter(plain)
    axis.set_title("each size at its best learning rate (dots: seeds; bars: min–max; line: fit)", fontsize=10)
    axis.legend(fontsize="small")
    fig.tight_layout()
    return save_figure(fig, path)
