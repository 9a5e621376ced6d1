"""The study's records (`results.json`) as the only thing a study keeps: `--report-only` re-reports a lone records
file exactly with no flags, refuses flags that contradict it and a folder with nothing to report, never writes
fewer records than it held, reads foreign non-finite figures as not measured, merges other shards' records, and
`--resume` trains only what neither a run folder nor the records hold."""

import json
import math
import re
import shutil
from pathlib import Path

import pytest

from scalevec.train import ablate
from scalevec.train.study.records import FINISHED, load_records
from scalevec.train.study.report import write_report

from ._helpers import train_argv
from .test_study import synthetic_grid, synthetic_records

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
COMMITTED = sorted(path.parent for path in BENCHMARKS.glob("*/results.json"))  # every committed study
TRAINED = re.compile(r"^\[ablation\] \d+/\d+ (\S+) (\S+) lr (\S+) seed (\d+):", re.MULTILINE)


def report_only(root: Path, *flags: str) -> int:
    return ablate.main(["--output-dir", str(root), "--report-only", "true", *flags])


def runs_of(root: Path) -> list[dict]:
    return json.loads((root / "results.json").read_text())["runs"]


def lone_copy(study: Path, tmp_path: Path) -> Path:
    lone = tmp_path / study.name
    lone.mkdir()
    shutil.copy(study / "results.json", lone / "results.json")
    return lone


@pytest.mark.parametrize("study", COMMITTED, ids=[path.name for path in COMMITTED])
@pytest.mark.slow
def test_a_committed_records_file_alone_re_reports_the_committed_text_byte_for_byte(study, tmp_path):
    lone = lone_copy(study, tmp_path)
    assert report_only(lone) == 0  # no grid flag: the grid is the one results.json records
    for name in ("results.md", "claims.md", "results.json"):  # results.json too: a re-report is a fixed point
        assert (lone / name).read_bytes() == (study / name).read_bytes(), name


def test_flags_that_contradict_the_records_are_refused_touching_nothing(tmp_path, capsys):
    lone = lone_copy(BENCHMARKS / "miniature-4x128", tmp_path)
    before = (lone / "results.json").read_bytes()
    assert report_only(lone, "--sizes", "4x128", "--max-steps", "6") == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and f"the grid's flags contradict {lone / 'results.json'}: size 4x128: " in error
    assert "runs of 2,000 steps x 2,048 tokens there, 6 x " in error
    assert report_only(lone, "--seeds", "7") == 1  # the default sizes and a seed the records never ran
    error = capsys.readouterr().err
    assert "--report-only: none of the " in error and "runs that --seeds give is recorded in" in error
    assert (lone / "results.json").read_bytes() == before
    assert [path.name for path in lone.iterdir()] == ["results.json"]


