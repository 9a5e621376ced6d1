"""`scalevec-ablate`: train the same model on the same data and tokens once per scale-vector strategy and seed.

scalevec-ablate --model-size tiny --max-steps 300 --seeds 0,1,2 --output-dir runs/ablation
scalevec-ablate --model-size tiny --max-steps 300 --seeds 0,1,2 --variants all --resume --output-dir runs/ablation
scalevec-ablate --model-size tiny-moe --optim muon --lr-scheduler-type warmup_stable_decay \\
    --lr-scheduler-kwargs '{"num_decay_steps": 60}' --variants standard,unified --seeds 0,1 --output-dir runs/moe

Every `scalevec-train` option applies to all runs, except the scale strategy and the scales' weight decay, which
each variant sets. Within a seed every variant starts from the same initial matrices and reads the same batches
in the same order, so variants are compared seed by seed (paired differences). With `--resume`, runs that already
finished are reused: add variants or seeds to an ablation without training the old ones again. Writes one run
folder per variant and seed, `results.md` / `results.json` (per variant: final eval loss mean ± std over seeds,
the difference to its reference in each seed, whether the paper's prediction holds) and `loss_curves.png`.
"""

import json
import statistics
import sys
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..atomic import exit_status, write_text_atomically
from ..configuration_scalevec import SCALE_FIELDS, ScaleVecConfig
from ..convert.meta_model import scale_parameters
from ..data import DataArguments
from ..run_records import logged_curve, read_run_records
from .cli import ModelArguments, TrainResult, parse_arguments, train
from .diagnostics import save_figure
from .trainer import NonFiniteLossError, ScaleVecTrainingArguments


@dataclass(frozen=True)
class Variant:
    """A scale strategy (ModelArguments fields) and its scales' weight-decay rule, compared seed by seed with
    `reference`; `expected` is the paper's prediction for its eval loss against the reference."""

    model: dict
    reference: str | None = "standard"
    expected: str | None = "lower"  # "lower", "higher", or None where the paper predicts nothing
    exempt_input_scales: bool = False  # the stock Trainer's rule (no decay on anything named "norm")
    decay_output_scales: bool = False  # decayed as the matrices are (--weight-decay)

    def training_overrides(self, args: ScaleVecTrainingArguments) -> dict:
        overrides = {}
        if self.exempt_input_scales:
            overrides["input_scale_weight_decay"] = 0.0
        if self.decay_output_scales:
            overrides["output_scale_weight_decay"] = args.weight_decay
        return overrides


_STANDARD = dict(scale_preset="standard")
_UNIFIED = dict(scale_preset="unified")
_UNIFIED_OUTPUT_NORMS = dict(scale_preset="unified", output_norm=True)  # Peri-LN: output-role scales exist
# The paper's strategies, each isolated on top of "standard" (shared norm scale, direct), then all together; then
# its weight-decay rule by role: input-role scales decayed (ours) vs exempt (the stock Trainer, which for
# "standard" gives exactly its parameter groups), output-role scales exempt (ours and the stock Trainer) vs decayed.
VARIANTS: dict[str, Variant] = {
    "none": Variant(dict(scale_preset="none"), expected="higher"),
    "standard": Variant(_STANDARD, reference=None, expected=None),
    "branch": Variant(dict(_STANDARD, norm_scale="branch")),
    "placement": Variant(dict(_STANDARD, linear_scale="both")),
    "magdir": Variant(dict(_STANDARD, scale_param="magdir")),
    "unified": Variant(_UNIFIED),
    "standard-input-exempt": Variant(_STANDARD, expected="higher", exempt_input_scales=True),
    "unified-input-exempt": Variant(_UNIFIED, reference="unified", expected="higher", exempt_input_scales=True),
    "unified-output-norm": Variant(_UNIFIED_OUTPUT_NORMS, reference="unified", expected=None),
    "unified-output-norm-decayed": Variant(
        _UNIFIED_OUTPUT_NORMS, reference="unified-output-norm", expected="higher", decay_output_scales=True
    ),
}
VARIANT_GROUPS: dict[str, list[str]] = {
    "strategies": ["none", "standard", "branch", "placement", "magdir", "unified"],
    "weight-decay": [
        "standard",
        "standard-input-exempt",
        "unified",
        "unified-input-exempt",
        "unified-output-norm",
        "unified-output-norm-decayed",
    ],
    "all": list(VARIANTS),
}
_STRATEGY_FIELDS = ("scale_preset", *SCALE_FIELDS)


