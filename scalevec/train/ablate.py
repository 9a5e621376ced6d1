"""`scalevec-ablate`: the paper's study in one command. Trains a grid of model sizes x scale-vector variants x
learning rates x seeds on the same data, compares every (size, variant) at its own best learning rate, fits how the
loss scales with size, and tests each of the paper's claims.

scalevec-ablate --model-size tiny --max-steps 300 --seeds 0,1,2 --output-dir runs/ablation
scalevec-ablate --sizes 2x64,4x128,4x256 --tokens-per-parameter 20 --learning-rates 1e-3,3e-3 \\
    --variants none,standard,unified --seeds 0,1 --resume --output-dir runs/ladder
scalevec-ablate ... --shard 0/4 --resume        # one of 4 processes or machines sharing the output folder
scalevec-ablate ... --report-only true          # the report from the runs that finished, training nothing
scalevec-ablate --report-only true --merge-records shard1,shard2 --output-dir shard0   # shards' own folders, one study

Every `scalevec-train` option applies to all runs, except what each grid point sets: the scale strategy and the
scales' weight decay (the variant), the model's dimensions (--sizes), --learning-rate (--learning-rates), --seed
(--seeds) and --max-steps (--tokens-per-parameter). Within a seed every variant of a size starts from the same
initial matrices and reads the same batches in the same order, so variants are compared seed by seed (paired
differences). Each run has its own folder, SIZE/VARIANT-lrLR-seedSEED; with `--resume`, finished and diverged runs
are reused, whether their folders or only the study's `results.json` record them, so sizes, variants, learning rates
or seeds can be added later and shards can be restarted, on any machine that has the records.

A run whose loss or weights become non-finite is recorded as diverged (`diverged.json` in its folder: the step and
its learning rate) and the shard goes on: a diverged rate is a result, which loses the learning-rate selection. Each
variant's learning rate is chosen on one half of the held-out blocks (`eval_select_loss`) and compared on the other
(`eval_report_loss`), so the study needs held-out data (the default --eval-every, or --eval-dataset) and refuses to
start without it. The report (`results.md`, `results.json`, `claims.md`, `loss_curves.png`, `scaling.png`) leads
with the runs finished, diverged and missing, names what each unfinished comparison lacks (*incomplete*), and gives
each claim a 95 % interval over seeds and a verdict (`study.intervals`). It is written from the records of the
grid's runs, whichever process trained them, and again after every run, so a killed study still reports what
finished; `results.json` holds every run's record (never fewer than it held) and the grid, and `--report-only true`
over a folder that holds only it writes the same text reports, from the grid it records unless grid flags are given.
Calls with other sizes, variants or learning rates into one folder (a design that is no product: every variant at
the largest size, a ladder of sizes for a few) each add their grid to it, and every report covers their union.

With `--decay-at` (WSD), each budget a run branches is a record too, and the report gives loss against tokens at
each variant's chosen rate and, in the final report, a fit of L(N, D). `--metric` judges the claims on another logged
figure (a task's accuracy, say; its direction from its name). `--quantize int8,int4` evaluates each finished run's
final model with quantized weights on the report half, for the claim that unified quantizes within a margin of
standard (`--quantization-margin`); `--min-effect` is the floor below which no paired claim holds.
"""

import json
import sys
from dataclasses import astuple, replace
from pathlib import Path

from ..atomic import exit_status, write_text_atomically
from ..configuration_scalevec import SCALE_FIELDS
from ..data import DataArguments
from ..data.held_out import set_names
from ..evaluation.quantization import parse_schemes
from ..evaluation.tasks import parse_task_list
from ..run_records import TRAINING_DATA, TaskScores, finished_step, read_json
from .arguments import ScaleVecTrainingArguments
from .branches import Budget, decay_fractions, plan_budgets, unfinished_budgets
from .cli import ModelArguments, check_output_dir, config_overrides, parse_arguments, train
from .presets import SIZE_FIELDS
from .run_report import tokens_per_step
from .study.arguments import RESULTS, AblationArguments
from .study.claims import Thresholds
from .study.grid import Grid, GridPoint, build_sizes
from .study.intervals import MIN_SEEDS
from .study.metric import check_logged, metric_name
from .study.records import (
    DIVERGED,
    FINISHED,
    MISSING,
    QUANTIZED_FILE,
    RunRecord,
    branch_records,
    grid_records,
    has_grid,
    load_records,
    record_diverged,
    recorded_grid,
    run_status,
)
from .study.report import write_report
from .study.variants import VARIANTS
from .trainer import NonFiniteLossError

