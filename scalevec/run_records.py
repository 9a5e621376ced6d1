"""What a `transformers` Trainer run folder records about itself, read back: shared by training (which writes
the run's picture and compares runs) and the converter (whose model card quotes the records).

Missing or unreadable files are skipped rather than raised: a reader of records says less, never something false.
"""

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

RUN_PICTURE = "scale_vectors.png"  # the loss / scale-statistics figure `scalevec-train` writes into its output folder
TRAINER_STATE = "trainer_state.json"
TRAINING_DATA = "training_data.json"  # what `scalevec-train` trained on: sources, sizes, mixture weights
RUN_SUMMARY = "run_summary.json"  # how `scalevec-train` ended: losses, evaluation, hardware, throughput
# Eval keys that describe the evaluation run rather than the model.
EVAL_BOOKKEEPING = {"eval_runtime", "eval_samples_per_second", "eval_steps_per_second"}


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