@dataclass
class AblationArguments:
    variants: str = field(
        default="strategies",
        metadata={"help": f"Comma-separated variants {list(VARIANTS)} or groups {list(VARIANT_GROUPS)}."},
    )
    seeds: str | None = field(default=None, metadata={"help": "Comma-separated seeds (default: --seed)."})

    def variant_names(self) -> list[str]:
        names = []
        for name in (name.strip() for name in self.variants.split(",")):
            if name in VARIANT_GROUPS:
                names.extend(VARIANT_GROUPS[name])
            elif name in VARIANTS:
                names.append(name)
            elif name:
                choices = ", ".join([*VARIANT_GROUPS, *VARIANTS])
                raise ValueError(f"--variants: unknown {name!r}; choose from {choices}")
        if not names:
            raise ValueError("--variants: empty list")
        return list(dict.fromkeys(names))

    def seed_list(self, default: int) -> list[int]:
        if self.seeds is None:
            return [default]
        try:
            return list(dict.fromkeys(int(seed) for seed in self.seeds.split(",")))
        except ValueError:
            raise ValueError(f"--seeds must be comma-separated integers; got {self.seeds!r}") from None


@dataclass
class RunRecord:
    variant: str
    seed: int
    train_loss: float  # last logged training loss
    eval_loss: float | None
    tokens: int
    train_seconds: float  # the Trainer's train_runtime: the same whether this call trained the run or reused it
    scale_parameters: int
    output_dir: str


@dataclass
class VariantSummary:
    """One variant over the seeds: final eval loss, and its difference to the reference variant in each seed."""

    variant: str
    seeds: list[int]
    eval_loss_mean: float | None
    eval_loss_std: float | None  # sample standard deviation; None with fewer than two seeds
    train_loss_mean: float
    reference: str | None
    differences: dict[int, float]  # seed -> eval loss minus the reference's in that seed
    expected: str | None
    holds: int  # seeds in which the difference has the sign the paper predicts


def run_ablation(
    ablation: AblationArguments,
    model_args: ModelArguments,
    data_args: DataArguments,
    training_args: ScaleVecTrainingArguments,
) -> list[RunRecord]:
    chosen = [name for name in _STRATEGY_FIELDS if getattr(model_args, name) is not None]
    if chosen:
        raise ValueError(f"--{chosen[0].replace('_', '-')}: scalevec-ablate sets the scale strategy per variant")
    if training_args.logging_steps >= 1 and 0 < training_args.max_steps < training_args.logging_steps:
        raise ValueError("--logging-steps exceeds --max-steps: no training loss would be logged to compare")
    root = Path(training_args.output_dir)
    records = []
    for seed in ablation.seed_list(training_args.seed):
        for name in ablation.variant_names():
            variant = VARIANTS[name]
            run_dir = root / f"{name}-seed{seed}"
            args = replace(
                training_args,
                output_dir=str(run_dir),
                seed=seed,
                run_name=run_dir.name,
                **variant.training_overrides(training_args),
            )
            result = train(replace(model_args, **variant.model), data_args, args)
            records.append(_record(name, seed, result))
            print(f"[ablation] {name} seed {seed}: {_format(records[-1])}", flush=True)
            write_tables(records, root)  # after every run: a killed ablation still reports what finished
    plot_losses(records, root / "loss_curves.png")
    return records


def _record(variant: str, seed: int, result: TrainResult) -> RunRecord:
    _, last_loss = logged_curve(read_run_records(result.output_dir).log_history, "loss")[-1]
    return RunRecord(
        variant=variant,
        seed=seed,
        train_loss=last_loss,
        eval_loss=result.metrics.get("eval_loss"),
        tokens=int(result.metrics.get("num_input_tokens_seen", 0)),
        train_seconds=float(result.metrics.get("train_runtime", 0.0)),
        scale_parameters=sum(scale_parameters(ScaleVecConfig.from_pretrained(result.output_dir)).values()),
        output_dir=str(result.output_dir),
    )


def _format(record: RunRecord) -> str:
    evaluation = "-" if record.eval_loss is None else f"{record.eval_loss:.4f}"
    return f"train loss {record.train_loss:.4f}, eval loss {evaluation}, {record.train_seconds:.0f} s"