_STRATEGY_FIELDS = ("scale_preset", *SCALE_FIELDS)


def build_grid(
    ablation: AblationArguments,
    model_args: ModelArguments,
    data_args: DataArguments,
    training_args: ScaleVecTrainingArguments,
) -> Grid:
    overrides = config_overrides(model_args.config_overrides)
    clash = [key for key in SIZE_FIELDS if key in overrides]
    if ablation.sizes is not None and clash:
        raise ValueError(f"--config-overrides sets {clash[0]}, which --sizes sets for each size")
    per_parameter = ablation.tokens_per_parameter
    if per_parameter is not None and not per_parameter > 0:
        raise ValueError(f"--tokens-per-parameter must be > 0; got {per_parameter}")
    if per_parameter is not None and training_args.max_steps > 0:
        raise ValueError("--tokens-per-parameter sets each size's --max-steps: give one of the two")
    per_step = tokens_per_step(training_args, data_args.resolved_seq_len())
    names = ablation.size_names(model_args.model_size)
    sizes = build_sizes(names, model_args.model_size, overrides, per_step, per_parameter, training_args.max_steps)
    rates = ablation.learning_rate_list(training_args.learning_rate)
    budgets = [fraction for fraction in decay_fractions(training_args.decay_at) if fraction < 1]
    return Grid(sizes, ablation.variant_names(), rates, ablation.seed_list(training_args.seed), budgets)


def study_grid(
    ablation: AblationArguments,
    model_args: ModelArguments,
    data_args: DataArguments,
    training_args: ScaleVecTrainingArguments,
    recorded: dict[Path, dict],
) -> tuple[Grid, Grid]:
    """The grid of this call and the study's, the one reported. With `--report-only` and no grid flag, both are the
    union of the grids the records (`recorded`: results.json files by path, this folder's first) hold; else the
    call's is the flags', which must define each size as the records do. A call that trains adds its grid to the
    records' (the report covers them all); `--report-only` with grid flags reports that grid alone, which must
    hold some recorded run."""
    grids = {path: recorded_grid(results) for path, results in recorded.items() if has_grid(results)}
    recorded_union = None
    for path, theirs in grids.items():  # shards' records of one study define each size alike
        if recorded_union is not None and (why := theirs.contradiction(recorded_union)) is not None:
            raise ValueError(
                f"the study's records contradict each other: {why} (there: those before {path}; here: it)"
            )
        recorded_union = theirs if recorded_union is None else Grid.union([recorded_union, theirs])
    if ablation.report_only and not ablation.grid_flags() and grids:
        return recorded_union, recorded_union
    grid = build_grid(ablation, model_args, data_args, training_args)
    for path, theirs in grids.items():
        if (why := grid.contradiction(theirs)) is not None:
            raise ValueError(
                f"the grid's flags contradict {path}: {why}; give the study's own flags (with --report-only, none), "
                "or another --output-dir"
            )
    if ablation.report_only and grids:
        points = set(grid.points())
        if not any(
            r.point in points for path, results in recorded.items() for r in load_records(results, path).values()
        ):
            path = next(iter(grids))
            raise ValueError(
                f"--report-only: none of the {len(points)} runs that {', '.join(ablation.grid_flags())} give is "
                f"recorded in {path} (its grid: {grids[path].describe()}); give no grid flags to report that grid"
            )
        return grid, grid
    return grid, Grid.union([recorded_union, grid]) if grids else grid


