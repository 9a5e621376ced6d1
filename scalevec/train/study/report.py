"""The files a study writes into its folder from the records of its grid (`records.grid_records`): `results.md` and
`results.json` (which runs finished, diverged or are missing; each size and variant at its best learning rate;
every learning rate; the scaling fits; loss against tokens and the fit of L(N, D) where `--decay-at` branched budgets;
the claims; every run's and every budget's record), `claims.md`, and the figures
`loss_curves.png` (from the run folders, when they are all there) and `scaling.png`. The text files are a function of
the records alone, so `results.json`'s records write them again byte for byte. Every file is replaced whole
(atomically): shards writing them at once leave the last complete one."""

import json
import math
import statistics
from dataclasses import asdict
from pathlib import Path

from ...atomic import write_text_atomically
from ...run_records import duration_text
from .budgets import NOT_TESTED, BudgetRow, SurfaceFit, fit_surfaces, fits_markdown, markdown_table
from .claims import DEFAULT_THRESHOLDS, Thresholds, claim_verdicts, claims_markdown, interval_text
from .curves import plot_losses
from .grid import Grid
from .intervals import bootstrap_caveat, paired_interval
from .metric import LOSS, describe_metric
from .records import DIVERGED, FINISHED, MISSING, RunRecord, records_json
from .scaling import COUNTS, REPLICATES, ScalingFit, plot_scaling, scaling_fits
from .summary import SELECTED, Key, VariantSummary, best_runs, summarise
from .variants import PREDICTIONS

SHOWN_RUNS = 20  # diverged or missing runs listed before "and N more"
INTRO = (
    "Each (size, variant) is taken at its own best learning rate: the one of lowest mean loss over the grid's seeds "
    "on the selection half of the held-out blocks (`eval_select_loss`); a rate at which a seed diverged loses. It "
    "counts only once every learning rate of the grid finished or diverged in every seed. Losses and Δ are on the "
    "other, disjoint half (`eval_report_loss`). Within a seed every variant starts from the same initial matrices "
    "and reads the same batches; Δ is a variant's loss minus its reference's (at the reference's best learning "
    "rate) in the same seed, with a 95 % Student t interval over seeds. Verdicts: `claims.md`."
)


def write_report(
    records: list[RunRecord],
    grid: Grid,
    root: Path,
    figures: bool = True,
    budget_fits: bool = True,
    metric: str = LOSS,
    kept: list[RunRecord] = (),
    thresholds: Thresholds = DEFAULT_THRESHOLDS,
) -> tuple[str, str]:
    """Write the study's files into `root` from `records` (every point of `grid`'s, then the budgets branched from
    them); returns the text of `results.md` and of `claims.md`. Without `figures` no picture is drawn, and without
    `budget_fits` no L(N, D) fit (its bootstrap takes seconds per variant): the rewrite after every run skips both.
    The claims are judged on `metric` (`study.metric`), the learning rates chosen on the held-out loss. `kept`:
    records outside `grid` (of an earlier, wider grid) that `results.json` keeps without reporting them;
    `thresholds`: the verdicts' floor and non-inferiority margin (`--min-effect`, `--quantization-margin`)."""
    branches = [r for r in records if r.budget is not None]
    records = [r for r in records if r.budget is None]
    summaries = summarise(records, grid, metric)
    best = best_runs(records, summaries)
    sizes = grid.size_names()
    fits = scaling_fits(best, sizes, len(grid.seeds), {(s.size, s.variant) for s in summaries})
    claims = claim_verdicts(summaries, fits, sizes, metric, thresholds)
    runs = status_lines(records)
    rows = budget_rows(best, branches)
    surfaces = fit_surfaces(rows) if budget_fits and rows else None
    table = results_markdown(records, runs, best, summaries, fits, grid, metric)
    if branches:
        table += "\n" + "\n".join(budgets_section(rows, surfaces)) + "\n"
    verdicts = claims_markdown(claims, grid.describe(), runs, metric, thresholds)
    grids = {"grids": [_grid_json(part) for part in grid.parts]} if grid.parts else {"grid": _grid_json(grid)}
    results = {
        **grids,
        "metric": metric,
        "counts": {status: sum(r.status == status for r in records) for status in (FINISHED, DIVERGED, MISSING)},
        "summary": [asdict(s) for s in summaries],
        "scaling": [{k: v for k, v in asdict(fit).items() if k != "replicate_alphas"} for fit in fits],
        "claims": [asdict(claim) for claim in claims],
        "budget_fits": None if surfaces is None else {v: asdict(fit) for v, fit in surfaces.items()},
        "runs": records_json([*records, *branches, *kept]),
    }
    write_text_atomically(root / "results.json", json.dumps(_finite(results), indent=2) + "\n")
    write_text_atomically(root / "results.md", table)
    write_text_atomically(root / "claims.md", verdicts)
    if figures and best:
        if all((run.point.folder(root) / "trainer_state.json").is_file() for runs in best.values() for run in runs):
            plot_losses(best, root, root / "loss_curves.png")
        if fits:
            plot_scaling(best, fits, root / "scaling.png")
    return table, verdicts


