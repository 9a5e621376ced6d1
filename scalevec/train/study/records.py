"""What each run of the grid recorded, read back from its folder, or from the study's `results.json` where the
folder is gone: the report is built from records alone (`RunRecord`, a few hundred bytes a run), so it covers the
runs that other shards (other processes, other machines) finished, and `--report-only` over a folder that holds
only `results.json` writes the same reports.

A run is *finished* (its final `trainer_state.json` reached the last step), *diverged* (its loss or weights became
non-finite: `diverged.json` in its folder names the step), or *missing* (not run, running, or killed). Nothing
here imports the Trainer: reading a finished study needs no training code."""

import functools
import json
import math
from dataclasses import asdict, astuple, dataclass, field, fields
from pathlib import Path

from ...atomic import write_text_atomically
from ...configuration_scalevec import ScaleVecConfig
from ...convert.meta_model import active_parameters, num_parameters, scale_parameters
from ...run_records import (
    BRANCH_PREFIX,
    TRAINER_STATE,
    RunClock,
    TaskScores,
    duration_text,
    finished_step,
    logged_curve,
    read_json,
    read_run_records,
)
from .budgets import read_budgets
from .grid import Grid, GridPoint, Size

FINISHED, DIVERGED, MISSING = "finished", "diverged", "missing"
DIVERGED_FILE = "diverged.json"  # written into a run's folder when its loss or weights became non-finite
QUANTIZED_FILE = "quantized.json"  # `--quantize`: the report-half loss per weight scheme ("none": unquantized)


@dataclass
class RunRecord:
    """One run of the grid: its identity (size, variant, learning rate, seed, and `budget`, the fraction of the
    run's token budget it stands for: None for the whole run), what became of it, and what it measured."""

    size: str
    variant: str
    learning_rate: float
    seed: int
    status: str  # FINISHED, DIVERGED or MISSING
    budget: float | None = None
    step: int = 0  # the last step trained; a diverged run's, the step whose loss or update was non-finite
    tokens: int = 0
    non_embedding_parameters: int = 0  # N of the grid's size: no embedding, LM head or scale vector
    total_parameters: int | None = None  # every parameter (a tied LM head once); None where no config was saved
    active_parameters: int | None = None  # those one token uses: a MoE model's routed experts only
    scale_parameters: int | None = None
    train_loss: float | None = None  # the last logged training loss
    eval_loss: float | None = None  # every evaluated held-out block; None where not finite
    eval_select_loss: float | None = None  # the selection half (learning rates are chosen on it)
    eval_report_loss: float | None = None  # the report half (differences are measured on it)
    train_seconds: float | None = None  # the whole run's wall time, over any resumes; a branch's: its cooldown's
    diverged_learning_rate: float | None = None  # the scheduled learning rate at the diverging step
    metrics: dict[str, float] = field(default_factory=dict)  # the final evaluation's other figures (`figures`)
    # `--quantize`: the report-half loss of the final model, unquantized ("none") and with each scheme's weights
    quantized_report_loss: dict[str, float] = field(default_factory=dict)

    @property
    def point(self) -> GridPoint:
        return GridPoint(self.size, self.variant, self.learning_rate, self.seed)

    @property
    def key(self) -> tuple:
        return self.size, self.variant, self.learning_rate, self.seed, self.budget

    def describe(self) -> str:
        run = f"{self.size} {self.variant} lr {self.learning_rate:g} seed {self.seed}"
        if self.status == DIVERGED:
            return f"{run}: diverged at step {self.step}"
        if self.status == MISSING:
            return f"{run}: missing"
        evaluation = "-" if self.eval_loss is None else f"{self.eval_loss:.4f}"
        train = "-" if self.train_loss is None else f"{self.train_loss:.4f}"
        return f"{run}: train loss {train}, eval loss {evaluation}, {duration_text(self.train_seconds or 0.0)}"

    def figure(self, metric: str) -> float | None:
        """The final evaluation's `metric` (e.g. `eval_hellaswag_acc`); for the held-out loss, `eval_loss`, its
        report half (the study's comparisons are made on it); None where the run did not log it."""
        if metric == "eval_loss":
            return self.eval_report_loss
        return getattr(self, metric) if metric in _LOSS_FIELDS else self.metrics.get(metric)


_LOSS_FIELDS = ("eval_select_loss", "eval_report_loss")


def run_status(grid: Grid, point: GridPoint, root: Path) -> str:
    """FINISHED, DIVERGED or MISSING, from the run's folder."""
    folder = point.folder(root)
    if (folder / DIVERGED_FILE).is_file():
        return DIVERGED
    return FINISHED if finished_step(folder, grid.size(point.size).max_steps) is not None else MISSING


