"""What a finished run of the grid recorded, read back from its folder: the report is built from the folders, so
it covers the runs that other shards (other processes, other machines) finished too."""

import math
from dataclasses import dataclass
from pathlib import Path

from ...configuration_scalevec import ScaleVecConfig
from ...convert.meta_model import scale_parameters
from ...run_records import duration_text, logged_curve, read_json, read_run_records
from ..resume import finished_step
from .grid import Grid, GridPoint


@dataclass
class RunRecord:
    size: str
    variant: str
    learning_rate: float
    seed: int
    non_embedding_parameters: int
    train_loss: float  # last logged training loss (NaN where none was logged)
    eval_loss: float | None
    tokens: int
    train_seconds: float  # the whole run's wall time, over any resumes
    scale_parameters: int
    output_dir: str

    def describe(self) -> str:
        evaluation = "-" if self.eval_loss is None else f"{self.eval_loss:.4f}"
        return (
            f"{self.size} {self.variant} lr {self.learning_rate:g} seed {self.seed}: train loss "
            f"{self.train_loss:.4f}, eval loss {evaluation}, {duration_text(self.train_seconds)}"
        )


def is_finished(grid: Grid, point: GridPoint, root: Path) -> bool:
    return finished_step(point.folder(root), grid.size(point.size).max_steps) is not None


def finished_records(grid: Grid, root: Path) -> list[RunRecord]:
    """The runs of `grid` that finished in `root`, in the grid's order."""
    return [read_record(grid, point, root) for point in grid.points() if is_finished(grid, point, root)]


def read_record(grid: Grid, point: GridPoint, root: Path) -> RunRecord:
    folder = point.folder(root)
    records = read_run_records(folder)
    metrics = read_json(folder / "all_results.json") or {}  # the Trainer's: of the last segment only
    summary = records.summary or {}  # the whole run's, however often it was resumed
    losses = logged_curve(records.log_history, "loss")
    return RunRecord(
        size=point.size,
        variant=point.variant,
        learning_rate=point.learning_rate,
        seed=point.seed,
        non_embedding_parameters=grid.size(point.size).non_embedding_parameters,
        train_loss=losses[-1][1] if losses else math.nan,
        eval_loss=records.eval_metrics.get("eval_loss"),
        tokens=int(summary.get("tokens_seen") or metrics.get("num_input_tokens_seen", 0)),
        train_seconds=float(summary.get("wall_seconds") or metrics.get("train_runtime", 0.0)),
        scale_parameters=sum(scale_parameters(ScaleVecConfig.from_pretrained(folder)).values()),
        output_dir=str(folder),
    )