def run_ablation(
    ablation: AblationArguments,
    model_args: ModelArguments,
    data_args: DataArguments,
    training_args: ScaleVecTrainingArguments,
) -> list[RunRecord]:
    """Train this process's share of the grid (what --resume finds finished is reused), then write the report from
    every finished run of the grid; returns those runs (on the main process; nothing on the others)."""
    chosen = [name for name in _STRATEGY_FIELDS if getattr(model_args, name) is not None]
    if chosen:
        raise ValueError(f"--{chosen[0].replace('_', '-')}: scalevec-ablate sets the scale strategy per variant")
    root = Path(training_args.output_dir)
    if ablation.report_only and not root.is_dir():
        raise ValueError(f"--output-dir {root}: no such folder, so nothing to report")
    own = read_json(root / RESULTS)
    merged_results = ablation.merged_results()
    grid, study = study_grid(
        ablation, model_args, data_args, training_args, {**({root / RESULTS: own} if own else {}), **merged_results}
    )
    budgets = {size.name: plan_budgets(training_args, size.max_steps) for size in grid.sizes}  # checked up front
    if not ablation.report_only:
        steps = [size.max_steps for size in grid.sizes if size.max_steps > 0]
        if training_args.logging_steps >= 1 and steps and min(steps) < training_args.logging_steps:
            raise ValueError("--logging-steps exceeds --max-steps: no training loss would be logged to compare")
    merged = {}
    for path, results in merged_results.items():
        merged = joined(merged, load_records(results, path))
    metric = metric_name(ablation.metric)
    thresholds = Thresholds(ablation.min_effect, ablation.quantization_margin)
    schemes = parse_schemes(ablation.quantize) if ablation.quantize else []
    if not ablation.report_only:
        check_held_out(data_args)
        check_metric_configured(metric, data_args)
    records = study_records(study, root, merged)
    if ablation.report_only and all(r.status == MISSING for r in records):
        raise ValueError(
            f"--output-dir {root}: no run of the grid ({study.describe()}) finished or diverged here, in a run folder "
            f"or in {RESULTS}: nothing to report"
        )
    check_logged(metric, records)  # runs already recorded must have logged it
    index, count = ablation.shard_index()
    share = grid.shard(index, count)
    recorded = {r.key: r for r in records}
    done = [p for p in share if _done(p, root, recorded, budgets[p.size])]
    todo = [] if ablation.report_only else [p for p in share if not (model_args.resume and p in done)]
    for point in todo:  # before anything trains: a folder of the grid that holds files needs --resume
        check_output_dir(point.folder(root), model_args.resume)
    again = [p for p in todo if recorded[(*astuple(p), None)].status != MISSING and not model_args.resume]
    if again:  # a run the records hold is trained over only with the user's word
        raise ValueError(
            f"--output-dir {root}: {len(again)} runs of this share are recorded as finished or diverged (e.g. "
            f"{again[0].size} {again[0].variant} lr {again[0].learning_rate:g} seed {again[0].seed}); pass --resume "
            "to keep them, or choose another folder (nothing is overwritten)"
        )
    main_process = training_args.process_index == 0
    if main_process:
        print(study_plan(grid, (index, count), len(done), len(todo), ablation.report_only), flush=True)
    for number, point in enumerate(todo, 1):
        _train(point, grid, model_args, data_args, training_args, budgets[point.size])
        if main_process:
            _quantize(grid, point, root, schemes, training_args.per_device_eval_batch_size)
            study = with_grids_recorded_since(study, root)
            records = study_records(study, root, merged)
            done_now = next(r for r in records if r.point == point and r.budget is None)
            print(f"[ablation] {number}/{len(todo)} {done_now.describe()}", flush=True)
            # a killed study still reports; figures and the budgets' bootstrap fits only at the end
            kept = kept_records(records, root, merged)
            write_report(
                records, study, root, figures=False, budget_fits=False, metric=metric, kept=kept, thresholds=thresholds
            )
    if not main_process:
        return []
    for point in [] if ablation.report_only else share:  # finished runs --resume kept, trained without --quantize
        _quantize(grid, point, root, schemes, training_args.per_device_eval_batch_size)
    if not ablation.report_only:
        study = with_grids_recorded_since(study, root)
    records = study_records(study, root, merged)
    kept = kept_records(records, root, merged)
    print(*write_report(records, study, root, metric=metric, kept=kept, thresholds=thresholds), sep="\n")
    runs = [r for r in records if r.budget is None]
    counts = {status: sum(r.status == status for r in runs) for status in (FINISHED, DIVERGED, MISSING)}
    print(
        f"[ablation] trained {len(todo)} runs; of the grid's {len(runs)}: "
        + ", ".join(f"{count} {status}" for status, count in counts.items())
    )
    print(f"results in {root}")
    return records


def with_grids_recorded_since(study: Grid, root: Path) -> Grid:
    """`study` joined with the grids the folder's `results.json` records now: calls of other grids that train into
    the same folder at the same time (shards of a study's groups) write it too, and no report may drop their grids
    (whose runs it would then no longer report)."""
    results = read_json(root / RESULTS)
    if not results or not has_grid(results):
        return study
    theirs = recorded_grid(results)
    if (why := study.contradiction(theirs)) is not None:
        raise ValueError(
            f"{root / RESULTS}: a call that trains into this folder meanwhile recorded another grid: {why}"
        )
    return Grid.union([theirs, study])


