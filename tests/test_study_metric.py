"""`scalevec-ablate --metric`: the claims judged on another logged figure than the held-out loss, its direction
read from its name, the learning rate still chosen on the held-out loss's selection half; and what a run's record
keeps of its final evaluation. Synthetic records, and the CLI's refusals before anything trains."""

import pytest

from scalevec.train import ablate
from scalevec.train.study.claims import LOWEST, claim_verdicts, claims_markdown
from scalevec.train.study.metric import check_logged, metric_name
from scalevec.train.study.records import figures
from scalevec.train.study.report import write_report
from scalevec.train.study.summary import summarise

from .test_study import RATES, REMOVING, SEED, study_argv, synthetic_grid, synthetic_records

ACC = "eval_hellaswag_acc"


def scored(grid, accuracy):
    """Records whose selection half favours 1e-3 and whose accuracy is `accuracy(point)`."""

    def outcome(point):
        return (3.0 if point.learning_rate == 1e-3 else 3.1), 3.2, 3.0

    records = synthetic_records(grid, outcome)
    for record in records:
        record.metrics = {ACC: accuracy(record.point), "eval_perplexity": 20.0}
    return records


def judged(records, grid, metric):
    summaries = summarise(records, grid, metric)
    tests = claim_verdicts(summaries, [], [s.name for s in grid.sizes], metric)
    return {s.variant: s for s in summaries}, {(t.claim, t.size): t for t in tests}, tests


@pytest.mark.parametrize("sign, verdict", [(-1, "holds"), (+1, "contradicted")])
def test_an_accuracy_flips_the_predicted_sign(sign, verdict):
    """Removing the scale vectors is predicted to raise the loss: on an accuracy, to lower it (Δ < 0)."""
    grid = synthetic_grid(variants=("none", "standard", "unified"))
    effects = [0.05, 0.06, 0.04, 0.05]

    def accuracy(point):
        base = 0.5 + (0.1 if point.learning_rate == 3e-3 else 0.0)  # the accuracy favours the rate not chosen
        return base + (sign * effects[point.seed] if point.variant == "none" else 0.0)

    summaries, tests, rows = judged(scored(grid, accuracy), grid, ACC)
    assert summaries["none"].best_learning_rate == 1e-3  # chosen on the held-out loss, not on the metric
    assert summaries["none"].differences == pytest.approx({s: sign * e for s, e in enumerate(effects)})
    removing = tests[REMOVING, "1x16"]
    assert (removing.prediction, removing.expected, removing.verdict) == ("Δ < 0", "lower", verdict)
    lowest = tests[LOWEST, "1x16"]  # unified against the highest of the others: Δ > 0 predicted
    assert lowest.prediction == "Δ > 0" and "the highest of" in lowest.runs
    assert lowest.differences == pytest.approx({s: -max(0.0, sign * e) for s, e in enumerate(effects)})
    text = claims_markdown(rows, "synthetic", [], ACC)
    assert f"Metric: `{ACC}` of each run's final evaluation; higher is better" in text
    assert "chosen on the selection half of the held-out loss" in text


def test_a_loss_like_metric_keeps_the_predicted_sign():
    grid = synthetic_grid()
    records = scored(grid, lambda point: 0.5)
    for record in records:
        record.metrics["eval_tasks_bpb"] = 1.0 + (0.1 * (record.seed + 1) if record.variant == "none" else 0.0)
    _, tests, rows = judged(records, grid, "eval_tasks_bpb")
    assert (tests[REMOVING, "1x16"].prediction, tests[REMOVING, "1x16"].verdict) == ("Δ > 0", "holds")
    assert "Metric: `eval_tasks_bpb` of each run's final evaluation; lower is better" in claims_markdown(
        rows, "synthetic", [], "eval_tasks_bpb"
    )


def test_metric_names_and_directions():
    assert metric_name("hellaswag_acc_norm") == "eval_hellaswag_acc_norm"
    assert metric_name("eval_loss") == "eval_loss"
    for bad in ("eval_hellaswag_items", "eval_report_loss", "speed"):
        with pytest.raises(ValueError, match=rf"--metric '{bad}': give a figure the evaluation logs, ending in _acc"):
            metric_name(bad)


def test_a_record_keeps_the_overall_and_task_figures_not_each_sets():
    evaluation = {
        "eval_loss": 3.0,
        "eval_perplexity": 20.1,
        "eval_bits_per_byte": 1.2,
        "eval_tokens": 310.0,
        "eval_web_loss": 3.1,
        "eval_web_bits_per_byte": 1.3,
        "eval_select_loss": 2.9,
        "eval_piqa_acc": 0.6,
        "eval_piqa_acc_norm": 0.55,
        "eval_piqa_bpb": 1.5,
        "eval_piqa_items": 40.0,
        "eval_tasks_acc": 0.6,
        "eval_tasks_acc_norm": 0.55,
        "eval_tasks_bpb": 1.5,
    }
    kept = figures(evaluation)
    assert set(kept) == {
        "eval_perplexity",
        "eval_bits_per_byte",
        *(f"eval_{task}_{figure}" for task in ("piqa", "tasks") for figure in ("acc", "acc_norm", "bpb")),
    }


def test_a_metric_no_run_logged_is_refused_naming_what_they_log(tmp_path, capsys):
    grid = synthetic_grid(rates=RATES, seeds=(SEED,))
    records = scored(grid, lambda point: 0.5)
    with pytest.raises(ValueError, match="--metric eval_piqa_acc: no run of the grid logged it; the runs log"):
        check_logged("eval_piqa_acc", records)
    write_report(records, grid, tmp_path)
    assert ablate.main(study_argv(tmp_path, "--report-only", "true", "--metric", "eval_piqa_acc")) == 1
    error = capsys.readouterr().err
    assert f"--metric eval_piqa_acc: no run of the grid logged it; the runs log {ACC}, eval_loss, eval_perplexity" in (
        error
    )
    assert ablate.main(study_argv(tmp_path, "--report-only", "true", "--metric", "hellaswag_acc")) == 0
    assert f"Metric: `{ACC}`" in (tmp_path / "claims.md").read_text()
    assert f"| {ACC} (mean ± std) |" in (tmp_path / "results.md").read_text()


def test_before_training_a_metric_this_configuration_will_not_log_is_refused(tmp_path, capsys):
    assert ablate.main(study_argv(tmp_path / "grid", "--metric", "eval_piqa_acc")) == 1
    error = capsys.readouterr().err
    assert "--metric eval_piqa_acc: these runs will not log it; they log eval_loss, eval_perplexity, " in error
    assert not (tmp_path / "grid").exists()
