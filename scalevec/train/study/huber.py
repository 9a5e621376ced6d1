"""The one fitter of the study's scaling laws, L(N) = E + A·N^-α (`scaling.py`) and L(N, D) = E + A·N^-α + B·D^-β
(`budgets.py`): Chinchilla's approach 3 as Besiroglu et al. (2024) corrected it. log L is fitted by
LSE(a₁ - α₁·log X₁, …, e) (A_k = e^a_k, E = e^e) with a Huber loss (δ = 1e-3) on the residuals of log L, by
L-BFGS-B from the best starts of a grid of exponents, every point a run's loss. A parameter vector `theta` is
(a₁, α₁, …, a_K, α_K, e): one coefficient and exponent per term, then E."""

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy.optimize import minimize, nnls

HUBER_DELTA = 1e-3
EXPONENT_BOUNDS = (0.0, 3.0)
_GRID = (0.05, 0.15, 0.3, 0.5, 0.8, 1.2)  # starts of each exponent
_FLOOR_SHARES = (0.5, 0.9)  # starts of E besides the least squares', as shares of the lowest loss
_OPTIONS = {"maxiter": 1000, "ftol": 1e-12, "gtol": 1e-8}


@dataclass
class PowerLawData:
    """The points: each term's log X about its mean (then a_k and α_k are nearly uncorrelated, and L-BFGS-B
    converges in a few dozen steps instead of hundreds), and log L."""

    logs: np.ndarray  # terms x points, centred
    log_loss: np.ndarray
    centres: np.ndarray  # the mean log X of each term

    @classmethod
    def of(cls, variables: Sequence[Sequence[float]], losses: Sequence[float]) -> "PowerLawData":
        """The data of `variables` (each term's X at every point: N, or N and D) and `losses`."""
        logs = np.log(np.asarray(variables, dtype=float))
        centres = logs.mean(axis=1)
        return cls(logs - centres[:, None], np.log(np.asarray(losses, dtype=float)), centres)


def fit_power_laws(
    data: PowerLawData, floor: tuple[float, float], start: np.ndarray | None = None, count: int = 4
) -> np.ndarray:
    """The best `theta` of fits from `start` (a `theta`: the fit to all the data, refitted to a resample) alone, or
    else from the `count` best starts of the grid;
    E searched in `floor` (low > 0: E is fitted in logs), each exponent in `EXPONENT_BOUNDS`, each coefficient
    anywhere."""
    bounds = search_bounds(len(data.logs), floor)
    best = None
    for first in grid_starts(data, floor, count) if start is None else [start]:
        result = minimize(
            huber_loss,
            _centred(first, data),
            args=(data,),
            jac=True,
            method="L-BFGS-B",
            bounds=bounds,
            options=_OPTIONS,
        )
        if best is None or result.fun < best.fun:
            best = result
    return _uncentred(best.x, data)


def search_bounds(terms: int, floor: tuple[float, float]) -> list[tuple[float | None, float | None]]:
    """The bounds of each coordinate of a `theta` of `terms` terms, E in `floor`."""
    return [(None, None), EXPONENT_BOUNDS] * terms + [(math.log(floor[0]), math.log(floor[1]))]


def estimates(theta: np.ndarray) -> tuple[float, list[tuple[float, float]]]:
    """E and each term's (A, exponent) of `theta`."""
    terms = [(math.exp(theta[2 * k]), float(theta[2 * k + 1])) for k in range(len(theta) // 2)]
    return math.exp(theta[-1]), terms


def log_residuals(theta: np.ndarray, data: PowerLawData) -> np.ndarray:
    """log L̂ - log L at each point."""
    return _log_prediction(_centred(theta, data), data)[0] - data.log_loss


def on_bound(value: float, bound: tuple[float | None, float | None]) -> bool:
    """Whether a fitted `value` ended on its search's `bound` (low, high), to 1e-6 of the range."""
    low, high = bound
    return low is not None and (value - low < 1e-6 * (high - low) or high - value < 1e-6 * (high - low))


def huber_loss(phi: np.ndarray, data: PowerLawData) -> tuple[float, np.ndarray]:
    """The Huber loss of the log residuals (divided by δ, which changes no minimum) and its gradient in the
    centred coordinates `phi`."""
    prediction, weights = _log_prediction(phi, data)
    residual = prediction - data.log_loss
    small = np.abs(residual) <= HUBER_DELTA
    loss = np.where(small, 0.5 * residual**2 / HUBER_DELTA, np.abs(residual) - 0.5 * HUBER_DELTA).sum()
    slope = np.clip(residual / HUBER_DELTA, -1.0, 1.0)
    gradient = []
    for k, log_x in enumerate(data.logs):
        gradient += [(slope * weights[k]).sum(), -(slope * weights[k] * log_x).sum()]
    gradient.append((slope * weights[-1]).sum())
    return float(loss), np.array(gradient)


def grid_starts(data: PowerLawData, floor: tuple[float, float], count: int) -> list[np.ndarray]:
    """The `count` best starts (by the Huber loss) of a grid of exponents, each with the E and coefficients of the
    least squares in L (not negative) at those exponents, and with E at a half and nine tenths of the lowest loss
    and the coefficients of the least squares in L - E; E within `floor`."""
    loss = np.exp(data.log_loss)
    lowest = float(loss.min())
    starts = []
    for exponents in itertools.product(_GRID, repeat=len(data.logs)):
        powers = [np.exp(-alpha * log_x) for alpha, log_x in zip(exponents, data.logs)]
        solution, _ = nnls(np.stack([*powers, np.ones_like(loss)], axis=1), loss)
        fits = [(solution[-1], solution[:-1])]
        for share in _FLOOR_SHARES:  # a least-squares E can be 0 where the data bend to one (a steep power law)
            fits.append((share * lowest, nnls(np.stack(powers, axis=1), loss - share * lowest)[0]))
        for e, coefficients in fits:
            e = math.log(min(max(e, floor[0]), lowest, floor[1]))
            coefficients = [math.log(max(value, 1e-8)) for value in coefficients]
            starts.append(np.array([*(x for pair in zip(coefficients, exponents) for x in pair), e]))  # centred
    starts.sort(key=lambda phi: huber_loss(phi, data)[0])
    return [_uncentred(phi, data) for phi in starts[:count]]


def _log_prediction(phi: np.ndarray, data: PowerLawData) -> tuple[np.ndarray, np.ndarray]:
    """log L̂ at each point and the softmax weights of its terms and E (for the gradient), `phi` centred."""
    terms = [phi[2 * k] - phi[2 * k + 1] * log_x for k, log_x in enumerate(data.logs)]
    terms = np.stack([*terms, np.full_like(data.log_loss, phi[-1])])
    top = terms.max(axis=0)
    weights = np.exp(terms - top)
    total = weights.sum(axis=0)
    return top + np.log(total), weights / total


def _centred(theta: np.ndarray, data: PowerLawData) -> np.ndarray:
    """`theta` as the coordinates `huber_loss` takes: each a_k at the centred log X_k."""
    phi = np.array(theta, dtype=float)
    phi[0:-1:2] -= phi[1:-1:2] * data.centres
    return phi


def _uncentred(phi: np.ndarray, data: PowerLawData) -> np.ndarray:
    theta = np.array(phi, dtype=float)
    theta[0:-1:2] += theta[1:-1:2] * data.centres
    return theta