def _grid_json(grid: Grid) -> dict:
    return {
        "sizes": [asdict(size) for size in grid.sizes],
        "variants": grid.variants,
        "learning_rates": grid.learning_rates,
        "seeds": grid.seeds,
        "budgets": grid.budgets,
        "runs": len(grid.points()),
    }


def _finite(value):
    """`value` with every non-finite float as None (JSON has no NaN)."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(item) for item in value]
    return value


def budget_rows(best: dict[Key, list[RunRecord]], branches: list[RunRecord]) -> list[BudgetRow]:
    """Each run's report-half loss at every budget, the run itself (fraction 1) and its branches, of each size and
    variant at its best learning rate: chosen on the whole budget's selection half, whichever budget is shown."""
    rows = []
    for (size, variant), runs in best.items():
        rate = runs[0].learning_rate
        budgets = [r for r in branches if (r.size, r.variant, r.learning_rate) == (size, variant, rate)]
        for r in [*runs, *budgets]:
            if r.status == FINISHED and r.eval_report_loss is not None:
                fraction = 1.0 if r.budget is None else r.budget
                rows.append(
                    BudgetRow(
                        variant, size, r.non_embedding_parameters, r.tokens, r.seed, r.eval_report_loss, fraction
                    )
                )
    return rows


def budgets_section(rows: list[BudgetRow], fits: dict[str, SurfaceFit] | None) -> list[str]:
    """Loss against tokens per size, and the fit of L(N, D) over sizes and budgets (or why there is none)."""
    lines = [
        "## Loss against tokens",
        "",
        "Report-half loss (`eval_report_loss`: mean ± standard deviation over seeds, and their number) at each budget "
        "`--decay-at` branched from the runs (the run itself is the budget 1; a branch trains the cooldown of a run "
        "of that many tokens from the run's stable phase), each variant at the learning rate chosen on the whole "
        "budget's selection half: the smaller budgets are not tuned on their own.",
        "",
        markdown_table(rows),
        "",
    ]
    if fits is None:
        return [
            *lines,
            "The L(N, D) fit is in the study's final report and in `--report-only`'s (its seed bootstrap "
            "takes seconds per variant), not in the rewrite after each run.",
        ]
    if all(fit.status == NOT_TESTED for fit in fits.values()):
        reasons = "; ".join(f"{variant}: {fit.reason}" for variant, fit in fits.items())
        return [*lines, f"L(N, D) = E + A·N^-α + B·D^-β: not tested ({reasons})."]
    return [*lines, "Fitted on the report-half losses above.", "", fits_markdown(fits)]


def status_lines(records: list[RunRecord]) -> list[str]:
    """Which runs finished, which diverged (at which step) and which are missing: the lines every report leads with.
    Runs are listed by size, variant and learning rate, with their seeds."""
    counts = {status: [r for r in records if r.status == status] for status in (FINISHED, DIVERGED, MISSING)}
    lines = [
        f"Runs: {len(counts[FINISHED])} finished, {len(counts[DIVERGED])} diverged, {len(counts[MISSING])} missing, "
        f"of the grid's {len(records)}."
    ]
    for status in (DIVERGED, MISSING):
        groups = {}
        for r in counts[status]:
            seed = f"{r.seed} (step {r.step})" if status == DIVERGED else str(r.seed)
            groups.setdefault(f"{r.size} {r.variant} lr {r.learning_rate:g}", []).append(seed)
        shown = [f"{run}: seed{'s' * (len(seeds) > 1)} {', '.join(seeds)}" for run, seeds in groups.items()]
        if shown:
            more = len(shown) - SHOWN_RUNS
            rest = f"; and {more} more (`results.json` lists every run)" if more > 0 else ""
            lines.append(f"{status.capitalize()}: " + "; ".join(shown[:SHOWN_RUNS]) + rest + ".")
    return lines


def results_markdown(
    records: list[RunRecord],
    runs: list[str],
    best: dict[Key, list[RunRecord]],
    summaries: list[VariantSummary],
    fits: list[ScalingFit],
    grid: Grid,
    metric: str = LOSS,
) -> str:
    finished = sum(r.status == FINISHED for r in records)
    rows = [
        f"# scalevec-ablate: {finished} of {len(records)} runs finished",
        "",
        *runs,
        "",
        f"Grid: {grid.describe()}.",
        "",
        *(f"- {size.describe()}" for size in grid.sizes),
        "",
        INTRO,
        "",
        describe_metric(metric),
    ]
    for size in grid.sizes:
        ours = [s for s in summaries if s.size == size.name]
        rows += ["", f"## {size.name}", "", *_size_tables(ours, best, metric)]
    rows += ["", "## Scaling", "", *scaling_table(fits)]
    rows += ["", "The paper's claims, each with its verdict: `claims.md`."]
    return "\n".join(rows) + "\n"


