"""The figure a study judges its claims on (`scalevec-ablate --metric`): the held-out loss by default, or any other
figure the runs' final evaluation logged, e.g. a downstream task's `eval_hellaswag_acc_norm`. Its direction comes
from its name: accuracies are better higher, losses, bits per byte and perplexities lower. The learning rate is
chosen on the selection half of the held-out loss whatever the metric."""

from ...run_records import TASK_FIGURES, TaskScore
from .records import FINISHED, RunRecord

LOSS = "eval_loss"
# A task's figures as `TaskScore` orients them; the held-out text's are all lower is better.
HIGHER_IS_BETTER = tuple(f"_{figure}" for figure in TaskScore.HIGHER_IS_BETTER)
_TASK_LOWER = tuple(f"_{figure}" for figure in TASK_FIGURES if figure not in TaskScore.HIGHER_IS_BETTER)
LOWER_IS_BETTER = ("_loss", *_TASK_LOWER, "_bits_per_byte", "_perplexity")


def metric_name(text: str) -> str:
    """`text` as logged (`hellaswag_acc` and `eval_hellaswag_acc` name one figure); a `ValueError` for a name whose
    direction is unknown."""
    name = text.strip()
    name = name if name.startswith("eval_") else f"eval_{name}"
    if not name.endswith(HIGHER_IS_BETTER + LOWER_IS_BETTER) or name in ("eval_select_loss", "eval_report_loss"):
        raise ValueError(
            f"--metric {text!r}: give a figure the evaluation logs, ending in {', '.join(HIGHER_IS_BETTER)} (higher "
            f"is better) or {', '.join(LOWER_IS_BETTER)} (lower is better); the held-out loss is {LOSS}"
        )
    return name


def higher_is_better(metric: str) -> bool:
    return metric.endswith(HIGHER_IS_BETTER)


def oriented(expected: str | None, metric: str) -> str | None:
    """The paper's prediction ("lower" or "higher" loss) as the sign of a difference in `metric`."""
    if expected is None or not higher_is_better(metric):
        return expected
    return {"lower": "higher", "higher": "lower"}[expected]


def describe_metric(metric: str) -> str:
    """The line each report gives: what Δ is measured on, and which way is better."""
    if metric == LOSS:
        return (
            "Metric: the held-out loss, on its report half (`eval_report_loss`); lower is better, so the paper's "
            "predictions of a lower loss read Δ < 0."
        )
    which = "higher" if higher_is_better(metric) else "lower"
    flipped = " (flipped: the paper's lower loss is a higher score)" if which == "higher" else ""
    return (
        f"Metric: `{metric}` of each run's final evaluation; {which} is better, so the predicted signs follow"
        f"{flipped}. The learning rate is still chosen on the selection half of the held-out loss; this figure "
        "is not split into halves. The scaling claim and the budget table stay on the held-out loss."
    )


def check_logged(metric: str, records: list[RunRecord]) -> None:
    """A `ValueError` naming `metric` and the figures the runs did log, where finished runs exist and none of them
    logged it."""
    finished = [r for r in records if r.status == FINISHED]
    if not finished or any(r.figure(metric) is not None for r in finished):
        return
    logged = sorted({LOSS, *(name for r in finished for name in r.metrics)})
    raise ValueError(f"--metric {metric}: no run of the grid logged it; the runs log {', '.join(logged)}")
