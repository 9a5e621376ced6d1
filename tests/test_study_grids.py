"""One study folder, several grids (issue 50: every variant at the largest size, a ladder of sizes for none,
standard and unified): each call's grid is recorded, and every report covers their union. Synthetic records only:
the calls below train nothing."""

import json
from pathlib import Path

import pytest

from scalevec.train import ablate
from scalevec.train.study.claims import LOWEST, SCALING, claim_verdicts
from scalevec.train.study.grid import Grid, GridPoint, build_sizes
from scalevec.train.study.intervals import TESTED
from scalevec.train.study.records import records_json
from scalevec.train.study.report import write_report
from scalevec.train.study.summary import summarise

from ._helpers import train_argv
from .test_study import synthetic_records

LADDER = ("1x16", "1x32", "2x32", "2x64")
LARGEST = LADDER[-1]
STRATEGIES = ["none", "standard", "branch", "placement", "magdir", "unified"]  # the group's order
SEEDS = [0, 1, 2, 3, 4]
SHIFT = {"none": 0.1, "standard": 0.0, "unified": -0.05, "branch": -0.02, "placement": -0.02, "magdir": -0.02}
BRANCH = "Branch-specific norm scales help"
REMOVING = "Removing the scale vectors hurts"


def grid_of(sizes, variants, rates) -> Grid:
    # the sizes `train_argv` gives: the tiny preset, 6 steps of 4 x 32 tokens
    return Grid(build_sizes(list(sizes), "tiny", {}, 128, None, 6), list(variants), list(rates), SEEDS)


def ladder() -> Grid:
    return grid_of(LADDER, ["none", "standard", "unified"], [1e-3, 3e-3])


def variants() -> Grid:
    return grid_of([LARGEST], STRATEGIES, [3e-3, 1e-2])


def outcome(point):
    """A power law in N, each variant shifted by SHIFT, 3e-3 the best rate, a little noise per seed and variant."""
    n = 2 * build_sizes([point.size], "tiny", {}, 128, None, 6)[0].non_embedding_parameters  # the records' total
    noise = 0.002 * ((3 * point.seed + len(point.variant)) % 5)
    report = 1.5 + 30 * n**-0.5 + SHIFT[point.variant] + (0.0 if point.learning_rate == 3e-3 else 0.3) + noise
    return report, report, report + 0.5


def call(root: Path, grid: Grid, *extra: str) -> int:
    """The `scalevec-ablate` call of `grid` over `root`, whose records all finished: --resume trains nothing."""
    flags = ["--sizes", ",".join(grid.size_names()), "--variants", ",".join(grid.variants), "--seeds", "0,1,2,3,4"]
    flags += ["--learning-rates", ",".join(f"{rate:g}" for rate in grid.learning_rates)]
    return ablate.main([*flags, *train_argv(root, "--config-overrides", "{}", "--resume", "true", *extra)])


@pytest.fixture(scope="module")
def study(tmp_path_factory) -> Path:
    """The ladder's records, reported; then the variants' call over the same folder with every run recorded."""
    root = tmp_path_factory.mktemp("grids") / "study"
    root.mkdir()
    union = Grid.union([ladder(), variants()])
    write_report(synthetic_records(ladder(), outcome), ladder(), root, figures=False)
    results = json.loads((root / "results.json").read_text())
    results["runs"] = records_json(synthetic_records(union, outcome))
    (root / "results.json").write_text(json.dumps(results))  # the variants' runs finished on another machine
    assert call(root, variants()) == 0
    return root


def claims_of(root: Path) -> list[dict]:
    return json.loads((root / "results.json").read_text())["claims"]


def test_the_union_of_two_grids_holds_their_points_and_each_pair_its_own_rates():
    union = Grid.union([ladder(), variants()])
    assert set(union.points()) == set(ladder().points()) | set(variants().points())
    assert union.size_names() == list(LADDER) and len(union.parts) == 2
    assert union.learning_rates_of(LARGEST, "unified") == [1e-3, 3e-3, 1e-2]
    assert union.learning_rates_of(LARGEST, "branch") == [3e-3, 1e-2]
    assert union.learning_rates_of("1x16", "unified") == [1e-3, 3e-3]
    assert not union.holds("1x16", "branch") and union.holds(LARGEST, "branch")
    assert union.describe() == (
        "2 grids: 4 sizes x 3 variants x 2 learning rates x 5 seeds = 120 runs; 1 size x 6 variants x 2 learning "
        "rates x 5 seeds = 60 runs; 165 runs in all"
    )
    assert Grid.union([ladder(), ladder()]) == ladder()  # a grid the others hold adds nothing: one grid, as before
    wider = grid_of(LADDER, ["none", "standard", "unified"], [1e-3, 3e-3, 1e-2])
    assert Grid.union([ladder(), wider]) == wider and Grid.union([wider, ladder()]) == wider