def check_held_out(data_args: DataArguments) -> None:
    """Refuse a study without held-out data to choose learning rates on and to report on (two halves of a block)."""
    if not (data_args.eval_dataset or data_args.held_out_every):
        raise ValueError(
            "scalevec-ablate chooses each learning rate on held-out data and reports on another half of it: keep "
            "the default --eval-every or give --eval-dataset"
        )
    budget = data_args.eval_token_budget()
    if budget is not None and budget < 2 * data_args.resolved_seq_len():
        raise ValueError(
            f"--max-eval-tokens {budget}: scalevec-ablate needs 2 held-out blocks of --seq-len at least (one half to "
            "choose learning rates on, one to report on)"
        )


def _quantize(grid: Grid, point: GridPoint, root: Path, schemes: list[str], batch_size: int) -> None:
    """`evaluate_quantized` for `point`'s run where it finished and lacks a scheme of `schemes`."""
    folder = point.folder(root)
    done = read_json(folder / QUANTIZED_FILE) or {}
    if schemes and not set(schemes) <= set(done) and run_status(grid, point, root) == FINISHED:
        evaluate_quantized(folder, schemes, batch_size)


def evaluate_quantized(folder: Path, schemes: list[str], batch_size: int) -> None:
    """Write `quantized.json` into the finished run's `folder`: the loss on the report half of the blocks its
    evaluations read (as `training_data.json` recorded them) of its final model unquantized ("none") and with each
    scheme's weights, by `scalevec-eval`'s evaluation (the Trainer's block evaluation), on this process alone."""
    import torch
    from transformers import AutoTokenizer

    from ..data.held_out import EvaluationRecord, evaluation_halves, recorded_evaluation
    from ..evaluation.model import evaluate_model
    from ..evaluation.quantization import quantize_weights
    from ..modeling_scalevec import ScaleVecForCausalLM

    evaluation = EvaluationRecord.read(read_json(folder / TRAINING_DATA) or {})
    if evaluation is None or not evaluation.sets:
        raise ValueError(f"--quantize: {folder / TRAINING_DATA} records no held-out blocks to evaluate")
    report = {name: evaluation_halves(blocks)[1] for name, blocks in recorded_evaluation(evaluation).items()}
    tokenizer = AutoTokenizer.from_pretrained(folder)
    losses = {}
    for scheme in ["none", *schemes]:  # each from the saved weights, loaded again: quantizing is in place
        model = ScaleVecForCausalLM.from_pretrained(folder, dtype=torch.float32)
        model = model if scheme == "none" else quantize_weights(model, scheme)
        losses[scheme] = evaluate_model(model, tokenizer, [], report, batch_size=batch_size).held_out["loss"]
    write_text_atomically(folder / QUANTIZED_FILE, json.dumps(losses, indent=2) + "\n")


def check_metric_configured(metric: str, data_args: DataArguments) -> None:
    """Refuse, before anything trains, a --metric the runs of this configuration will not log."""
    logged = ["eval_loss", "eval_perplexity", "eval_bits_per_byte"]
    if data_args.eval_tasks:
        tasks = set_names(parse_task_list(data_args.eval_tasks))
        logged += TaskScores.metric_names(tasks)
    if metric not in logged:
        raise ValueError(f"--metric {metric}: these runs will not log it; they log {', '.join(logged)}")


def recorded_runs(root: Path, merged: dict[tuple, RunRecord] | None = None) -> dict[tuple, RunRecord]:
    """The records of the folder's `results.json`, then those of `merged` (other shards', `--merge-records`) for the
    runs it has no record of, or only a missing one."""
    results = read_json(root / RESULTS)
    return joined(load_records(results, root / RESULTS) if results else {}, merged or {})


def joined(first: dict[tuple, RunRecord], then: dict[tuple, RunRecord]) -> dict[tuple, RunRecord]:
    """The records of `first`, and those of `then` for the runs `first` has no record of, or only a missing one."""
    return {**first, **{key: r for key, r in then.items() if key not in first or first[key].status == MISSING}}


def study_records(grid: Grid, root: Path, merged: dict[tuple, RunRecord] | None = None) -> list[RunRecord]:
    """Every point's record (from its run folder, else from the folder's `results.json` or `merged`, else missing),
    then those of the budgets `--decay-at` branched from the runs (likewise)."""
    recorded = recorded_runs(root, merged)
    return [*grid_records(grid, root, recorded), *branch_records(grid, root, recorded)]


