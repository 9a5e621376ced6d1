"""The files a study writes into its folder, from whatever runs of the grid have finished: `results.md` and
`results.json` (each size and variant at its best learning rate, every learning rate, the scaling fits, every run),
`claims.md`, and the figures `loss_curves.png` and `scaling.png`. Every file is replaced whole (atomically): shards
writing them at once leave the last complete one."""

import json
import statistics
from dataclasses import asdict
from pathlib import Path

from ...atomic import write_text_atomically
from ...run_records import duration_text
from .claims import claim_verdicts, claims_markdown
from .curves import plot_losses
from .grid import Grid
from .records import RunRecord
from .scaling import ScalingFit, plot_scaling, scaling_fits
from .summary import Key, VariantSummary, best_runs, summarise
from .variants import PREDICTIONS, as_predicted

INTRO = (
    "Each (size, variant) is taken at its own best learning rate: of the learning rates with the most seeds finished, "
    "the one of lowest mean final eval loss. Within a seed every variant starts from the same initial matrices and "
    "reads the same batches; Δ is a variant's eval loss minus its reference's (at the reference's best learning rate) "
    "in the same seed; 'holds': seeds in which Δ has the sign the paper predicts."
)


def write_report(records: list[RunRecord], grid: Grid, root: Path, figures: bool = True) -> tuple[str, str]:
    """Write the study's files into `root` from `records` (the finished runs of `grid`); returns the text of
    `results.md` and of `claims.md`."""
    best = best_runs(records)
    summaries = summarise(records)
    fits = scaling_fits(best)
    sizes = [size.name for size in grid.sizes]
    claims = claim_verdicts(best, sizes)
    table = results_markdown(records, best, summaries, fits, grid)
    results = {
        "grid": {
            "sizes": [asdict(size) for size in grid.sizes],
            "variants": grid.variants,
            "learning_rates": grid.learning_rates,
            "seeds": grid.seeds,
            "runs": len(grid.points()),
            "finished": len(records),
        },
        "summary": [asdict(s) for s in summaries],
        "scaling": {variant: asdict(fit) for variant, fit in fits.items()},
        "claims": [asdict(claim) for claim in claims],
        "runs": [asdict(r) for r in records],
    }
    write_text_atomically(root / "results.json", json.dumps(results, indent=2) + "\n")
    verdicts = claims_markdown(claims, grid.describe())
    write_text_atomically(root / "results.md", table)
    write_text_atomically(root / "claims.md", verdicts)
    if figures and records:
        plot_losses(best, root / "loss_curves.png")
        if len({size for size, _ in best}) > 1:
            plot_scaling(best, fits, root / "scaling.png")
    return table, verdicts


def results_markdown(
    records: list[RunRecord],
    best: dict[Key, list[RunRecord]],
    summaries: list[VariantSummary],
    fits: dict[str, ScalingFit],
    grid: Grid,
) -> str:
    rows = [
        f"# scalevec-ablate: {len(records)} of {len(grid.points())} runs finished",
        "",
        f"Grid: {grid.describe()}.",
        "",
        *(f"- {size.describe()}" for size in grid.sizes),
        "",
        INTRO,
    ]
    for size in grid.sizes:
        ours = [s for s in summaries if s.size == size.name]
        if ours:
            rows += [
                "",
                f"## {size.name}",
                "",
                *_size_tables(ours, {s.variant: best[size.name, s.variant] for s in ours}),
            ]
    if fits:
        rows += ["", "## Scaling", "", "Mean final eval loss at each size's best learning rate against N.", ""]
        rows += ["| variant | form | E | A | α | rms (nats) | sizes |", "|---|---|---|---|---|---|---|"]
        for variant, fit in fits.items():
            floor = "-" if fit.E is None else f"{fit.E:.4f}"
            rows.append(
                f"| {variant} | {fit.form} | {floor} | {fit.A:.4g} | {fit.alpha:.4f} | {fit.rms:.4f} "
                f"| {len(fit.parameters)} |"
            )
    rows += ["", "The paper's claims, each with its verdict: `claims.md`."]
    return "\n".join(rows) + "\n"


def _size_tables(summaries: list[VariantSummary], best: dict[str, list[RunRecord]]) -> list[str]:
    """The tables of one size: `best` maps each variant to its runs at its best learning rate."""
    rows = [
        "| variant | best lr | eval loss (mean ± std) | reference | Δ per seed | Δ (mean ± std) | paper | holds "
        "| final train loss | tokens | scale params | train time / run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        runs = best[s.variant]
        differences = list(s.differences.values())
        reference = f"{s.reference} (lr {s.reference_learning_rate:g})" if s.reference else "-"
        rows.append(
            f"| {s.variant} | {s.best_learning_rate:g} | {_mean_std(s.eval_loss_mean, s.eval_loss_std)} "
            f"| {reference} | {', '.join(f'{d:+.4f}' for d in differences) or '-'} "
            f"| {_spread(differences)} | {PREDICTIONS.get(s.expected, '-')} "
            f"| {f'{s.holds}/{len(differences)}' if s.expected else '-'} | {s.train_loss_mean:.4f} "
            f"| {runs[0].tokens:,} | {runs[0].scale_parameters:,} "
            f"| {duration_text(statistics.median(r.train_seconds for r in runs))} |"
        )
    learning_rates = list(dict.fromkeys(result.learning_rate for s in summaries for result in s.learning_rates))
    if len(learning_rates) > 1:
        rows += ["", "Final eval loss at every learning rate (mean ± std; seeds; the best in bold):", ""]
        rows += ["| variant | " + " | ".join(f"lr {lr:g}" for lr in learning_rates) + " |"]
        rows += ["|---|" + "---|" * len(learning_rates)]
        for s in summaries:
            cells = {result.learning_rate: result for result in s.learning_rates}
            rows.append(f"| {s.variant} | " + " | ".join(_cell(cells.get(lr), s) for lr in learning_rates) + " |")
    rows += ["", "Lowest eval loss first, per seed (each variant at its best learning rate):", ""]
    evaluated = [r for runs in best.values() for r in runs if r.eval_loss is not None]
    for seed in dict.fromkeys(r.seed for r in evaluated):
        ranked = sorted((r for r in evaluated if r.seed == seed), key=lambda r: r.eval_loss)
        rows.append(f"- seed {seed}: " + " < ".join(f"{r.variant} {r.eval_loss:.4f}" for r in ranked))
    failed = {}
    for s in summaries:
        for seed, difference in s.differences.items():
            if s.expected and not as_predicted(difference, s.expected):
                failed.setdefault(seed, []).append(s.variant)
    if any(s.expected for s in summaries):
        verdict = "yes" if not failed else "no: " + "; ".join(f"seed {k}: {', '.join(v)}" for k, v in failed.items())
        rows += ["", f"The paper's predictions hold in every seed: {verdict}."]
    return rows


def _cell(result, summary: VariantSummary) -> str:
    if result is None or result.eval_loss_mean is None:
        return "-"
    mean = f"{result.eval_loss_mean:.4f}"
    if result.learning_rate == summary.best_learning_rate:
        mean = f"**{mean}**"
    spread = "" if result.eval_loss_std is None else f" ± {result.eval_loss_std:.4f}"
    return f"{mean}{spread} ({len(result.seeds)})"


def _mean_std(mean: float | None, std: float | None) -> str:
    if mean is None:
        return "-"
    return f"{mean:.4f}" if std is None else f"{mean:.4f} ± {std:.4f}"


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    std = statistics.stdev(values) if len(values) > 1 else None
    return f"{statistics.mean(values):+.4f}" + ("" if std is None else f" ± {std:.4f}")