def summarise(records: list[RunRecord]) -> list[VariantSummary]:
    """Per variant, in the order run: eval loss mean ± std over seeds and the paired differences to the
    reference (seeds where the reference was not run are left out)."""
    eval_loss = {(r.variant, r.seed): r.eval_loss for r in records if r.eval_loss is not None}
    summaries = []
    for name in dict.fromkeys(r.variant for r in records):
        runs = [r for r in records if r.variant == name]
        evals = [r.eval_loss for r in runs if r.eval_loss is not None]
        variant = VARIANTS[name]
        differences = {
            r.seed: eval_loss[name, r.seed] - eval_loss[variant.reference, r.seed]
            for r in runs
            if (name, r.seed) in eval_loss and (variant.reference, r.seed) in eval_loss
        }
        summaries.append(
            VariantSummary(
                variant=name,
                seeds=[r.seed for r in runs],
                eval_loss_mean=statistics.mean(evals) if evals else None,
                eval_loss_std=statistics.stdev(evals) if len(evals) > 1 else None,
                train_loss_mean=statistics.mean(r.train_loss for r in runs),
                reference=variant.reference if differences else None,
                differences=differences,
                expected=variant.expected if differences else None,
                holds=sum(_as_predicted(d, variant.expected) for d in differences.values()),
            )
        )
    return summaries


def _as_predicted(difference: float, expected: str | None) -> bool:
    return (expected == "lower" and difference < 0) or (expected == "higher" and difference > 0)


def seeds_where_predictions_fail(summaries: list[VariantSummary]) -> dict[int, list[str]]:
    """Seed -> the variants whose difference to their reference has not the sign the paper predicts."""
    failures = {seed: [] for s in summaries if s.expected for seed in s.differences}
    for summary in summaries:
        for seed, difference in summary.differences.items():
            if summary.expected and not _as_predicted(difference, summary.expected):
                failures[seed].append(summary.variant)
    return failures


