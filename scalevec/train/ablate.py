"""`scalevec-ablate`: the paper's study in one command. Trains a grid of model sizes x scale-vector variants x
learning rates x seeds on the same data, compares every (size, variant) at its own best learning rate, fits how the
loss scales with size, and tests each of the paper's claims.

scalevec-ablate --model-size tiny --max-steps 300 --seeds 0,1,2 --output-dir runs/ablation
scalevec-ablate --sizes 2x64,4x128,4x256 --tokens-per-parameter 20 --learning-rates 1e-3,3e-3 \\
    --variants none,standard,unified --seeds 0,1 --resume --output-dir runs/ladder
scalevec-ablate ... --shard 0/4 --resume        # one of 4 processes or machines sharing the output folder
scalevec-ablate ... --report-only true          # the report from the runs that finished, training nothing

Every `scalevec-train` option applies to all runs, except what each grid point sets: the scale strategy and the
scales' weight decay (the variant), the model's dimensions (--sizes), --learning-rate (--learning-rates), --seed
(--seeds) and --max-steps (--tokens-per-parameter). Within a seed every variant of a size starts from the same
initial matrices and reads the same batches in the same order, so variants are compared seed by seed (paired
differences). Each run has its own folder, SIZE/VARIANT-lrLR-seedSEED; with `--resume`, finished and diverged runs
are reused, so sizes, variants, learning rates or seeds can be added later and shards can be restarted.

A run whose loss or weights become non-finite is recorded as diverged (`diverged.json` in its folder: the step and
its learning rate) and the shard goes on: a diverged rate is a result, which loses the learning-rate selection. Each
variant's learning rate is chosen on one half of the held-out blocks (`eval_select_loss`) and compared on the other
(`eval_report_loss`), so the study needs held-out data (the default --eval-every, or --eval-dataset) and refuses to
start without it. The report (`results.md`, `results.json`, `claims.md`, `loss_curves.png`, `scaling.png`) leads
with the runs finished, diverged and missing, names what each unfinished comparison lacks (*incomplete*), and gives
each claim a 95 % interval over seeds and a verdict (`study.intervals`). It is written from the records of the
grid's runs, whichever process trained them, and again after every run, so a killed study still reports what
finished; `results.json` holds every run's record, and `--report-only true` over a folder that holds only it writes
the same text reports.

With `--decay-at` (WSD), each budget a run branches is a record too, and the report gives loss against tokens at
each variant's chosen rate and, in the final report, a fit of L(N, D). `--metric` judges the claims on another logged
figure (a task's accuracy, say; its direction from its name). `--quantize int8,int4` evaluates each finished run's
final model with quantized weights on the report half, for the claim that unified quantizes within a margin of
standard (`--quantization-margin`); `--min-effect` is the floor below which no paired claim holds.
"""

import json
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..atomic import exit_status, write_text_atomically
from ..configuration_scalevec import SCALE_FIELDS
from ..data import DataArguments
from ..data.held_out import set_names
from ..quantization import parse_schemes
from ..run_records import TASK_FIGURES, TASKS_MEAN, TRAINING_DATA, read_json
from ..shards import parse_shard
from .branches import plan_budgets, unfinished_budgets
from .cli import ModelArguments, check_output_dir, config_overrides, parse_arguments, train
from .presets import SIZE_FIELDS, SIZE_RULE
from .report import tokens_per_step
from .study.claims import MIN_EFFECT, QUANTIZATION_MARGIN, Thresholds
from .study.grid import Grid, GridPoint, build_sizes
from .study.metric import LOSS, check_logged, metric_name
from .study.records import (
    DIVERGED,
    FINISHED,
    MISSING,
    QUANTIZED_FILE,
    RunRecord,
    branch_records,
    grid_records,
    load_records,
    record_diverged,
    run_status,
)
from .study.report import write_report
from .study.variants import VARIANT_GROUPS, VARIANTS
from .tasks import parse_task_list
from .trainer import NonFiniteLossError, ScaleVecTrainingArguments

_STRATEGY_FIELDS = ("scale_preset", *SCALE_FIELDS)