def test_the_last_call_of_a_group_reports_both_grids(study):
    results = json.loads((study / "results.json").read_text())
    assert [len(grid["variants"]) for grid in results["grids"]] == [3, 6] and "grid" not in results
    assert results["counts"] == {"finished": 165, "diverged": 0, "missing": 0}
    summary = {(s["size"], s["variant"]): s for s in results["summary"]}
    assert len(summary) == 4 * 3 + 3  # branch, placement and magdir at the largest size only
    assert all(s["status"] == "selected" and s["best_learning_rate"] == 3e-3 for s in summary.values())
    assert [r["learning_rate"] for r in summary[LARGEST, "unified"]["learning_rates"]] == [1e-3, 3e-3, 1e-2]
    assert summary[LARGEST, "unified"]["edge"] is None and summary["1x16", "unified"]["edge"] is not None
    text = (study / "results.md").read_text()
    assert "Grid: 2 grids: " in text and "| branch | - | **" in text  # branch never tried 1e-3 at the largest size


def test_a_paired_claim_is_tested_where_both_sides_are(study):
    rows = claims_of(study)
    assert [r["size"] for r in rows if r["claim"] == BRANCH] == [LARGEST]
    branch = next(r for r in rows if r["claim"] == BRANCH)
    assert branch["verdict"] in TESTED and set(branch["differences"]) == {str(seed) for seed in SEEDS}
    assert sum(branch["differences"].values()) / 5 == pytest.approx(-0.02)  # the seeds' noise cancels
    assert [r["size"] for r in rows if r["claim"] == REMOVING] == list(LADDER)
    untested = {r["claim"]: r["runs"] for r in rows if r["verdict"] == "not tested"}
    assert untested["Decaying output-role scales hurts"] == "needs unified-output-norm-decayed and unified-output-norm"


def test_a_claim_whose_sides_share_no_size_is_not_tested_and_nothing_crashes():
    apart = Grid.union([grid_of(["1x16"], ["none"], [3e-3]), grid_of(["1x32"], ["standard", "unified"], [3e-3])])
    summaries = summarise(synthetic_records(apart, outcome), apart)
    rows = claim_verdicts(summaries, [], apart.size_names())
    removing = [r for r in rows if r.claim == REMOVING]
    assert [(r.size, r.verdict, r.runs) for r in removing] == [
        ("-", "not tested", "needs none and standard at one size")
    ]
    lowest = [r for r in rows if r.claim == LOWEST]
    assert [(r.size, r.runs) for r in lowest] == [("1x32", "unified (lr 0.003) − the lowest of standard (lr 0.003)")]
    scaling = next(r for r in rows if r.claim == SCALING)
    assert scaling.runs == "needs 4 sizes or more; the grid has 2"


def test_seeds_trained_at_one_rate_confirm_it_and_take_no_part_in_choosing_it():
    """Seeds 5-9 trained at 3e-3 only, with selection losses that would, averaged over all ten, make 1e-2 the best:
    the rate is chosen on seeds 0-4 (those every rate trained) and Δ is paired over all ten."""
    tried = grid_of([LARGEST], ["none", "standard"], [3e-3, 1e-2])
    confirming = Grid(tried.sizes, ["none", "standard"], [3e-3], [5, 6, 7, 8, 9])
    union = Grid.union([confirming, tried])  # the added seeds recorded first, as a study may

    def confirmed(point):
        select, report, train = outcome(point)
        return select + (1.0 if point.seed >= 5 else 0.0), report, train

    summaries = {s.variant: s for s in summarise(synthetic_records(union, confirmed), union)}
    standard = summaries["standard"]
    assert standard.best_learning_rate == 3e-3 and sorted(standard.report_losses) == list(range(10))
    chosen_by = [confirmed(GridPoint(LARGEST, "standard", 3e-3, seed))[0] for seed in SEEDS]
    assert standard.learning_rates[0].select_loss_mean == pytest.approx(sum(chosen_by) / 5)
    assert standard.learning_rates[0].finished == list(range(10))  # in the order of the seeds, as tables list them
    assert list(summaries["none"].differences) == list(range(10))  # in the order of the seeds, as the rows list them
    assert sum(summaries["none"].differences.values()) / 10 == pytest.approx(0.1)
    removing = next(t for t in claim_verdicts(list(summaries.values()), [], [LARGEST]) if t.claim == REMOVING)
    assert removing.interval.n == 10 and removing.verdict in TESTED