def summary_table(records: list[RunRecord]) -> str:
    """Markdown: one row per variant (eval loss over seeds, paired differences to the reference), then the
    ranking in each seed and where the paper's predictions fail."""
    summaries = summarise(records)
    seeds = list(dict.fromkeys(r.seed for r in records))
    rows = [
        f"Final eval loss over seeds {', '.join(map(str, seeds))}. Within a seed every variant starts from the same "
        "initial matrices and reads the same batches; Δ is its eval loss minus the reference's in the same seed; "
        "'holds': seeds in which Δ has the sign the paper predicts.",
        "",
        "| variant | eval loss (mean ± std) | reference | Δ per seed | Δ (mean ± std) | paper | holds "
        "| final train loss | tokens | scale params | train time / run |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summaries:
        runs = [r for r in records if r.variant == s.variant]
        differences = list(s.differences.values())
        rows.append(
            f"| {s.variant} | {_mean_std(s.eval_loss_mean, s.eval_loss_std)} | {s.reference or '-'} "
            f"| {', '.join(f'{d:+.4f}' for d in differences) or '-'} | {_spread(differences, signed=True)} "
            f"| {_PREDICTIONS.get(s.expected, '-')} | {f'{s.holds}/{len(differences)}' if s.expected else '-'} "
            f"| {s.train_loss_mean:.4f} | {runs[0].tokens:,} | {runs[0].scale_parameters:,} "
            f"| {statistics.median(r.train_seconds for r in runs):.0f} s |"
        )
    rows += ["", "Lowest eval loss first, per seed:", ""]
    for seed in seeds:
        ranked = sorted((r for r in records if r.seed == seed and r.eval_loss is not None), key=lambda r: r.eval_loss)
        rows.append(f"- seed {seed}: " + " < ".join(f"{r.variant} {r.eval_loss:.4f}" for r in ranked))
    failures = seeds_where_predictions_fail(summaries)
    if failures:
        failed = {seed: names for seed, names in failures.items() if names}
        verdict = "yes" if not failed else "no: " + "; ".join(f"seed {s}: {', '.join(n)}" for s, n in failed.items())
        rows += ["", f"The paper's predictions hold in every seed: {verdict}."]
    return "\n".join(rows) + "\n"


_PREDICTIONS = {"lower": "Δ < 0", "higher": "Δ > 0"}


def _mean_std(mean: float | None, std: float | None) -> str:
    if mean is None:
        return "-"
    return f"{mean:.4f}" if std is None else f"{mean:.4f} ± {std:.4f}"


def _spread(values: list[float], signed: bool = False) -> str:
    if not values:
        return "-"
    std = statistics.stdev(values) if len(values) > 1 else None
    mean = f"{statistics.mean(values):{'+' if signed else ''}.4f}"
    return mean if std is None else f"{mean} ± {std:.4f}"


def write_tables(records: list[RunRecord], root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    results = {"summary": [asdict(s) for s in summarise(records)], "runs": [asdict(r) for r in records]}
    write_text_atomically(root / "results.md", summary_table(records))
    write_text_atomically(root / "results.json", json.dumps(results, indent=2) + "\n")


def mean_curves(records: list[RunRecord], key: str = "loss") -> dict[str, tuple[list[int], list[list[float]]]]:
    """Variant -> (steps logged by every seed, the values of each seed at those steps)."""
    curves = {}
    for name in dict.fromkeys(r.variant for r in records):
        per_seed = [
            dict(logged_curve(read_run_records(r.output_dir).log_history, key)) for r in records if r.variant == name
        ]
        steps = sorted(set.intersection(*(set(curve) for curve in per_seed)))
        curves[name] = (steps, [[curve[step] for step in steps] for curve in per_seed])
    return curves


def plot_losses(records: list[RunRecord], path: Path) -> Path:
    """Training loss (mean over seeds, min–max band), the same over the last 40 % of steps, and each seed's
    eval-loss difference to the reference variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (full, tail, paired) = plt.subplots(1, 3, figsize=(17, 4.8), gridspec_kw={"width_ratios": [3, 3, 2]})
    curves = mean_curves(records)
    colours = {name: f"C{i}" for i, name in enumerate(curves)}
    seeds = len(dict.fromkeys(r.seed for r in records))
    for axis in (full, tail):
        for name, (steps, values) in curves.items():
            mean = [statistics.mean(column) for column in zip(*values)]
            axis.plot(steps, mean, color=colours[name], label=name)
            axis.fill_between(steps, *_min_max(values), color=colours[name], alpha=0.2, linewidth=0)
    full.set(title=f"training loss (mean of {seeds} seeds, band: min–max)", xlabel="step", ylabel="nats per token")
    full.legend(fontsize="small")
    _zoom_on_tail(tail, curves, fraction=0.4)
    tail.set(title="last 40 % of steps", xlabel="step")
    _plot_differences(paired, summarise(records), colours)
    fig.tight_layout()
    return save_figure(fig, path)


def _min_max(values: list[list[float]]) -> tuple[list[float], list[float]]:
    columns = list(zip(*values))
    return [min(c) for c in columns], [max(c) for c in columns]


def _zoom_on_tail(axis, curves: dict, fraction: float) -> None:
    last = max(steps[-1] for steps, _ in curves.values() if steps)
    start = last * (1 - fraction)
    shown = [v for steps, values in curves.values() for seed in values for s, v in zip(steps, seed) if s >= start]
    if shown:
        margin = 0.05 * (max(shown) - min(shown) or 1.0)
        axis.set_xlim(start, last)
        axis.set_ylim(min(shown) - margin, max(shown) + margin)


def _plot_differences(axis, summaries: list[VariantSummary], colours: dict[str, str]) -> None:
    compared = [s for s in summaries if s.differences]
    for row, summary in enumerate(compared):
        differences = list(summary.differences.values())
        axis.scatter(differences, [row] * len(differences), color=colours[summary.variant], alpha=0.6)
        axis.scatter([statistics.mean(differences)], [row], color=colours[summary.variant], marker="|", s=400)
    axis.axvline(0, color="grey", linewidth=0.8)
    axis.set_yticks(range(len(compared)), [f"{s.variant}\n− {s.reference}" for s in compared], fontsize="small")
    axis.invert_yaxis()
    axis.set(title="final eval loss − reference", xlabel="nats per token (dots: seeds, |: mean)")


def main(argv: list[str] | None = None) -> int:
    types = (AblationArguments, ModelArguments, DataArguments, ScaleVecTrainingArguments)

    def ablate() -> None:
        ablation, *arguments = parse_arguments(sys.argv[1:] if argv is None else argv, types)
        print(summary_table(run_ablation(ablation, *arguments)))
        print(f"results in {Path(arguments[2].output_dir)}")

    return exit_status("scalevec-ablate", ablate, (ValueError, NonFiniteLossError))


if __name__ == "__main__":
    sys.exit(main())