def kept_records(records: list[RunRecord], root: Path, merged: dict[tuple, RunRecord] | None) -> list[RunRecord]:
    """The records outside `records` (of runs or budgets the grid no longer holds) that `results.json` keeps: a
    report never writes fewer records than the folder and `merged` held."""
    written = {record.key for record in records}
    return [record for key, record in recorded_runs(root, merged).items() if key not in written]


def study_plan(grid: Grid, shard: tuple[int, int], done: int, todo: int, report_only: bool) -> str:
    """What the call will train: the grid, each size's length of run, this process's share."""
    lines = [
        f"[ablation] grid: {grid.describe()}: variants {', '.join(grid.variants)}; learning rates "
        f"{', '.join(f'{lr:g}' for lr in grid.learning_rates)}; seeds {', '.join(map(str, grid.seeds))}",
        *(f"[ablation]   {size.describe()}" for size in grid.sizes),
    ]
    index, count = shard
    total = len(grid.points())
    shares = [len(grid.shard(i, count)) for i in range(count)]
    share = f"shard {index}/{count}: {shares[index]} of the {total} runs" if count > 1 else f"all {total} runs"
    if count > 1:
        share += f" (shares of {', '.join(map(str, shares))})"
    what = "report only: training nothing" if report_only else f"to train now: {todo}"
    lines.append(f"[ablation] {share}; finished or diverged already: {done}; {what}")
    if len(grid.seeds) < MIN_SEEDS:
        lines.append(
            f"[ablation] {len(grid.seeds)} seed{'s' * (len(grid.seeds) > 1)}: no claim can be resolved (a verdict "
            f"pairs {MIN_SEEDS} seeds or more), so every tested claim will read unresolved; give --seeds with "
            f"{MIN_SEEDS} or more to decide them"
        )
    return "\n".join(lines)


def _train(
    point: GridPoint,
    grid: Grid,
    model_args: ModelArguments,
    data_args: DataArguments,
    training_args: ScaleVecTrainingArguments,
    budgets: list[Budget],
) -> None:
    size, variant = grid.size(point.size), VARIANTS[point.variant]
    folder = point.folder(Path(training_args.output_dir))
    args = replace(
        training_args,
        output_dir=str(folder),
        run_name=f"{point.size}/{folder.name}",
        seed=point.seed,
        learning_rate=point.learning_rate,
        max_steps=size.max_steps,
        eval_halves=True,  # learning rates are chosen on one half of the held-out blocks, Δ reported on the other
        **variant.training_overrides(training_args.weight_decay),
    )
    model = replace(model_args, model_size=size.preset, config_overrides=size.config_overrides, **variant.model)
    run = f"{point.size} {point.variant} lr {point.learning_rate:g} seed {point.seed}"
    while True:  # once, and again after each cooldown that diverged, for the budgets after it
        try:
            train(model, data_args, args)
            return
        except NonFiniteLossError as error:  # a result, not a crash: the shard goes on
            # the run finished: a branch's cooldown diverged (`branch_runs` trains the first unfinished budget first)
            branch = unfinished_budgets(folder, budgets)[0] if finished_step(folder, args.max_steps) else None
            if training_args.process_index == 0:
                where = folder if branch is None else branch.folder(folder)
                record_diverged(where, error.step, error.learning_rate, str(error))
                print(f"[ablation] {run}{'' if branch is None else f' budget {branch.fraction:g}'}: {error}")
            if branch is None:
                return
            model = replace(model, resume=True)


def _done(point: GridPoint, root: Path, recorded: dict[tuple, RunRecord], budgets: list[Budget]) -> bool:
    """Whether `point` diverged, or finished with every budget of `budgets` (those --decay-at branches from its
    size's runs), in its run folder or in the records (`recorded`, by key: the study's records of runs and
    budgets)."""
    status = recorded[(*astuple(point), None)].status
    if status != FINISHED:
        return status == DIVERGED
    unfinished = unfinished_budgets(point.folder(root), budgets)
    return all((*astuple(point), b.fraction) in recorded for b in unfinished)  # branch records: never missing


ABLATE_ARGUMENTS = (AblationArguments, ModelArguments, DataArguments, ScaleVecTrainingArguments)


def main(argv: list[str] | None = None) -> int:
    def ablate() -> None:
        run_ablation(*parse_arguments(sys.argv[1:] if argv is None else argv, ABLATE_ARGUMENTS))

    return exit_status("scalevec-ablate", ablate, (ValueError, NonFiniteLossError))


if __name__ == "__main__":
    sys.exit(main())