def test_the_lowest_loss_row_names_the_strategies_present_at_its_size(study):
    lowest = {r["size"]: r for r in claims_of(study) if r["claim"] == LOWEST}
    assert list(lowest) == list(LADDER)
    assert lowest["1x16"]["runs"] == "unified (lr 0.003) − the lowest of none (lr 0.003), standard (lr 0.003)"
    others = ", ".join(f"{v} (lr 0.003)" for v in STRATEGIES if v != "unified")
    assert lowest[LARGEST]["runs"] == f"unified (lr 0.003) − the lowest of {others}"

    def loss(variant, seed):
        return outcome(GridPoint(LARGEST, variant, 3e-3, seed))[1]

    lowest_other = {seed: min(loss(v, seed) for v in STRATEGIES if v != "unified") for seed in SEEDS}
    expected = {str(seed): loss("unified", seed) - lowest_other[seed] for seed in SEEDS}
    assert lowest[LARGEST]["differences"] == pytest.approx(expected)


def test_the_ladder_fits_its_variants_over_their_sizes(study):
    results = json.loads((study / "results.json").read_text())
    fitted = {(fit["variant"], fit["counted"]): fit for fit in results["scaling"]}
    assert {variant for variant, _ in fitted} == {"none", "standard", "unified"}  # branch: one size
    assert len(fitted["unified", "total"]["parameters"]) == 4
    assert fitted["unified", "total"]["alpha"] == pytest.approx(0.5, abs=0.1)
    scaling = next(r for r in results["claims"] if r["claim"] == SCALING)
    assert scaling["size"] == "all" and scaling["verdict"] in TESTED
    assert scaling["interval"]["mean"] == pytest.approx(0.0, abs=0.01)  # one law, shifted: the same α
    assert f"over sizes {', '.join(LADDER)}" in scaling["runs"]


def test_report_only_gives_the_last_calls_text(study, tmp_path):
    lone = tmp_path / "lone"
    lone.mkdir()
    (lone / "results.json").write_bytes((study / "results.json").read_bytes())
    assert ablate.main(["--output-dir", str(lone), "--report-only", "true"]) == 0
    for name in ("results.md", "claims.md", "results.json"):
        assert (lone / name).read_bytes() == (study / name).read_bytes(), name


def test_a_size_that_contradicts_a_recorded_grid_is_refused(study, tmp_path, capsys):
    before = (study / "results.json").read_bytes()
    assert call(study, grid_of([LARGEST], ["standard"], [3e-3]), "--max-steps", "7") == 1
    error = capsys.readouterr().err
    assert (
        error.count("\n") == 1 and f"the grid's flags contradict {study / 'results.json'}: size {LARGEST}: " in error
    )
    assert "runs of 6 steps x 128 tokens there, 7 x 128 here" in error
    assert (study / "results.json").read_bytes() == before


def test_records_whose_grids_define_a_size_otherwise_are_refused(tmp_path, capsys):
    for name, steps in (("six", 6), ("seven", 7)):
        grid = Grid(build_sizes(["1x16"], "tiny", {}, 128, None, steps), ["none", "standard"], [3e-3], SEEDS)
        (tmp_path / name).mkdir()
        write_report(synthetic_records(grid, outcome), grid, tmp_path / name, figures=False)
    before = (tmp_path / "six" / "results.json").read_bytes()
    assert (
        ablate.main(
            [
                "--output-dir",
                str(tmp_path / "six"),
                "--report-only",
                "true",
                "--merge-records",
                str(tmp_path / "seven"),
            ]
        )
        == 1
    )
    error = capsys.readouterr().err
    assert error.count("\n") == 1 and "the study's records contradict each other: size 1x16: runs of 6 steps" in error
    assert f"7 x 128 here (there: those before {tmp_path / 'seven' / 'results.json'}; here: it)" in error
    assert (tmp_path / "six" / "results.json").read_bytes() == before


def test_a_grid_that_a_call_training_meanwhile_records_stays_reported(tmp_path, monkeypatch):
    """Shards of two groups train into one folder at once: each rewrites `results.json` after every run, and the
    last writer's report must hold both calls' grids, not only the ones recorded when it started."""
    root = tmp_path / "study"
    root.mkdir()
    first, ours, meanwhile = (
        grid_of([size], [variant], [3e-3])
        for size, variant in ((LARGEST, "none"), (LARGEST, "unified"), ("1x32", "branch"))
    )
    write_report(synthetic_records(first, outcome), first, root, figures=False)
    everything = Grid.union([first, ours, meanwhile])

    def the_other_call_reports_first(point, *arguments):
        # the other group's call started when only `first` was recorded; its runs and ours finished since
        write_report(synthetic_records(everything, outcome), Grid.union([first, meanwhile]), root, figures=False)

    monkeypatch.setattr(ablate, "_train", the_other_call_reports_first)
    assert call(root, ours) == 0
    results = json.loads((root / "results.json").read_text())
    recorded = {(grid["sizes"][0]["name"], *grid["variants"]) for grid in results["grids"]}
    assert recorded == {(LARGEST, "none"), (LARGEST, "unified"), ("1x32", "branch")}
    assert results["counts"] == {"finished": 15, "diverged": 0, "missing": 0}
    assert "## 1x32" in (root / "results.md").read_text()  # the other call's runs are reported, not only kept