def grid_records(grid: Grid, root: Path, recorded: dict[tuple, RunRecord] | None = None) -> list[RunRecord]:
    """A record for every point of `grid`, in its order: from the run's folder where it finished or diverged, else
    from `recorded` (the records of an earlier `results.json`, by `RunRecord.key`), else missing."""
    records = []
    for point in grid.points():
        status = run_status(grid, point, root)
        if status != MISSING:
            records.append(read_record(grid, point, root, status))
            continue
        earlier = (recorded or {}).get((*astuple(point), None))
        size = grid.size(point.size)
        missing = RunRecord(point.size, point.variant, point.learning_rate, point.seed, MISSING)
        missing.non_embedding_parameters = size.non_embedding_parameters
        records.append(earlier if earlier is not None and earlier.status != MISSING else missing)
    return records


def read_record(grid: Grid, point: GridPoint, root: Path, status: str) -> RunRecord:
    folder = point.folder(root)
    record = RunRecord(point.size, point.variant, point.learning_rate, point.seed, status)
    record.non_embedding_parameters = grid.size(point.size).non_embedding_parameters
    if (folder / "config.json").is_file():
        counts = _counts(ScaleVecConfig.from_pretrained(folder).to_json_string())
        record.total_parameters, record.active_parameters, record.scale_parameters = counts
    return diverged(record, folder) if status == DIVERGED else measured(record, folder)


def diverged(record: RunRecord, folder: Path) -> RunRecord:
    """`record` with the step and learning rate at which the run in `folder` diverged (its `DIVERGED_FILE`)."""
    entry = read_json(folder / DIVERGED_FILE) or {}
    record.step = int(entry.get("step") or 0)
    record.diverged_learning_rate = entry.get("learning_rate")
    return record


def measured(record: RunRecord, folder: Path) -> RunRecord:
    """`record` with what the finished run in `folder` measured."""
    records = read_run_records(folder)
    metrics = read_json(folder / "all_results.json") or {}  # the Trainer's: of the last segment only
    summary = records.summary or {}  # the whole run's, however often it was resumed
    losses = logged_curve(records.log_history, "loss")
    evaluation = records.eval_metrics  # finite values only: a non-finite loss is None and never wins
    record.step = int((records.state or {}).get("global_step") or 0)
    record.tokens = int(summary.get("tokens_seen") or metrics.get("num_input_tokens_seen", 0))
    record.train_loss = losses[-1][1] if losses and math.isfinite(losses[-1][1]) else None
    record.eval_loss = evaluation.get("eval_loss")
    record.eval_select_loss = evaluation.get("eval_select_loss")
    record.eval_report_loss = evaluation.get("eval_report_loss")
    record.train_seconds = float(summary.get("wall_seconds") or metrics.get("train_runtime", 0.0))
    record.metrics = figures(evaluation)
    record.quantized_report_loss = _finite_only(read_json(folder / QUANTIZED_FILE))
    return record


def figures(evaluation: dict[str, float]) -> dict[str, float]:
    """The figures of a final evaluation a record keeps besides its losses: the held-out perplexity and bits per
    byte over every set, and each task's and their mean's acc, acc_norm and bpb; not each held-out set's figures,
    nor counts (tokens, items), to keep records small."""
    kept = {
        "eval_perplexity",
        "eval_bits_per_byte",
        *TaskScores.metric_names(TaskScores.from_metrics(evaluation).tasks),
    }
    return {key: value for key, value in evaluation.items() if key in kept}


def branch_records(grid: Grid, root: Path, recorded: dict[tuple, RunRecord] | None = None) -> list[RunRecord]:
    """A record for every finished budget that `--decay-at` branched from the grid's finished runs (`budget` its
    fraction; the run itself is the budget 1 and its record `grid_records`'), from the branch's folder, else from
    `recorded` (an earlier `results.json`'s records); in the grid's order, then the fewest tokens first."""
    points = grid.points()
    order = {point: index for index, point in enumerate(points)}
    found = {key: r for key, r in (recorded or {}).items() if r.budget is not None and r.point in order}
    for point in points:
        if run_status(grid, point, root) != FINISHED:
            continue
        n = grid.size(point.size).non_embedding_parameters
        for budget in read_budgets(point.folder(root)):
            if budget.fraction < 1:
                record = RunRecord(*astuple(point), FINISHED, budget=budget.fraction, non_embedding_parameters=n)
                found[record.key] = measured(record, Path(budget.output_dir))
                found[record.key].train_seconds = cooldown_seconds(Path(budget.output_dir))
        for marker in point.folder(root).glob(f"{BRANCH_PREFIX}*/{DIVERGED_FILE}"):  # a cooldown that diverged
            try:
                fraction = float(marker.parent.name.removeprefix(BRANCH_PREFIX))
            except ValueError:  # not a branch of --decay-at: someone's own folder
                continue
            record = RunRecord(*astuple(point), DIVERGED, budget=fraction, non_embedding_parameters=n)
            found[record.key] = diverged(record, marker.parent)
    return sorted(found.values(), key=lambda r: (order[r.point], r.budget))