@dataclass
class AblationArguments:
    variants: str = field(
        default="strategies",
        metadata={"help": f"Comma-separated variants {list(VARIANTS)} or groups {list(VARIANT_GROUPS)}."},
    )
    seeds: str | None = field(default=None, metadata={"help": "Comma-separated seeds (default: --seed)."})
    sizes: str | None = field(
        default=None,
        metadata={"help": f"Comma-separated model sizes (default: --model-size): presets or {SIZE_RULE}."},
    )
    learning_rates: str | None = field(
        default=None,
        metadata={
            "help": "Comma-separated peak learning rates (default: --learning-rate); each size and variant is "
            "compared at its best one, chosen on the selection half of the held-out blocks."
        },
    )
    tokens_per_parameter: float | None = field(
        default=None,
        metadata={
            "help": "Train each size on this many tokens per non-embedding parameter N: --max-steps = "
            "ceil(R x N / tokens per step), per size. Instead of --max-steps."
        },
    )
    shard: str | None = field(
        default=None,
        metadata={
            "help": "I/N: train only the I-th of N disjoint shares of the grid (I from 0, as Slurm array task ids), "
            "the same on every machine; the report covers every finished run of the grid."
        },
    )
    metric: str = field(
        default=LOSS,
        metadata={
            "help": "The logged figure the claims are judged on: the held-out loss (its report half) by default, or "
            "another of the final evaluation's, e.g. eval_hellaswag_acc_norm (--eval-tasks); accuracies count "
            "higher as better. Learning rates are chosen on the held-out loss's selection half whatever it is."
        },
    )
    quantize: str | None = field(
        default=None,
        metadata={
            "help": "Comma-separated weight schemes (int8, int4; torchao): after each run, its final model is "
            "evaluated on the report half unquantized and with each scheme's weights (main process), and the claims "
            "gain a row per scheme and size: unified quantizes within --quantization-margin nats of standard."
        },
    )
    min_effect: float = field(
        default=MIN_EFFECT,
        metadata={
            "help": "The floor of a paired claim's effect, in the metric's units (nats of held-out loss, where 0.01 "
            "is 1 %% of perplexity; on an accuracy 0.01 is a point): a row holds (or is contradicted) only when its "
            "interval excludes 0 and its mean Δ lies beyond the floor; a smaller mean leaves it unresolved."
        },
    )
    quantization_margin: float = field(
        default=QUANTIZATION_MARGIN,
        metadata={
            "help": "The quantization rows' non-inferiority margin in nats: a row holds when unified's loss increase "
            "is within this margin of standard's (the 95 %% interval of their difference minus the margin lies "
            "below 0)."
        },
    )
    report_only: bool = field(
        default=False,
        metadata={
            "help": "Train nothing: write the report from the grid's run folders, and from the records of the "
            "folder's results.json for runs whose folders are gone."
        },
    )

    def variant_names(self) -> list[str]:
        names = []
        for name in _items(self.variants):
            if name in VARIANT_GROUPS:
                names.extend(VARIANT_GROUPS[name])
            elif name in VARIANTS:
                names.append(name)
            else:
                choices = ", ".join([*VARIANT_GROUPS, *VARIANTS])
                raise ValueError(f"--variants: unknown {name!r}; choose from {choices}")
        if not names:
            raise ValueError("--variants: empty list")
        return list(dict.fromkeys(names))

    def seed_list(self, default: int) -> list[int]:
        if self.seeds is None:
            return [default]
        try:
            return list(dict.fromkeys(int(seed) for seed in _items(self.seeds)))
        except ValueError:
            raise ValueError(f"--seeds must be comma-separated integers; got {self.seeds!r}") from None

    def size_names(self, default: str) -> list[str]:
        names = list(dict.fromkeys(_items(self.sizes))) if self.sizes is not None else [default]
        if not names:
            raise ValueError("--sizes: empty list")
        return names

    def learning_rate_list(self, default: float) -> list[float]:
        if self.learning_rates is None:
            return [default]
        try:
            rates = list(dict.fromkeys(float(rate) for rate in _items(self.learning_rates)))
        except ValueError:
            rates = []
        if not rates or any(not rate >= 0 for rate in rates):  # `not >=` refuses NaN too
            raise ValueError(f"--learning-rates must be comma-separated numbers >= 0; got {self.learning_rates!r}")
        return rates

    def shard_index(self) -> tuple[int, int]:
        return (0, 1) if self.shard is None else parse_shard(self.shard)


