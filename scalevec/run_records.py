"""What a `transformers` Trainer run folder records about itself, read back: shared by training (which writes
the run's picture and compares runs) and the converter (whose model card quotes the records).

Missing or unreadable files are skipped rather than raised: a reader of records says less, never something false.
"""

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import ClassVar

RUN_PICTURE = "scale_vectors.png"  # the loss / scale-statistics figure `scalevec-train` writes into its output folder
TRAINER_STATE = "trainer_state.json"
TRAINING_DATA = "training_data.json"  # what `scalevec-train` trained on (sources, sizes, weights) and evaluated
RUN_SUMMARY = "run_summary.json"  # how `scalevec-train` ended: losses, evaluation, hardware, throughput
# Eval keys that describe the evaluation run rather than the model.
EVAL_BOOKKEEPING = {"eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "eval_tokens_per_second"}
# The figures of a multiple-choice task (`TaskScore`), and the name their mean over the tasks is logged under.
TASK_FIGURES = ("acc", "acc_norm", "bpb")
TASKS_MEAN = "tasks"
# The entry of a trainer state's `stateful_callbacks` that holds the run's clock (`RunClock`): the Trainer saves each
# stateful callback under its class name, and `scalevec.train.run_clock.RunClockCallback` keeps the clock.
RUN_CLOCK = "RunClockCallback"
# The folder of each budget that `--decay-at` branches from a run: `OUTPUT/budget-F`, F its fraction of the run.
BRANCH_PREFIX = "budget-"


@dataclass(frozen=True)
class TaskScore:
    """What one multiple-choice task scored at one evaluation, each figure a mean over its items: accuracy,
    length-normalised accuracy (higher is better) and bits per byte of the gold answer (lower is better); `items`
    None for the mean over the tasks."""

    HIGHER_IS_BETTER: ClassVar = ("acc", "acc_norm")

    acc: float
    acc_norm: float
    bpb: float
    items: int | None = None

    def figures(self) -> dict[str, float]:
        return {figure: getattr(self, figure) for figure in TASK_FIGURES}


@dataclass(frozen=True)
class TaskScores:
    """Every task's `TaskScore` at one evaluation, by task name in scoring order, and their unweighted mean (each
    task counts once, as OLMo's and nanochat's averages; with several tasks). The one place the logged names are
    made and read: `<prefix>_<task>_<figure>`, `<prefix>_<task>_items`, and the mean's `<prefix>_tasks_<figure>`."""

    tasks: dict[str, TaskScore]

    @property
    def mean(self) -> TaskScore | None:
        if len(self.tasks) < 2:
            return None
        means = (sum(getattr(s, figure) for s in self.tasks.values()) / len(self.tasks) for figure in TASK_FIGURES)
        return TaskScore(*means)

    def rows(self) -> list[tuple[str, TaskScore]]:
        """Each task's scores, then their mean (named `TASKS_MEAN`) where there is one."""
        return [*self.tasks.items(), *([(TASKS_MEAN, self.mean)] if self.mean else [])]

    def metrics(self, prefix: str = "eval", items: bool = True) -> dict[str, float]:
        """The scores as logged (with each task's `items` count unless `items` is false)."""
        metrics = {}
        for name, score in self.rows():
            metrics.update({f"{prefix}_{name}_{figure}": value for figure, value in score.figures().items()})
            if items and score.items is not None:
                metrics[f"{prefix}_{name}_items"] = score.items
        return metrics

    @classmethod
    def from_metrics(cls, metrics: dict, prefix: str = "eval") -> "TaskScores":
        """The scores an evaluation logged (`metrics`: a log entry, `all_results.json`, a run summary's `eval`):
        each task that logged its `items`."""
        tasks = {}
        for name in (key[len(prefix) + 1 : -len("_items")] for key in metrics if _is_items_key(key, prefix)):
            figures = (metrics[f"{prefix}_{name}_{figure}"] for figure in TASK_FIGURES)
            tasks[name] = TaskScore(*figures, items=int(metrics[f"{prefix}_{name}_items"]))
        return cls(tasks)

    @staticmethod
    def metric_names(names: Iterable[str], prefix: str = "eval") -> list[str]:
        """The figures an evaluation of the tasks `names` logs, the mean's included (not the `items` counts)."""
        return [f"{prefix}_{name}_{figure}" for name in (*names, TASKS_MEAN) for figure in TASK_FIGURES]

    @staticmethod
    def is_metric(key: str, prefix: str = "eval") -> bool:
        """Whether a logged figure is a task's (or the tasks' mean's) rather than the held-out text's."""
        suffixes = tuple(f"_{name}" for name in (*TASK_FIGURES, "items"))
        return key.startswith(f"{prefix}_") and key.endswith(suffixes)


def _is_items_key(key: str, prefix: str) -> bool:
    return key.startswith(f"{prefix}_") and key.endswith("_items")


@dataclass
class RunClock:
    """A run's time over all its segments (its first start and each resume), up to its latest save. Every
    checkpoint's `trainer_state.json` carries it, so a resumed run adds its own time to the time its checkpoint
    recorded, whenever and however often it was stopped; the steps a stopped segment trained after its last
    checkpoint are trained again by the next and counted once."""

    segment_starts: list[int] = field(default_factory=lambda: [0])  # the step each segment started from
    wall_seconds: float = 0.0  # in `Trainer.train`, summed over the segments
    training_seconds: float = 0.0  # the same less evaluations and saves: what tokens/s and MFU are taken over

    @classmethod
    def recorded(cls, state: dict) -> "RunClock | None":
        """The clock a trainer state (`trainer_state.json`, or `vars(trainer.state)`) recorded; None if none."""
        entry = (state.get("stateful_callbacks") or {}).get(RUN_CLOCK)
        clock = entry.get("attributes", {}).get("recorded_clock") if isinstance(entry, dict) else None
        try:
            return cls(**clock) if isinstance(clock, dict) else None
        except TypeError:  # not a clock this version wrote
            return None


@dataclass
class WholeRun:
    """The figures of a whole run, however many segments it had, from its trainer state."""

    steps: int
    tokens: int
    clock: RunClock | None  # None: not recorded (a stock Trainer's run, or one resumed from such a checkpoint)
    mean_loss: float | None  # of the logged training losses, each weighted by the steps it averages
    mean_loss_steps: int  # the steps that mean covers: all of them unless some were never logged

    @property
    def tokens_per_second(self) -> float | None:
        if self.clock is None or not self.clock.training_seconds or not self.tokens:
            return None
        return self.tokens / self.clock.training_seconds


def part_note(shard: list[int]) -> str:
    """How a run's record of its data (a source's "shard": [index, count]) names a source that is one part of a
    preparation split with `scalevec-data prepare --shard`."""
    index, count = shard
    return f"part {index}/{count} of a preparation split with --shard (`scalevec-data combine` joins the parts)"


def loss_coverage(covered: int, steps: int) -> str:
    """Which steps a mean of the logged losses covers: `all 200 steps`, `196 of the 200 steps (those logged)`."""
    return f"all {steps:,} steps" if covered >= steps else f"{covered:,} of the {steps:,} steps (those logged)"


def segments_text(segment_starts: list[int]) -> str:
    """Nothing for a run never resumed, else ` over 3 segments (resumed at steps 48 and 120)`."""
    resumes = [f"{step:,}" for step in segment_starts[1:]]
    if not resumes:
        return ""
    steps = f"step {resumes[0]}" if len(resumes) == 1 else f"steps {', '.join(resumes[:-1])} and {resumes[-1]}"
    return f" over {len(resumes) + 1} segments (resumed at {steps})"


def whole_run(state: dict) -> WholeRun:
    """The whole run's figures from a trainer state (`trainer_state.json`, or `vars(trainer.state)`): its log
    history holds every logged step once, however often the run was resumed, and its clock the time of all segments.
    Each logged loss is the mean since the previous log or the segment's start, whichever is later."""
    clock = RunClock.recorded(state)
    starts = clock.segment_starts if clock else [0]
    total = weight = 0.0
    previous = 0
    for entry in logged_entries(state.get("log_history") or [], "loss"):
        step = entry["step"]
        steps = step - max([previous, *(start for start in starts if start < step)])
        total, weight, previous = total + entry["loss"] * steps, weight + steps, step
    return WholeRun(
        steps=int(state.get("global_step") or 0),
        tokens=int(state.get("num_input_tokens_seen") or 0),
        clock=clock,
        mean_loss=total / weight if weight else None,
        mean_loss_steps=int(weight),
    )


@dataclass
class HeldOutSetRecord:
    """One held-out set of a run's evaluation, enough to find its evaluated blocks again:
    `evaluation_blocks(blocks, evaluated_blocks)` of the `split` of the prepared `folder`."""

    name: str
    folder: str
    split: str
    blocks: int
    evaluated_blocks: int


@dataclass
class EvaluationRecord:
    """What a run's evaluation reads, as its `training_data.json` records it under "eval". Three token counts describe
    one evaluation: `tokens`, the held-out tokens there are; `evaluated_tokens`, those each evaluation reads (whole
    blocks, `--max-eval-tokens`); and the evaluation's `eval_tokens` metric, those it predicts and scores (every token
    of a block read but its first)."""

    name: str
    blocks: int  # held out, in whole blocks of the run's sequence length
    tokens: int  # held out (with those of the last incomplete block of each document run)
    evaluated_blocks: int = 0  # read by each evaluation; 0: no evaluation (no complete block held out)
    evaluated_tokens: int = 0
    sets: list[HeldOutSetRecord] = field(default_factory=list)

    @classmethod
    def read(cls, data_record: dict | None) -> "EvaluationRecord | None":
        """The evaluation a run's record of its data (`training_data.json`) describes; None where it records none or
        one this version cannot read."""
        held_out = (data_record or {}).get("eval")
        if not isinstance(held_out, dict):
            return None
        try:
            sets = [HeldOutSetRecord(**entry) for entry in held_out.get("sets", [])]
            return cls(**{**held_out, "sets": sets})
        except TypeError:  # written by another version
            return None

    def to_record(self) -> dict:
        """As `training_data.json` records it: the held-out size alone where nothing is evaluated."""
        record = asdict(self)
        return record if self.sets else {key: record[key] for key in ("name", "blocks", "tokens")}


@dataclass
class RunRecords:
    """What a training run recorded about itself; empty when nothing was found."""

    state: dict | None = None  # trainer_state.json
    eval_metrics: dict[str, float] = field(default_factory=dict)  # final "eval_*" values
    training_args: dict | None = None  # training_args.json
    training_data: dict | None = None  # training_data.json: the sources trained on, their sizes and weights
    summary: dict | None = None  # run_summary.json: the end of the run (hardware, throughput, MFU)
    sources: list[str] = field(default_factory=list)  # the files read, relative to the run folder

    @property
    def log_history(self) -> list[dict]:
        return (self.state or {}).get("log_history", [])


def read_run_records(run_dir: str | Path) -> RunRecords:
    """Read what a Trainer run folder recorded: `trainer_state.json` (the run's or its latest checkpoint's),
    the final eval metrics (`eval_results.json`, `all_results.json`, else the last eval in the log history),
    `training_args.json` and `training_data.json`."""
    run_dir = Path(run_dir)
    records = RunRecords()
    state_file = _trainer_state_file(run_dir)
    if state_file is not None and (state := read_json(state_file)) is not None:
        records.state = state
        records.sources.append(state_file.relative_to(run_dir).as_posix())
    for name in ("eval_results.json", "all_results.json"):
        metrics = _eval_metrics(read_json(run_dir / name) or {})
        if metrics:
            records.eval_metrics = metrics
            records.sources.append(name)
            break
    else:
        evaluations = logged_entries(records.log_history, "eval_loss")
        records.eval_metrics = _eval_metrics(evaluations[-1]) if evaluations else {}
    if (arguments := read_json(run_dir / "training_args.json")) is not None:
        records.training_args = arguments
        records.sources.append("training_args.json")
    if (data := read_json(run_dir / TRAINING_DATA)) is not None:
        records.training_data = data
        records.sources.append(TRAINING_DATA)
    if (summary := read_json(run_dir / RUN_SUMMARY)) is not None:
        records.summary = summary
        records.sources.append(RUN_SUMMARY)
    return records


def logged_entries(log_history: list[dict], key: str) -> list[dict]:
    """The entries of a Trainer log history that hold `key` (e.g. "loss", "eval_loss"), in step order."""
    return [entry for entry in log_history if key in entry]


def logged_curve(log_history: list[dict], key: str) -> list[tuple[int, float]]:
    """(step, value) of every logged `key`."""
    return [(entry["step"], entry[key]) for entry in logged_entries(log_history, key)]


def read_json(file: Path) -> dict | None:
    """A JSON object file, or None when it is missing, unreadable or not an object."""
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def finished_step(run_dir: Path, max_steps: int) -> int | None:
    """The last step of a run in `run_dir` that trained to its end (`max_steps`, or where that is 0 or less the
    run's own) and saved its result, else None. The final `trainer_state.json` is written after the model: a
    readable one with the last step means the run finished."""
    state = read_json(run_dir / TRAINER_STATE) or {}
    step, target = int(state.get("global_step") or 0), max_steps if max_steps > 0 else int(state.get("max_steps") or 0)
    return step if target and step >= target else None


def _trainer_state_file(run_dir: Path) -> Path | None:
    """`trainer_state.json` of the run, or of its latest `checkpoint-<step>` when the final one was not saved."""
    if (run_dir / TRAINER_STATE).is_file():
        return run_dir / TRAINER_STATE
    checkpoints = [p for p in run_dir.glob(f"checkpoint-*/{TRAINER_STATE}") if p.parent.name[11:].isdigit()]
    return max(checkpoints, key=lambda p: int(p.parent.name[11:]), default=None)


def _eval_metrics(record: dict) -> dict[str, float]:
    return {
        key: float(value)
        for key, value in record.items()
        if key.startswith("eval_")
        and key not in EVAL_BOOKKEEPING
        and isinstance(value, int | float)
        and not isinstance(value, bool)
        and math.isfinite(value)
    }


def duration_text(seconds: float) -> str:
    """`42.0 s`, `3.5 min` or `2.25 h`."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    return f"{seconds / 60:.1f} min" if seconds < 3600 else f"{seconds / 3600:.2f} h"
