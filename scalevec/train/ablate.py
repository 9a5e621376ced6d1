"""`scalevec-ablate`: train the same model on the same data and tokens once per scale-vector strategy.

scalevec-ablate --model-size tiny --max-steps 300 --output-dir runs/ablation
scalevec-ablate --model-size tiny-moe --optim muon --lr-scheduler-type warmup_stable_decay \\
    --lr-scheduler-kwargs '{"num_decay_steps": 60}' --variants standard,unified --seeds 0,1 --output-dir runs/moe

Every `scalevec-train` option applies to all runs, except the scale strategy, which each variant sets. Writes one
run folder per variant and seed, `results.md` / `results.json` (final train and eval loss, tokens, wall time) and
`loss_curves.png`.
"""

import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from ..atomic import write_text_atomically
from ..configuration_scalevec import SCALE_FIELDS, ScaleVecConfig
from ..convert.meta_model import scale_parameters
from ..run_records import logged_curve, read_run_records
from .cli import ModelArguments, parse_arguments, train
from .data import DataArguments
from .diagnostics import save_figure
from .trainer import NonFiniteLossError, ScaleVecTrainingArguments

# The paper's strategies, each isolated on top of "standard" (shared norm scale, direct), then all together.
VARIANTS: dict[str, dict] = {
    "none": dict(scale_preset="none"),
    "standard": dict(scale_preset="standard"),
    "branch": dict(scale_preset="standard", norm_scale="branch"),
    "placement": dict(scale_preset="standard", linear_scale="both"),
    "magdir": dict(scale_preset="standard", scale_param="magdir"),
    "unified": dict(scale_preset="unified"),
}
_STRATEGY_FIELDS = ("scale_preset", *SCALE_FIELDS)


@dataclass
class AblationArguments:
    variants: str = field(default=",".join(VARIANTS), metadata={"help": f"Comma-separated, from {list(VARIANTS)}."})
    seeds: str | None = field(default=None, metadata={"help": "Comma-separated seeds (default: --seed)."})

    def variant_names(self) -> list[str]:
        names = [name.strip() for name in self.variants.split(",") if name.strip()]
        unknown = [name for name in names if name not in VARIANTS]
        if unknown or not names:
            raise ValueError(f"--variants: unknown {unknown or 'empty list'}; choose from {', '.join(VARIANTS)}")
        return names

    def seed_list(self, default: int) -> list[int]:
        if self.seeds is None:
            return [default]
        try:
            return [int(seed) for seed in self.seeds.split(",")]
        except ValueError:
            raise ValueError(f"--seeds must be comma-separated integers; got {self.seeds!r}") from None


@dataclass
class RunRecord:
    variant: str
    seed: int
    train_loss: float  # last logged training loss
    eval_loss: float | None
    tokens: int
    wall_seconds: float
    scale_parameters: int
    output_dir: str


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
        for variant in ablation.variant_names():
            run_dir = root / f"{variant}-seed{seed}"
            args = replace(training_args, output_dir=str(run_dir), seed=seed, run_name=run_dir.name)
            start = time.perf_counter()
            result = train(replace(model_args, **VARIANTS[variant]), data_args, args)
            records.append(_record(variant, seed, result, time.perf_counter() - start))
            print(f"[ablation] {variant} seed {seed}: {_format(records[-1])}")
    write_results(records, root)
    return records


def _record(variant: str, seed: int, result, wall_seconds: float) -> RunRecord:
    _, last_loss = logged_curve(read_run_records(result.output_dir).log_history, "loss")[-1]
    return RunRecord(
        variant=variant,
        seed=seed,
        train_loss=last_loss,
        eval_loss=result.metrics.get("eval_loss"),
        tokens=int(result.metrics.get("num_input_tokens_seen", 0)),
        wall_seconds=wall_seconds,
        scale_parameters=sum(scale_parameters(ScaleVecConfig.from_pretrained(result.output_dir)).values()),
        output_dir=str(result.output_dir),
    )


def _format(record: RunRecord) -> str:
    evaluation = "-" if record.eval_loss is None else f"{record.eval_loss:.4f}"
    return f"train loss {record.train_loss:.4f}, eval loss {evaluation}, {record.wall_seconds:.0f} s"


def summary_table(records: list[RunRecord]) -> str:
    """Markdown: one row per variant, losses as mean ± std over seeds."""
    rows = [
        "| variant | seeds | final train loss | final eval loss | tokens | scale params | wall time / run |",
        "|---|---|---|---|---|---|---|",
    ]
    for variant in dict.fromkeys(r.variant for r in records):
        runs = [r for r in records if r.variant == variant]
        evals = [r.eval_loss for r in runs if r.eval_loss is not None]
        rows.append(
            f"| {variant} | {len(runs)} | {_spread([r.train_loss for r in runs])} | {_spread(evals)} "
            f"| {runs[0].tokens:,} | {runs[0].scale_parameters:,} "
            f"| {statistics.median(r.wall_seconds for r in runs):.0f} s |"
        )
    return "\n".join(rows) + "\n"


def _spread(values: list[float]) -> str:
    if not values:
        return "-"
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def write_results(records: list[RunRecord], root: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    for name, text in (
        ("results.md", summary_table(records)),
        ("results.json", json.dumps([asdict(r) for r in records], indent=2) + "\n"),
    ):
        write_text_atomically(root / name, text)
    plot_losses(records, root / "loss_curves.png")


def plot_losses(records: list[RunRecord], path: Path) -> Path:
    """Training loss against step for every run (one colour per variant), and the final eval loss per variant."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (curves, finals) = plt.subplots(1, 2, figsize=(13, 4.5), gridspec_kw={"width_ratios": [2, 1]})
    colours = {v: f"C{i}" for i, v in enumerate(dict.fromkeys(r.variant for r in records))}
    for record in records:
        points = logged_curve(read_run_records(record.output_dir).log_history, "loss")
        label = record.variant if record.seed == min(r.seed for r in records) else None
        curves.plot(*zip(*points), color=colours[record.variant], alpha=0.8, label=label)
    curves.set(title="training loss", xlabel="step", ylabel="nats per token")
    curves.legend()
    for variant, colour in colours.items():
        evals = [r.eval_loss for r in records if r.variant == variant and r.eval_loss is not None]
        finals.scatter([variant] * len(evals), evals, color=colour)
    finals.set(title="final eval loss (each seed)", ylabel="nats per token")
    finals.tick_params(axis="x", rotation=30)
    return save_figure(fig, path)


def main(argv: list[str] | None = None) -> int:
    types = (AblationArguments, ModelArguments, DataArguments, ScaleVecTrainingArguments)
    try:
        ablation, *arguments = parse_arguments(sys.argv[1:] if argv is None else argv, types)
        records = run_ablation(ablation, *arguments)
    except (ValueError, NonFiniteLossError) as error:
        print(f"scalevec-ablate: error: {error}", file=sys.stderr)
        return 1
    print(summary_table(records))
    print(f"results in {Path(arguments[2].output_dir)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