def cooldown_seconds(branch: Path) -> float | None:
    """The wall time a `--decay-at` branch in `branch` trained itself: its whole clock less the one of the main
    run's checkpoint it resumed from (the stable phase, counted in the main run's record); where that checkpoint is
    gone, the Trainer's time of the branch's last segment."""
    clock = RunClock.recorded(read_json(branch / TRAINER_STATE) or {})
    if clock is not None and len(clock.segment_starts) > 1:
        start = f"checkpoint-{clock.segment_starts[1]}/{TRAINER_STATE}"
        for checkpoint in (branch / start, branch.parent / start):
            if (inherited := RunClock.recorded(read_json(checkpoint) or {})) is not None:
                return max(clock.wall_seconds - inherited.wall_seconds, 0.0)
    runtime = (read_json(branch / "all_results.json") or {}).get("train_runtime")
    return float(runtime) if isinstance(runtime, int | float) else None


@functools.lru_cache(maxsize=256)  # a report reads every run: one count per size and variant, not per run
def _counts(config_json: str) -> tuple[int, int, int]:
    """(total, active, scale-vector) parameters of a model of the config `config_json`."""
    config = ScaleVecConfig.from_dict(json.loads(config_json))
    return num_parameters(config), active_parameters(config), sum(scale_parameters(config).values())


def record_diverged(folder: Path, step: int | None, learning_rate: float | None, message: str) -> None:
    """Mark the run in `folder` as diverged: a result, which `--resume` keeps instead of training it again."""
    entry = {"step": step, "learning_rate": learning_rate, "message": message}
    write_text_atomically(folder / DIVERGED_FILE, json.dumps(entry, indent=2) + "\n")


def load_records(results: dict, source: Path | str = "results.json") -> dict[tuple, RunRecord]:
    """The records of a `results.json` (as loaded from `source`), by `RunRecord.key`. A `results.json` written before
    runs had a status holds none (its study's run folders are read instead); an entry of another kind is refused. A
    non-finite figure (another tool's -inf or NaN) is read as not measured: it never wins a learning rate's selection
    nor enters a mean."""
    names = {f.name for f in fields(RunRecord)}
    records = {}
    for entry in results.get("runs", []):
        if isinstance(entry, dict) and "status" not in entry:
            continue
        if (
            not isinstance(entry, dict)
            or not names >= set(entry)
            or entry["status"] not in (FINISHED, DIVERGED, MISSING)
        ):
            raise ValueError(f"{source}: a run entry this version cannot read: {entry!r}")
        entry = {key: _finite(value) for key, value in entry.items()}
        figures = {key: _finite_only(entry.get(key)) for key in ("metrics", "quantized_report_loss")}
        record = RunRecord(**{**entry, **figures})
        records[record.key] = record
    return records


def _finite(value):
    return None if isinstance(value, float) and not math.isfinite(value) else value


def _finite_only(figures: dict | None) -> dict:
    """`figures` (name -> value) without its non-finite values."""
    return {name: value for name, value in (figures or {}).items() if _finite(value) is not None}


def has_grid(results: dict) -> bool:
    """Whether a study's `results.json` (as loaded) records the grid or grids it was reported on."""
    return "grid" in results or "grids" in results


def recorded_grid(results: dict) -> Grid:
    """The grid a study's `results.json` (as loaded) was reported on: its one `grid`, or the union of its `grids`
    (a folder that several calls' grids share); the `--decay-at` budgets, where a file written before it stored
    them lacks them, from its branches' records."""
    grids = results["grids"] if "grids" in results else [results["grid"]]
    try:
        return Grid.union([_grid(grid, results) for grid in grids])
    except (KeyError, TypeError) as error:
        raise ValueError(f"results.json: a grid this version cannot read ({type(error).__name__}: {error})") from None


def _grid(grid: dict, results: dict) -> Grid:
    budgets = grid.get("budgets")
    if budgets is None:
        budgets = sorted({entry["budget"] for entry in results.get("runs", []) if entry.get("budget") is not None})
    sizes = [Size(**size) for size in grid["sizes"]]
    return Grid(sizes, grid["variants"], grid["learning_rates"], grid["seeds"], budgets)


def read_results(path: Path) -> tuple[Grid, list[RunRecord]]:
    """The grid and every run's record of a study's `results.json`: what its text reports are written from."""
    results = json.loads(Path(path).read_text())
    return recorded_grid(results), list(load_records(results, path).values())


def records_json(records: list[RunRecord]) -> list[dict]:
    return [asdict(record) for record in records]