def _items(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]


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
    return Grid(sizes, ablation.variant_names(), rates, ablation.seed_list(training_args.seed))


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
    grid = build_grid(ablation, model_args, data_args, training_args)
    for size in grid.sizes:  # --decay-at's budgets of every size, checked before anything trains
        plan_budgets(training_args, size.max_steps)
    steps = [size.max_steps for size in grid.sizes if size.max_steps > 0]
    if training_args.logging_steps >= 1 and steps and min(steps) < training_args.logging_steps:
        raise ValueError("--logging-steps exceeds --max-steps: no training loss would be logged to compare")
    root = Path(training_args.output_dir)
    if ablation.report_only and not root.is_dir():
        raise ValueError(f"--output-dir {root}: no such folder, so nothing to report")
    metric = metric_name(ablation.metric)
    thresholds = Thresholds(ablation.min_effect, ablation.quantization_margin)
    schemes = parse_schemes(ablation.quantize) if ablation.quantize else []
    if not ablation.report_only:
        check_held_out(data_args)
        check_metric_configured(metric, data_args)
    if root.is_dir():  # runs already recorded must have logged it
        check_logged(metric, study_records(grid, root))
    index, count = ablation.shard_index()
    share = grid.shard(index, count)
    done = [  # finished (with every budget --decay-at branches from it) or diverged
        point
        for point in share
        if (status := run_status(grid, point, root)) == DIVERGED
        or (status == FINISHED and not _unfinished_branches(grid, point, root, training_args))
    ]
    todo = [] if ablation.report_only else [p for p in share if not (model_args.resume and p in done)]
    for point in todo:  # before anything trains: a folder of the grid that holds files needs --resume
        check_output_dir(point.folder(root), model_args.resume)
    main_process = training_args.process_index == 0
    if main_process:
        print(plan(grid, (index, count), len(done), len(todo), ablation.report_only), flush=True)
    for number, point in enumerate(todo, 1):
        _train(point, grid, model_args, data_args, training_args)
        if main_process:
            _quantize(grid, point, root, schemes, training_args.per_device_eval_batch_size)
            records = study_records(grid, root)
            done_now = next(r for r in records if r.point == point and r.budget is None)
            print(f"[ablation] {number}/{len(todo)} {done_now.describe()}", flush=True)
            # a killed study still reports; figures and the budgets' bootstrap fits only at the end
            write_report(records, grid, root, figures=False, budget_fits=False, metric=metric, thresholds=thresholds)
    if not main_process:
        return []
    for point in [] if ablation.report_only else share:  # finished runs --resume kept, trained without --quantize
        _quantize(grid, point, root, schemes, training_args.per_device_eval_batch_size)
    records = study_records(grid, root)
    print(*write_report(records, grid, root, metric=metric, thresholds=thresholds), sep="\n")
    runs = [r for r in records if r.budget is None]
    counts = {status: sum(r.status == status for r in runs) for status in (FINISHED, DIVERGED, MISSING)}
    print(
        f"[ablation] trained {len(todo)} runs; of the grid's {len(runs)}: "
        + ", ".join(f"{count} {status}" for status, count in counts.items())
    )
    print(f"results in {root}")
    return records


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
    from ..modeling_scalevec import ScaleVecForCausalLM
    from ..quantization import quantize_weights
    from .evaluation import evaluate_model

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
        logged += [f"eval_{name}_{figure}" for name in (*tasks, TASKS_MEAN) for figure in TASK_FIGURES]
    if metric not in logged:
        raise ValueError(f"--metric {metric}: these runs will not log it; they log {', '.join(logged)}")


def study_records(grid: Grid, root: Path) -> list[RunRecord]:
    """Every point's record (from its run folder, else from the folder's `results.json`, else missing), then those
    of the budgets `--decay-at` branched from the runs (likewise)."""
    results = read_json(root / "results.json")
    recorded = load_records(results) if results else None
    return [*grid_records(grid, root, recorded), *branch_records(grid, root, recorded)]


def plan(grid: Grid, shard: tuple[int, int], done: int, todo: int, report_only: bool) -> str:
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
    return "\n".join(lines)


def _train(
    point: GridPoint,
    grid: Grid,
    model_args: ModelArguments,
    data_args: DataArguments,
    training_args: ScaleVecTrainingArguments,
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
    try:
        train(model, data_args, args)
    except NonFiniteLossError as error:  # a result, not a crash: the shard goes on
        if training_args.process_index == 0:
            record_diverged(folder, error.step, error.learning_rate, str(error))
            print(f"[ablation] {point.size} {point.variant} lr {point.learning_rate:g} seed {point.seed}: {error}")


def _unfinished_branches(grid: Grid, point: GridPoint, root: Path, training_args: ScaleVecTrainingArguments) -> bool:
    """Whether a budget that --decay-at branches from `point`'s run has yet to finish its cooldown."""
    return bool(unfinished_budgets(point.folder(root), training_args, grid.size(point.size).max_steps))


ABLATE_ARGUMENTS = (AblationArguments, ModelArguments, DataArguments, ScaleVecTrainingArguments)


def main(argv: list[str] | None = None) -> int:
    def ablate() -> None:
        run_ablation(*parse_arguments(sys.argv[1:] if argv is None else argv, ABLATE_ARGUMENTS))

    return exit_status("scalevec-ablate", ablate, (ValueError, NonFiniteLossError))


if __name__ == "__main__":
    sys.exit(main())