def test_report_only_on_a_folder_with_no_runs_and_no_records_is_refused(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    assert report_only(empty) == 1
    error = capsys.readouterr().err
    assert f"--output-dir {empty}: no run of the grid (" in error and "or in results.json: nothing to report" in error
    assert not list(empty.iterdir())


def synthetic_study(root: Path, seeds=(0, 1, 2)):
    """1x16, none and standard at 1e-3 and 3e-3, `seeds`: 3e-3 has the lower selection loss, none is 0.1 worse."""
    grid = synthetic_grid(seeds=seeds)

    def outcome(point):
        shift = 0.1 if point.variant == "none" else 0.0
        rate = 0.0 if point.learning_rate == 3e-3 else 0.5
        return 3.0 + rate + shift, 3.0 + rate + shift + 0.01 * point.seed, 2.0

    records = synthetic_records(grid, outcome)
    root.mkdir(parents=True, exist_ok=True)
    write_report(records, grid, root, figures=False)
    return grid, records


def test_non_finite_records_neither_win_the_selection_nor_crash_the_report(tmp_path):
    root = tmp_path / "foreign"
    synthetic_study(root)
    results = json.loads((root / "results.json").read_text())
    for entry in results["runs"]:
        if (entry["variant"], entry["learning_rate"], entry["seed"]) == ("standard", 1e-3, 0):
            entry["eval_select_loss"] = -math.inf  # would win 1e-3 for standard if it counted
        if (entry["variant"], entry["learning_rate"], entry["seed"]) == ("none", 3e-3, 1):
            entry["eval_report_loss"] = math.nan  # statistics.stdev raised on it
            entry["quantized_report_loss"] = {"none": math.nan}
    (root / "results.json").write_text(json.dumps(results))  # -Infinity, NaN: Python's JSON reads them
    assert report_only(root) == 0
    written = json.loads((root / "results.json").read_text())
    summary = {s["variant"]: s for s in written["summary"]}
    assert summary["standard"]["best_learning_rate"] == 3e-3
    assert summary["none"]["best_learning_rate"] == 3e-3
    assert summary["none"]["report_losses"] == pytest.approx({"0": 3.1, "2": 3.12})
    assert summary["none"]["report_loss_mean"] == pytest.approx(3.11)
    assert summary["standard"]["differences"] == {} and set(summary["none"]["differences"]) == {"0", "2"}
    rate = next(r for r in summary["standard"]["learning_rates"] if r["learning_rate"] == 1e-3)
    assert rate["select_loss_mean"] is None  # the rate lost: one seed's selection loss is not measured
    loaded = load_records(json.loads((root / "results.json").read_text()))
    nan_record = loaded["1x16", "none", 3e-3, 1, None]
    assert nan_record.status == FINISHED and nan_record.eval_report_loss is None
    assert nan_record.quantized_report_loss == {}
    assert "NaN" not in (root / "results.json").read_text() and "Infinity" not in (root / "results.json").read_text()


def test_a_narrower_report_keeps_the_records_it_does_not_report(tmp_path):
    root = tmp_path / "study"
    synthetic_study(root)
    before = runs_of(root)
    flags = ["--sizes", "1x16", "--variants", "none,standard", "--learning-rates", "1e-3,3e-3", "--seeds", "0,1"]
    assert ablate.main([*flags, *train_argv(root, "--config-overrides", "{}"), "--report-only", "true"]) == 0
    assert "1 size x 2 variants x 2 learning rates x 2 seeds = 8 runs" in (root / "results.md").read_text()
    after = runs_of(root)
    assert len(after) == len(before) == 12 and sorted(map(json.dumps, after)) == sorted(map(json.dumps, before))


def test_two_shards_records_merge_into_one_study(tmp_path):
    grid, records = synthetic_study(tmp_path / "whole")
    for index, name in enumerate(("shard0", "shard1")):  # each machine's records: its share, the rest missing
        share = set(grid.shard(index, 2))
        ours = [r if r.point in share else type(r)(*r.key[:4], "missing") for r in records]
        for r in ours:
            r.non_embedding_parameters = records[0].non_embedding_parameters
        (tmp_path / name).mkdir()
        write_report(ours, grid, tmp_path / name, figures=False)
    assert "Runs: 6 finished, 0 diverged, 6 missing" in (tmp_path / "shard0" / "results.md").read_text()
    assert report_only(tmp_path / "shard0", "--merge-records", str(tmp_path / "shard1" / "results.json")) == 0
    for name in ("results.md", "claims.md"):
        assert (tmp_path / "shard0" / name).read_text() == (tmp_path / "whole" / name).read_text(), name
    assert runs_of(tmp_path / "shard0") == runs_of(tmp_path / "whole")
    merged = tmp_path / "merged"  # or into a folder of its own, the grid from the first records file
    merged.mkdir()
    others = f"{tmp_path / 'shard1'},{tmp_path / 'shard0' / 'results.json'}"
    assert report_only(merged, "--merge-records", others) == 0
    assert (merged / "claims.md").read_text() == (tmp_path / "whole" / "claims.md").read_text()


def test_merge_records_that_are_no_results_file_are_refused(tmp_path, capsys):
    synthetic_study(tmp_path / "study")
    assert report_only(tmp_path / "study", "--merge-records", str(tmp_path / "nothere.json")) == 1
    assert "--merge-records " in capsys.readouterr().err


def tiny_study(root: Path, *flags: str) -> list[str]:
    grid = ["--variants", "none,standard", "--learning-rates", "0.01", "--seeds", "3"]
    return [*grid, *train_argv(root, "--max-eval-documents", "2", "--scale-stats", "false", *flags, steps=4)]


def trained(argv: list[str], capsys) -> tuple[set, str]:
    assert ablate.main(argv) == 0, capsys.readouterr().err
    output = capsys.readouterr().out
    return {(variant, seed) for _, variant, _, seed in TRAINED.findall(output)}, output


@pytest.mark.slow
def test_shards_on_separate_machines_make_one_study_that_resumes_from_its_records_alone(tmp_path, capsys):
    first, second = tmp_path / "machine0", tmp_path / "machine1"
    done, output = trained(tiny_study(first, "--shard", "0/2"), capsys)
    assert done == {("none", "3")}
    assert "[ablation] 1 seed: no claim can be resolved (a verdict pairs 3 seeds or more)" in output
    assert trained(tiny_study(second, "--shard", "1/2"), capsys)[0] == {("standard", "3")}
    # the first machine takes the second's records: the study is whole, nothing trains twice
    done, output = trained(tiny_study(first, "--resume", "true", "--merge-records", str(second)), capsys)
    assert not done and "finished or diverged already: 2; to train now: 0" in output
    records = runs_of(first)
    assert [r["status"] for r in records] == [FINISHED, FINISHED]
    shutil.rmtree(first / "tiny")  # the scratch space wiped: only results.json is left
    done, output = trained(tiny_study(first, "--resume", "true"), capsys)
    assert not done and "to train now: 0" in output and runs_of(first) == records
    assert ablate.main(tiny_study(first)) == 1  # without --resume, recorded runs are not trained over
    assert "2 runs of this share are recorded as finished or diverged" in capsys.readouterr().err
    results = json.loads((first / "results.json").read_text())
    results["runs"] = [r for r in results["runs"] if r["variant"] == "none"]  # the records lose a run
    (first / "results.json").write_text(json.dumps(results))
    done, _ = trained(tiny_study(first, "--resume", "true"), capsys)
    assert done == {("standard", "3")}  # only what neither a folder nor the records hold
    assert [r["variant"] for r in runs_of(first)] == ["none", "standard"]


def test_a_records_file_whose_grid_this_version_cannot_read_is_refused_in_one_line(tmp_path, capsys):
    (tmp_path / "results.json").write_text(json.dumps({"grid": {"sizes": [{"name": "1x16"}]}, "runs": []}))
    assert report_only(tmp_path) == 1
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "results.json: a grid this version cannot read (TypeError" in error
