"""One record for multiple-choice task scores (`run_records.TaskScores`): built from the scorer's sums, logged under
the names it makes, and read back whole by the run's end block, the model card and a study's records."""

import json

import pytest
import torch

from scalevec.convert.card import _task_rows
from scalevec.evaluation.task_scoring import task_scores
from scalevec.run_records import TaskScore, TaskScores
from scalevec.train.run_report import _task_lines
from scalevec.train.study.records import figures

# per task: summed acc, acc_norm, bits per byte and items over every process
SUMS = torch.tensor([[3.0, 4.0, 10.0, 5.0], [1.0, 2.0, 9.0, 4.0]], dtype=torch.float64)
HELD_OUT = {"eval_loss": 3.5, "eval_perplexity": 33.1, "eval_bits_per_byte": 1.9, "eval_tokens": 512}


def test_task_scores_round_trip_through_their_logged_names():
    scores = task_scores(["hellaswag", "mine"], SUMS)
    assert scores.tasks == {"hellaswag": TaskScore(0.6, 0.8, 2.0, 5), "mine": TaskScore(0.25, 0.5, 2.25, 4)}
    assert scores.mean == TaskScore(pytest.approx(0.425), pytest.approx(0.65), pytest.approx(2.125))
    logged = scores.metrics()
    assert list(logged) == [
        *(f"eval_hellaswag_{key}" for key in ("acc", "acc_norm", "bpb", "items")),
        *(f"eval_mine_{key}" for key in ("acc", "acc_norm", "bpb", "items")),
        "eval_tasks_acc",
        "eval_tasks_acc_norm",
        "eval_tasks_bpb",
    ]
    assert (logged["eval_mine_items"], logged["eval_tasks_acc"]) == (4, scores.mean.acc)
    # as a log entry, `all_results.json` or a run summary holds them: beside the held-out figures, through JSON
    read = TaskScores.from_metrics(json.loads(json.dumps({**HELD_OUT, **logged})))
    assert read == scores and read.metrics() == logged
    assert TaskScores.from_metrics(scores.metrics("test"), prefix="test") == scores
    assert [name for name in logged if TaskScores.is_metric(name)] == list(logged)
    assert not any(TaskScores.is_metric(name) for name in HELD_OUT)
    assert set(TaskScores.metric_names(scores.tasks)) == set(scores.metrics(items=False))


def test_one_task_has_no_mean_and_a_task_without_items_is_refused():
    alone = task_scores(["mine"], SUMS[1:])
    assert alone.mean is None and alone.rows() == [("mine", TaskScore(0.25, 0.5, 2.25, 4))]
    assert "eval_tasks_acc" not in alone.metrics()
    assert TaskScores.from_metrics(HELD_OUT) == TaskScores({})
    with pytest.raises(ValueError, match="task mine: no item was scored"):
        task_scores(["mine"], torch.zeros(1, 4, dtype=torch.float64))


def test_the_end_block_the_card_and_the_study_read_the_record():
    logged = {**HELD_OUT, **task_scores(["hellaswag", "mine"], SUMS).metrics()}
    assert _task_lines(logged) == [
        "  hellaswag  acc 0.6000, acc_norm 0.8000, 2.000 bits per byte, 5 items",
        "  mine       acc 0.2500, acc_norm 0.5000, 2.250 bits per byte, 4 items",
        "  tasks      acc 0.4250, acc_norm 0.6500, 2.125 bits per byte (mean)",
    ]
    sources = {
        "hellaswag": {"dataset": "Rowan/hellaswag", "split": "validation", "available": 10042, "subset_seed": 0}
    }
    assert _task_rows(logged, sources) == [
        (
            "hellaswag (5 of the 10,042 items of the validation split, drawn with seed 0)",
            "accuracy 0.6000, length-normalised accuracy 0.8000, 2.0000 bits per byte of the answer",
        ),
        ("mine (4 items)", "accuracy 0.2500, length-normalised accuracy 0.5000, 2.2500 bits per byte of the answer"),
        (
            "mean of the 2 tasks",
            "accuracy 0.4250, length-normalised accuracy 0.6500, 2.1250 bits per byte of the answer",
        ),
    ]
    kept = figures(logged)  # a study's record: the figures, not the counts
    assert kept == {
        key: value
        for key, value in logged.items()
        if key not in ("eval_loss", "eval_tokens") and not key.endswith("_items")
    }
