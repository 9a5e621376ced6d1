"""`loss_curves.png`: per size (one row each), every variant's training loss at its best learning rate (mean over
seeds with its min–max band), the same over the last 40 % of steps, and each seed's eval-loss difference to the
reference variant."""

import statistics
from pathlib import Path

from ...atomic import write_figure_atomically
from ...run_records import logged_curve, read_run_records
from .records import RunRecord
from .summary import Key, paired_differences
from .variants import VARIANTS


def mean_curves(
    best: dict[Key, list[RunRecord]], root: Path, size: str, key: str = "loss"
) -> dict[str, tuple[list, list]]:
    """Variant -> (steps logged by every seed, the values of each seed at those steps), at `size`, from the run
    folders under `root`."""
    curves = {}
    for (ours, variant), runs in best.items():
        if ours == size:
            per_seed = [dict(logged_curve(read_run_records(r.point.folder(root)).log_history, key)) for r in runs]
            steps = sorted(set.intersection(*(set(curve) for curve in per_seed)))
            curves[variant] = (steps, [[curve[step] for step in steps] for curve in per_seed])
    return curves


def plot_losses(best: dict[Key, list[RunRecord]], root: Path, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(dict.fromkeys(size for size, _ in best))
    fig, axes = plt.subplots(
        len(sizes), 3, figsize=(17, 4.8 * len(sizes)), gridspec_kw={"width_ratios": [3, 3, 2]}, squeeze=False
    )
    colours = {variant: f"C{i}" for i, variant in enumerate(dict.fromkeys(v for _, v in best))}
    for size, (full, tail, paired) in zip(sizes, axes):
        curves = mean_curves(best, root, size)
        seeds = max(len(values) for _, values in curves.values())
        for axis in (full, tail):
            for variant, (steps, values) in curves.items():
                mean = [statistics.mean(column) for column in zip(*values)]
                label = f"{variant} (lr {best[size, variant][0].learning_rate:g})"
                axis.plot(steps, mean, color=colours[variant], label=label)
                axis.fill_between(steps, *_min_max(values), color=colours[variant], alpha=0.2, linewidth=0)
        spread = f"mean of {seeds} seeds, band: min–max" if seeds > 1 else "1 seed"
        full.set(title=f"{size}: training loss ({spread})", xlabel="step")
        full.set(ylabel="nats per token")
        full.legend(fontsize="small")
        _zoom_on_tail(tail, curves, fraction=0.4)
        tail.set(title="last 40 % of steps", xlabel="step")
        _plot_differences(paired, best, size, colours)
    fig.tight_layout()
    return write_figure_atomically(fig, path)


def _min_max(values: list[list[float]]) -> tuple[list[float], list[float]]:
    columns = list(zip(*values))
    return [min(c) for c in columns], [max(c) for c in columns]


def _zoom_on_tail(axis, curves: dict, fraction: float) -> None:
    last = max((steps[-1] for steps, _ in curves.values() if steps), default=0)
    start = last * (1 - fraction)
    shown = [v for steps, values in curves.values() for seed in values for s, v in zip(steps, seed) if s >= start]
    if shown:
        margin = 0.05 * (max(shown) - min(shown) or 1.0)
        axis.set_xlim(start, last)
        axis.set_ylim(min(shown) - margin, max(shown) + margin)


def _plot_differences(axis, best: dict[Key, list[RunRecord]], size: str, colours: dict[str, str]) -> None:
    compared = []
    for (ours, variant), runs in best.items():
        reference = VARIANTS[variant].reference
        if ours == size and (size, reference) in best:
            differences = list(paired_differences(runs, best[size, reference]).values())
            if differences:
                compared.append((variant, reference, differences))
    for row, (variant, _, differences) in enumerate(compared):
        axis.scatter(differences, [row] * len(differences), color=colours[variant], alpha=0.6)
        axis.scatter([statistics.mean(differences)], [row], color=colours[variant], marker="|", s=400)
    axis.axvline(0, color="grey", linewidth=0.8)
    axis.set_yticks(range(len(compared)), [f"{v}\n− {r}" for v, r, _ in compared], fontsize="small")
    axis.invert_yaxis()
    title = "report-half eval loss − reference\n(each at its best lr)"  # two lines: the y labels are wide
    axis.set(title=title, xlabel="nats per token (dots: seeds, |: mean)")