def scaling_table(fits: list[ScalingFit]) -> list[str]:
    if not fits:
        return ["No fit: it needs 4 sizes or more, each variant at its best learning rate at every one."]
    rows = [
        f"L = E + A·N^-α, a Huber fit (δ = 1e-3) on log L of every seed's report-half loss at each size's best "
        f"learning rate; 95 % intervals: percentiles of {REPLICATES} refits on seeds resampled with replacement."
        + (f" {caveat}" if (caveat := bootstrap_caveat(min(len(fit.seeds) for fit in fits))) else ""),
        "",
        "| variant | N counted | E [95 %] | at a bound | A | α [95 %] | rms of the means (nats) | sizes | seeds |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for fit in fits:
        rows.append(
            f"| {fit.variant} | {fit.counted} | {fit.E:.4f} [{fit.E_interval[0]:.4f}, {fit.E_interval[1]:.4f}] "
            f"| {', '.join(fit.at_bound) or 'no'} | {fit.A:.4g} | {fit.alpha:.4f} [{fit.alpha_interval[0]:.4f}, "
            f"{fit.alpha_interval[1]:.4f}] | {fit.rms:.4f} | {len(fit.parameters)} | {len(fit.seeds)} |"
        )
    return rows


def _size_tables(summaries: list[VariantSummary], best: dict[Key, list[RunRecord]], metric: str) -> list[str]:
    figure = "report loss" if metric == LOSS else metric
    rows = [
        f"| variant | best lr | {figure} (mean ± std) | reference | Δ per seed | mean Δ [95 %] | paper "
        "| final train loss | tokens | parameters (non-embedding / total / active) | scale params | train time / run "
        "| learning-rate grid |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        if s.status != SELECTED:
            why = f"incomplete: {len(s.missing)} missing" if s.missing else "no rate selectable"
            rows.append(f"| {s.variant} | {why} |" + " - |" * 11)
            continue
        runs = best[s.size, s.variant]
        first = runs[0]
        counts = " / ".join(
            "-" if getattr(first, name) is None else f"{getattr(first, name):,}" for name in COUNTS.values()
        )
        differences = list(s.differences.values())
        interval = interval_text(paired_interval(differences)) if differences else "-"
        reference = f"{s.reference} (lr {s.reference_learning_rate:g})" if s.reference else "-"
        trained = "-" if s.train_loss_mean is None else f"{s.train_loss_mean:.4f}"
        seconds = [r.train_seconds for r in runs if r.train_seconds is not None]
        rows.append(
            f"| {s.variant} | {s.best_learning_rate:g} | {_mean_std(s.report_loss_mean, s.report_loss_std)} "
            f"| {reference} | {', '.join(f'{d:+.4f}' for d in differences) or '-'} | {interval} "
            f"| {PREDICTIONS.get(s.expected, '-')} | {trained} | {first.tokens:,} | {counts} "
            f"| {'-' if first.scale_parameters is None else f'{first.scale_parameters:,}'} "
            f"| {duration_text(statistics.median(seconds)) if seconds else '-'} | {s.edge or 'inside'} |"
        )
    # a study of several grids may try other rates for some variants of a size: theirs only ("-" for the others)
    rates = list(dict.fromkeys(result.learning_rate for s in summaries for result in s.learning_rates))
    rows += ["", "Selection-half loss at every learning rate (mean over the seeds; the best in bold):", ""]
    rows += ["| variant | " + " | ".join(f"lr {lr:g}" for lr in rates) + " |", "|---|" + "---|" * len(rates)]
    for s in summaries:
        tried = {result.learning_rate: result for result in s.learning_rates}
        cells = [_cell(tried[lr], s) if lr in tried else "-" for lr in rates]
        rows.append(f"| {s.variant} | " + " | ".join(cells) + " |")
    return rows


def _cell(result, summary: VariantSummary) -> str:
    notes = [f"{len(seeds)} {name}" for seeds, name in ((result.diverged, "diverged"), (result.missing, "missing"))]
    notes = [note for note in notes if not note.startswith("0 ")]
    if result.select_loss_mean is None:
        return "; ".join(notes) or "not evaluated"
    mean = f"{result.select_loss_mean:.4f}"
    if result.learning_rate == summary.best_learning_rate:
        mean = f"**{mean}**"
    return mean


def _mean_std(mean: float | None, std: float | None) -> str:
    if mean is None:
        return "-"
    return f"{mean:.4f}" if std is None else f"{mean:.4f} ± {std:.4f}"
