"""Each (size, variant) at its best learning rate, and its paired differences to its reference at the reference's
best learning rate, seed by seed."""

import math
import statistics
from collections import defaultdict
from dataclasses import dataclass

from .records import RunRecord
from .variants import VARIANTS, as_predicted

Key = tuple[str, str]  # (size, variant)


@dataclass
class LearningRateResult:
    learning_rate: float
    seeds: list[int]
    eval_loss_mean: float | None
    eval_loss_std: float | None  # sample standard deviation; None with fewer than two seeds


@dataclass
class VariantSummary:
    """One variant at one size, at its best learning rate, over the seeds."""

    size: str
    variant: str
    best_learning_rate: float
    seeds: list[int]
    eval_loss_mean: float | None
    eval_loss_std: float | None
    train_loss_mean: float
    reference: str | None
    reference_learning_rate: float | None  # the reference's own best learning rate
    differences: dict[int, float]  # seed -> eval loss minus the reference's in that seed
    expected: str | None
    holds: int  # seeds in which the difference has the sign the paper predicts
    learning_rates: list[LearningRateResult]  # every learning rate run, in the order given


def by_learning_rate(records: list[RunRecord]) -> dict[Key, dict[float, list[RunRecord]]]:
    """(size, variant) -> learning rate -> its runs, in the order run."""
    grouped = defaultdict(lambda: defaultdict(list))
    for record in records:
        grouped[record.size, record.variant][record.learning_rate].append(record)
    return grouped


def best_runs(records: list[RunRecord]) -> dict[Key, list[RunRecord]]:
    """(size, variant) -> its runs at its best learning rate: of the learning rates with the most seeds finished,
    the one of lowest mean final eval loss (training loss where nothing was evaluated)."""
    return {key: min(runs.values(), key=_rank) for key, runs in by_learning_rate(records).items()}


def _rank(runs: list[RunRecord]) -> tuple[int, float, float]:
    evals = list(eval_losses(runs).values())
    return -len(runs), statistics.mean(evals) if evals else math.inf, statistics.mean(r.train_loss for r in runs)


def eval_losses(runs: list[RunRecord]) -> dict[int, float]:
    return {r.seed: r.eval_loss for r in runs if r.eval_loss is not None}


def paired_differences(variant: list[RunRecord], reference: list[RunRecord]) -> dict[int, float]:
    """Seed -> eval loss of `variant` minus that of `reference`, over the seeds both have."""
    ours, theirs = eval_losses(variant), eval_losses(reference)
    return {seed: loss - theirs[seed] for seed, loss in ours.items() if seed in theirs}


def summarise(records: list[RunRecord]) -> list[VariantSummary]:
    """Per size and variant, in the order run."""
    best = best_runs(records)
    grouped = by_learning_rate(records)
    summaries = []
    for (size, name), runs in best.items():
        variant = VARIANTS[name]
        reference = best.get((size, variant.reference), [])
        differences = paired_differences(runs, reference)
        at_best = _learning_rate_result(runs[0].learning_rate, runs)
        summaries.append(
            VariantSummary(
                size=size,
                variant=name,
                best_learning_rate=at_best.learning_rate,
                seeds=at_best.seeds,
                eval_loss_mean=at_best.eval_loss_mean,
                eval_loss_std=at_best.eval_loss_std,
                train_loss_mean=statistics.mean(r.train_loss for r in runs),
                reference=variant.reference if differences else None,
                reference_learning_rate=reference[0].learning_rate if differences else None,
                differences=differences,
                expected=variant.expected if differences else None,
                holds=sum(as_predicted(d, variant.expected) for d in differences.values()),
                learning_rates=[_learning_rate_result(lr, runs) for lr, runs in grouped[size, name].items()],
            )
        )
    return summaries


def _learning_rate_result(learning_rate: float, runs: list[RunRecord]) -> LearningRateResult:
    evals = list(eval_losses(runs).values())
    return LearningRateResult(
        learning_rate=learning_rate,
        seeds=[r.seed for r in runs],
        eval_loss_mean=statistics.mean(evals) if evals else None,
        eval_loss_std=statistics.stdev(evals) if len(evals) > 1 else None,
    )
