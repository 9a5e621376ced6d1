"""The study of `scalevec-ablate` (sizes, learning rates, diverged runs, held-out halves, shards, records): one tiny
grid of 1 size x 2 variants x 3 learning rates (one of which diverges) x 1 seed, trained by two shard processes at
once over one folder, then reported by a third call that must train nothing; every figure of its report is checked
against what the runs recorded, and the report is written again from `results.json` alone. The verdicts, the
learning-rate selection and the scaling fits are tested on synthetic records with known effects."""

import contextlib
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
from itertools import product
from types import SimpleNamespace

import numpy as np
import pytest
from scipy import stats

from scalevec.configuration_scalevec import ScaleVecConfig
from scalevec.convert.meta_model import active_parameters, num_parameters
from scalevec.data.held_out import evaluation_halves
from scalevec.train import ablate
from scalevec.train.presets import MODEL_SIZES, size_fields
from scalevec.train.study.claims import LOWEST, SCALING, claim_verdicts, claims_markdown
from scalevec.train.study.grid import Grid, build_sizes
from scalevec.train.study.intervals import holm, paired_interval
from scalevec.train.study.records import DIVERGED, FINISHED, MISSING, RunRecord
from scalevec.train.study.report import write_report
from scalevec.train.study.scaling import scaling_fits
from scalevec.train.study.summary import best_runs, summarise

from ._helpers import SUBPROCESS_ENV, log_history, logged_losses, train_argv

pytestmark = pytest.mark.slow  # it starts processes or trains end to end

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SIZES, VARIANTS, RATES, SEED = ("1x16",), ("none", "standard"), (0.01, 0.03, 1e30), 5
GRID = {(size, variant, rate) for size, variant, rate in product(SIZES, VARIANTS, RATES)}
TRAINED = re.compile(r"^\[ablation\] \d+/\d+ (\S+) (\S+) lr (\S+) seed (\d+):", re.MULTILINE)
# The non-embedding parameters of one layer of hidden H, one head, SwiGLU width W: q, k, v, o (4 H^2) and 3 H W.
PARAMETERS = {"1x16": 4 * 16 * 16 + 3 * 16 * 48, "1x32": 4 * 32 * 32 + 3 * 32 * 96}
REMOVING = "Removing the scale vectors hurts"
# Each run also gives the budget of 3 of its 6 steps: a cooldown of 2 steps branched after its step 1.
DECAY = ("--lr-scheduler-type", "warmup_stable_decay", "--lr-scheduler-kwargs", '{"num_decay_steps": 0.5}')
DECAY += ("--decay-at", "0.5,1")


def study_argv(root, *extra: str) -> list[str]:
    grid = ["--sizes", ",".join(SIZES), "--variants", ",".join(VARIANTS), "--seeds", str(SEED)]
    grid += ["--learning-rates", ",".join(map(str, RATES))]
    flags = ("--config-overrides", "{}", "--max-eval-documents", "2", "--scale-stats", "false", *DECAY)
    return [*grid, *train_argv(root, *flags, *extra, steps=6)]


def final_evaluation(size: str, variant: str, rate: float, root) -> dict:
    run = root / size / f"{variant}-lr{rate:g}-seed{SEED}"
    return [entry for entry in log_history(run) if "eval_loss" in entry][-1]


def state_times(root) -> dict:
    files = [*root.glob("*/*/trainer_state.json"), *root.glob("*/*/diverged.json")]
    return {path: path.stat().st_mtime_ns for path in files}


def run_in_process(argv: list[str]) -> str:
    """What `scalevec-ablate argv` prints, run in this process; it must succeed."""
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        assert ablate.main(argv) == 0
    return output.getvalue()


@pytest.fixture(scope="module")
def study(tmp_path_factory):
    """Shard 1/2 in a subprocess while shard 0/2 trains in this process, both on one folder; then a report call
    with --resume."""
    root = tmp_path_factory.mktemp("study") / "grid"
    command = [sys.executable, "-m", "scalevec.train.ablate", *study_argv(root, "--shard", "1/2")]
    environment = {**os.environ, **SUBPROCESS_ENV}
    other = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment)
    outputs = [run_in_process(study_argv(root, "--shard", "0/2"))]
    out, err = other.communicate(timeout=600)
    assert other.returncode == 0, err[-3000:]
    outputs.append(out)
    before = state_times(root)
    report = run_in_process(study_argv(root, "--resume", "true"))
    finite = [key for key in GRID if key[2] < 1]
    return SimpleNamespace(
        root=root,
        shard_outputs=outputs,
        trained=[{(s, v, float(lr)) for s, v, lr, _ in TRAINED.findall(output)} for output in outputs],
        report=report,
        times=(before, state_times(root)),
        results=json.loads((root / "results.json").read_text()),
        evals={key: final_evaluation(*key, root) for key in finite},
    )


def test_two_shards_train_disjoint_halves_whose_union_is_the_grid(study):
    first, second = study.trained
    assert len(first) == len(second) == 3 and not first & second and first | second == GRID
    for index, output in enumerate(study.shard_outputs):
        assert "grid: 1 size x 2 variants x 3 learning rates x 1 seed = 6 runs" in output
        assert f"shard {index}/2: 3 of the 6 runs (shares of 3, 3); finished or diverged already: 0" in output
    assert "1x16: 1 layer, hidden 16, 1 head (1 key-value), SwiGLU 48; N = 3,328 non-embedding" in output
    assert "6 steps x 128 tokens = 768 tokens a run" in output
    assert not list(study.root.glob("**/*.tmp*"))  # the shards wrote the shared files without leaving pieces


def test_a_report_call_after_the_shards_trains_nothing_and_keeps_the_diverged_runs(study):
    assert "all 6 runs; finished or diverged already: 6; to train now: 0" in study.report
    assert "[ablation] trained 0 runs; of the grid's 6: 4 finished, 2 diverged, 0 missing" in study.report
    before, after = study.times
    assert len(before) == 6 and after == before
    assert "# scalevec-ablate: 4 of 6 runs finished" in study.report
    assert "Runs: 4 finished, 2 diverged, 0 missing, of the grid's 6." in study.report


def test_a_diverging_rate_is_recorded_and_the_selection_goes_around_it(study):
    runs = {(r["size"], r["variant"], r["learning_rate"]): r for r in study.results["runs"] if r["budget"] is None}
    assert len(runs) == 6
    for size, variant in product(SIZES, VARIANTS):
        diverged = runs[size, variant, 1e30]
        recorded = json.loads((study.root / size / f"{variant}-lr1e+30-seed{SEED}" / "diverged.json").read_text())
        assert diverged["status"] == DIVERGED and diverged["step"] == recorded["step"] > 0
        assert (
            diverged["diverged_learning_rate"] == recorded["learning_rate"] and 0 < recorded["learning_rate"] <= 1e30
        )
        assert "the training loss became nan" in recorded["message"] or "non-finite" in recorded["message"]
        for rate in RATES[:2]:
            run, logged = runs[size, variant, rate], study.evals[size, variant, rate]
            assert run["status"] == FINISHED
            assert (run["eval_select_loss"], run["eval_report_loss"]) == (
                logged["eval_select_loss"],
                logged["eval_report_loss"],
            )
            assert run["train_loss"] == logged_losses(study.root / size / f"{variant}-lr{rate:g}-seed{SEED}")[-1]
            assert run["tokens"] == 6 * 4 * 32 and run["non_embedding_parameters"] == PARAMETERS[size]
            assert run["metrics"]["eval_perplexity"] == logged["eval_perplexity"]  # the figures --metric can pick
        assert runs[size, "none", 0.01]["scale_parameters"] == 0 < runs[size, "standard", 0.01]["scale_parameters"]
    summary = {(s["size"], s["variant"]): s for s in study.results["summary"]}
    for size in SIZES:
        best = {v: min(RATES[:2], key=lambda rate: study.evals[size, v, rate]["eval_select_loss"]) for v in VARIANTS}
        for variant in VARIANTS:
            assert summary[size, variant]["best_learning_rate"] == best[variant]
        report = {v: study.evals[size, v, best[v]]["eval_report_loss"] for v in VARIANTS}
        assert summary[size, "none"]["differences"] == {str(SEED): report["none"] - report["standard"]}
        row = next(line for line in (study.root / "claims.md").read_text().splitlines() if f"| {size} |" in line)
        assert row.startswith(
            f"| {REMOVING} | {size} | none (lr {best['none']:g}) − standard (lr {best['standard']:g})"
        )
        assert "| unresolved (1 seed; needs 3) |" in row


def test_the_evaluation_halves_split_the_evaluated_blocks(study):
    select, report = evaluation_halves(list(range(7)))
    assert (list(select), list(report)) == ([0, 2, 4, 6], [1, 3, 5])
    for evaluation in study.evals.values():  # blocks of 32 tokens predict 31 each; the select half has the odd one
        blocks = evaluation["eval_tokens"] // 31
        chosen, other = (blocks + 1) // 2, blocks // 2
        assert blocks >= 2 and evaluation["eval_select_loss"] != evaluation["eval_report_loss"]
        combined = (chosen * evaluation["eval_select_loss"] + other * evaluation["eval_report_loss"]) / blocks
        assert combined == pytest.approx(evaluation["eval_loss"], abs=1e-9)


def test_each_finished_run_gives_a_record_of_each_budget_and_the_report_tabulates_them(study):
    branches = {(r["size"], r["variant"], r["learning_rate"]): r for r in study.results["runs"] if r["budget"]}
    assert set(branches) == {key for key in GRID if key[2] < 1}  # a diverged run branches nothing
    rows = {}
    for (size, variant, rate), branch in branches.items():
        folder = study.root / size / f"{variant}-lr{rate:g}-seed{SEED}" / "budget-0.5"
        logged = [entry for entry in log_history(folder) if "eval_loss" in entry][-1]  # the branch's own halves
        assert branch["status"] == FINISHED and branch["budget"] == 0.5 and branch["step"] == 3
        assert branch["tokens"] == 3 * 4 * 32 and branch["non_embedding_parameters"] == PARAMETERS[size]
        assert (branch["eval_select_loss"], branch["eval_report_loss"]) == (
            logged["eval_select_loss"],
            logged["eval_report_loss"],
        )
        assert branch["eval_report_loss"] != study.evals[size, variant, rate]["eval_report_loss"]
        rows[size, variant, rate] = branch["eval_report_loss"]
    summary = {(s["size"], s["variant"]): s for s in study.results["summary"]}
    results = (study.root / "results.md").read_text()
    section = results[results.index("## Loss against tokens") :]
    assert "chosen on the whole budget's selection half" in section
    for size in SIZES:  # each variant at its best rate of the whole budget, the budgets in rows
        best = {v: summary[size, v]["best_learning_rate"] for v in VARIANTS}
        half = " | ".join(f"{rows[size, v, best[v]]:.4f} (1)" for v in VARIANTS)
        whole = " | ".join(f"{study.evals[size, v, best[v]]['eval_report_loss']:.4f} (1)" for v in VARIANTS)
        assert f"| {size} | {PARAMETERS[size]:,} | 0.5 | 384 | {384 / PARAMETERS[size]:.3g} | {half} |" in section
        assert f"| {size} | {PARAMETERS[size]:,} | 1 | 768 | {768 / PARAMETERS[size]:.3g} | {whole} |" in section
    assert "L(N, D) = E + A·N^-α + B·D^-β: not tested (none: needs 4 sizes with 3 budgets" in section
    assert set(study.results["budget_fits"]) == set(VARIANTS)


def test_report_only_over_a_lone_results_json_writes_the_same_reports(study, tmp_path):
    lone = tmp_path / "records"
    lone.mkdir()
    shutil.copy(study.root / "results.json", lone / "results.json")
    output = run_in_process(study_argv(lone, "--report-only", "true"))
    assert "report only: training nothing" in output
    for name in ("results.json", "results.md", "claims.md"):
        assert (lone / name).read_bytes() == (study.root / name).read_bytes(), name
    assert (study.root / "loss_curves.png").read_bytes().startswith(PNG_SIGNATURE)
    assert not (lone / "loss_curves.png").exists()  # the run folders' curves are not in the records


def test_a_fresh_process_rewrites_the_reports_from_records_without_the_trainer(study, tmp_path):
    script = f"""
        import sys
        from pathlib import Path
        from scalevec.train.study.records import read_results
        from scalevec.train.study.report import write_report
        grid, records = read_results(Path({str(study.root / "results.json")!r}))
        write_report(records, grid, Path({str(tmp_path)!r}))
        training = ("scalevec.train.trainer", "scalevec.train.cli", "transformers.trainer")
        loaded = [m for m in training if m in sys.modules]
        print("loaded:", loaded)
    """
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **SUBPROCESS_ENV},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert "loaded: []" in result.stdout
    for name in ("results.md", "claims.md"):
        assert (tmp_path / name).read_bytes() == (study.root / name).read_bytes(), name


def test_report_only_on_a_missing_folder_is_refused(tmp_path, capsys):
    assert ablate.main(study_argv(tmp_path / "typo", "--report-only", "true")) == 1
    assert f"--output-dir {tmp_path / 'typo'}: no such folder, so nothing to report" in capsys.readouterr().err
    assert not (tmp_path / "typo").exists()


# Synthetic records: each point's (selection-half, report-half, training) loss, "diverged", or None (missing).


def synthetic_grid(sizes=("1x16",), variants=("none", "standard"), rates=(1e-3, 3e-3), seeds=(0, 1, 2, 3)) -> Grid:
    return Grid(build_sizes(list(sizes), "tiny", {}, 128, None, 6), list(variants), list(rates), list(seeds))


def synthetic_records(grid: Grid, outcome) -> list[RunRecord]:
    records = []
    for point in grid.points():
        n = grid.size(point.size).non_embedding_parameters
        result = outcome(point)
        record = RunRecord(point.size, point.variant, point.learning_rate, point.seed, MISSING)
        record.non_embedding_parameters, record.total_parameters, record.active_parameters = n, 2 * n, 2 * n
        if result == "diverged":
            record.status, record.step = DIVERGED, 3
        elif result is not None:
            select, report, train = result
            record.status, record.step, record.tokens, record.train_seconds = FINISHED, 6, 768, 1.0
            record.eval_select_loss, record.eval_report_loss, record.train_loss = select, report, train
            record.eval_loss = None if select is None else (select + report) / 2
        records.append(record)
    return records


def verdicts(records: list[RunRecord], grid: Grid, fits: list | None = None) -> dict:
    """(claim, size) -> its test; `fits`, when given, receives the scaling fits the claims were judged on."""
    summaries = summarise(records, grid)
    found = scaling_fits(best_runs(records, summaries), [s.name for s in grid.sizes], len(grid.seeds))
    (fits if fits is not None else []).extend(found)
    return {(t.claim, t.size): t for t in claim_verdicts(summaries, found, [s.name for s in grid.sizes])}


def test_the_selection_ranks_by_the_selection_half_and_reports_the_other():
    """At 1e-3 the selection half is lowest; training loss and the report half favour 3e-3: the best rate is 1e-3,
    and Δ comes from the report half at 1e-3."""
    grid = synthetic_grid()

    def outcome(point):
        shift = 0.2 if point.variant == "none" else 0.0
        if point.learning_rate == 1e-3:
            return 3.0 + shift, 3.5 + shift + 0.01 * point.seed, 2.5
        return 3.1 + shift, 3.2 + shift, 2.0

    summaries = {s.variant: s for s in summarise(synthetic_records(grid, outcome), grid)}
    assert summaries["none"].best_learning_rate == summaries["standard"].best_learning_rate == 1e-3
    assert summaries["none"].differences == pytest.approx({seed: 0.2 for seed in grid.seeds})
    assert summaries["none"].edge == "extend the grid below 0.001"


def test_a_diverged_seed_or_a_missing_selection_loss_never_wins():
    grid = synthetic_grid(rates=(1e-3, 3e-3, 1e-2))

    def outcome(point):
        if point.learning_rate == 1e-2:  # the lowest selection loss, but one seed diverged
            return "diverged" if point.seed == 2 else (1.0, 1.0, 1.0)
        if point.learning_rate == 3e-3:  # the next lowest, but one seed's loss was not finite (not recorded)
            return (None if point.seed == 1 else 2.0), 2.0, 2.0
        return 3.0, 3.0, 3.0

    for summary in summarise(synthetic_records(grid, outcome), grid):
        assert summary.best_learning_rate == 1e-3 and summary.edge == "extend the grid below 0.001"
    diverged = synthetic_records(grid, lambda point: "diverged")
    assert {s.status for s in summarise(diverged, grid)} == {"no rate selectable"}
    test = verdicts(diverged, grid)[REMOVING, "1x16"]
    assert test.verdict == "not tested" and test.runs.startswith("none, standard: no learning rate finished")


@pytest.mark.parametrize(
    "effects, verdict",
    [
        ([0.10, 0.12, 0.09, 0.11], "holds"),
        ([-0.10, -0.12, -0.09, -0.11], "contradicted"),
        ([0.10, -0.12, 0.02, 0.01], "unresolved"),
        ([0.3, 0.4], "unresolved"),  # two seeds: unresolved whatever their signs
        ([0.10, 0.10, 0.10, 0.10, -0.001], "holds"),  # one seed against: the interval still excludes 0
        ([0.0001], "unresolved"),
    ],
)
def test_verdicts_come_from_the_paired_interval(effects, verdict):
    grid = synthetic_grid(seeds=tuple(range(len(effects))))

    def outcome(point):
        return 3.0, 3.0 + (effects[point.seed] if point.variant == "none" else 0.0), 3.0

    test = verdicts(synthetic_records(grid, outcome), grid)[REMOVING, "1x16"]
    assert test.verdict == verdict
    n, mean = len(effects), float(np.mean(effects))
    if n == 1:
        assert test.interval.mean == pytest.approx(mean) and "| unresolved (1 seed; needs 3) |" in claim_row(test)
        return
    half = stats.t.ppf(0.975, n - 1) * np.std(effects, ddof=1) / math.sqrt(n)
    assert (test.interval.mean, test.interval.low, test.interval.high) == pytest.approx(
        (mean, mean - half, mean + half)
    )


def claim_row(test) -> str:
    return claims_markdown([test], "synthetic", []).splitlines()[-1]


def test_one_shard_of_two_gives_incomplete_rows_naming_the_missing_runs(tmp_path):
    grid = synthetic_grid(variants=("none", "standard", "unified"), seeds=(0, 1, 2))
    shard = set(grid.shard(0, 2))
    records = synthetic_records(grid, lambda point: (3.0, 3.0, 3.0) if point in shard else None)
    tests = verdicts(records, grid)
    assert tests[REMOVING, "1x16"].verdict == tests[LOWEST, "1x16"].verdict == "incomplete"
    assert tests[REMOVING, "1x16"].runs.startswith("missing: none lr 0.003 seed 0, ")
    results, claims = write_report(records, grid, tmp_path, figures=False)
    assert "Runs: 9 finished, 0 diverged, 9 missing, of the grid's 18." in claims
    assert "| none | incomplete: 3 missing |" in results
    assert json.loads((tmp_path / "results.json").read_text())["counts"] == {
        "finished": 9,
        "diverged": 0,
        "missing": 9,
    }


def test_holm_adjusts_over_every_tested_row():
    assert holm([0.01, 0.04, 0.03]) == pytest.approx([0.03, 0.06, 0.06])
    assert holm([0.5]) == [0.5]
    assert paired_interval([0.2]).p_value == 1.0
    grid = synthetic_grid(seeds=(0, 1, 2))  # one tested row: Holm changes nothing
    records = synthetic_records(grid, lambda p: (3.0, 3.0 + (0.1 + 0.01 * p.seed) * (p.variant == "none"), 3.0))
    test = verdicts(records, grid)[REMOVING, "1x16"]
    assert (test.holm_p_value, test.holm_verdict) == (pytest.approx(test.interval.p_value), "holds")


def test_a_bootstrap_fit_recovers_the_exponent_inside_its_interval():
    sizes = ("1x16", "1x32", "2x32", "2x64", "4x64")
    grid = synthetic_grid(sizes=sizes, variants=("standard", "unified"), rates=(1e-3,), seeds=(0, 1, 2, 3, 4))
    rng = np.random.default_rng(3)
    noise = {seed: rng.normal(0, 0.004, len(sizes)) for seed in grid.seeds}
    alphas = {"standard": 0.3, "unified": 0.45}

    def outcome(point):
        n = 2 * grid.size(point.size).non_embedding_parameters  # total parameters, as the claim counts them
        loss = (2.0 + 40.0 * n ** -alphas[point.variant]) * math.exp(noise[point.seed][sizes.index(point.size)])
        return loss, loss, loss

    fits = []
    scaling = verdicts(synthetic_records(grid, outcome), grid, fits)[SCALING, "all"]
    assert {(fit.variant, fit.counted) for fit in fits} == set(product(alphas, ("non-embedding", "total")))
    for fit in (fit for fit in fits if fit.counted == "total"):  # the claim's count: the one the losses follow
        low, high = fit.alpha_interval
        assert low < alphas[fit.variant] < high and high - low < 0.3 and abs(fit.alpha - alphas[fit.variant]) < 0.1
        assert fit.E_interval[0] < 2.0 < fit.E_interval[1] and fit.at_bound == []
    assert scaling.verdict == "holds" and scaling.interval.low > 0
    two_sizes = synthetic_grid(sizes=sizes[:3], variants=("standard", "unified"), rates=(1e-3,))
    untested = verdicts(synthetic_records(two_sizes, outcome), two_sizes)[SCALING, "-"]
    assert (untested.verdict, untested.runs) == ("not tested", "needs 4 sizes or more; the grid has 3")


def test_an_exponent_at_the_bound_of_the_search_leaves_the_scaling_claim_unresolved():
    """As in the CPU miniature, where embeddings made total N span 1.3x while the loss fell by a nat: unified's
    losses fall faster than α = 3 can follow, its fit ends on that bound, and the claim says so instead of judging."""
    sizes = ("1x16", "1x32", "2x32", "2x64", "4x64")
    grid = synthetic_grid(sizes=sizes, variants=("standard", "unified"), rates=(1e-3,), seeds=(0, 1, 2))

    def outcome(point):
        n = 2 * grid.size(point.size).non_embedding_parameters
        alpha, coefficient = (0.3, 40.0) if point.variant == "standard" else (5.0, 1e22)
        loss = (2.0 + coefficient * n**-alpha) * (1 + 1e-3 * point.seed)
        return loss, loss, loss

    fits = []
    scaling = verdicts(synthetic_records(grid, outcome), grid, fits)[SCALING, "all"]
    unified = next(fit for fit in fits if (fit.variant, fit.counted) == ("unified", "total"))
    assert unified.alpha == pytest.approx(3.0) and "α = 3" in unified.at_bound
    assert (scaling.verdict, scaling.holm_verdict) == ("unresolved", "unresolved")
    assert "unified's α = 3, a bound of the fit: α not measured" in scaling.runs


def test_sizes_budgets_and_shards(tmp_path):
    assert size_fields("4x128") == MODEL_SIZES["tiny"]
    assert size_fields("2x64") == dict(
        MODEL_SIZES["tiny"],
        hidden_size=64,
        intermediate_size=176,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    moe = size_fields("2x256", base="tiny-moe")
    assert (moe["num_experts"], moe["moe_intermediate_size"], moe["num_attention_heads"]) == (4, 256, 8)
    assert size_fields("0.12b") == MODEL_SIZES["0.12b"]
    flags = ["--tokens-per-parameter", "2", "--max-steps", "-1"]
    arguments = ablate.parse_arguments(study_argv(tmp_path, *flags), ablate.ABLATE_ARGUMENTS)
    grid = ablate.build_grid(*arguments)
    # 4 sequences of 32 tokens a step: ceil(2 N / 128) steps
    assert [size.max_steps for size in grid.sizes] == [math.ceil(2 * PARAMETERS[s] / 128) for s in SIZES]
    shares = [grid.shard(i, 4) for i in range(4)]
    assert [len(share) for share in shares] == [2, 2, 1, 1] and set().union(*shares) == set(grid.points())
    assert [grid.shard(i, 4) for i in range(4)] == shares  # the same split every time
    ladder = synthetic_grid(sizes=("1x16", "1x32"), rates=(1e-3, 3e-3), seeds=(0, 1, 2))
    for index in range(4):  # every shard holds an even share (within one run) of every size
        counts = [sum(p.size == size for p in ladder.shard(index, 4)) for size in ("1x16", "1x32")]
        assert counts == [3, 3]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--sizes", "2x48"], "--sizes: size '2x48': HIDDEN must be even and, above 32, a multiple of the head dim"),
        (["--sizes", "2x"], "--sizes: size '2x' is neither a preset (tiny, tiny-moe,"),
        (["--sizes", "1x16,0x32"], "--sizes: size '0x32' is neither a preset"),
        (["--config-overrides", '{"hidden_size": 8}'], "--config-overrides sets hidden_size, which --sizes sets"),
        (["--tokens-per-parameter", "20"], "--tokens-per-parameter sets each size's --max-steps: give one of the two"),
        (["--shard", "2/2"], "--shard '2/2': give I/N with 0 <= I < N"),
        (["--learning-rates", "1e-3,fast"], "--learning-rates must be comma-separated numbers >= 0"),
        (["--eval-every", "0"], "scalevec-ablate chooses each learning rate on held-out data"),
        (["--max-eval-tokens", "40"], "--max-eval-tokens 40: scalevec-ablate needs 2 held-out blocks"),
    ],
)
def test_bad_grids_are_refused_with_one_line(flags, message, tmp_path, capsys):
    assert ablate.main(study_argv(tmp_path / "refused", *flags)) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()


def test_a_grid_folder_holding_files_needs_resume(tmp_path, capsys):
    run = tmp_path / "grid" / "1x16" / f"standard-lr0.03-seed{SEED}"
    run.mkdir(parents=True)
    (run / "notes.txt").write_text("mine")
    assert ablate.main(study_argv(tmp_path / "grid")) == 1
    assert f"--output-dir {run} already holds files; pass --resume" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "grid").rglob("*")) == ["1x16", "notes.txt", run.name]


def test_an_older_results_json_gives_no_records_and_a_foreign_entry_is_refused(tmp_path):
    grid = synthetic_grid()
    older = {"size": "1x16", "variant": "none", "learning_rate": 1e-3, "seed": 0, "eval_loss": 3.0, "output_dir": "x"}
    (tmp_path / "results.json").write_text(json.dumps({"runs": [older]}))
    assert {r.status for r in ablate.study_records(grid, tmp_path)} == {MISSING}
    (tmp_path / "results.json").write_text(json.dumps({"runs": [{"size": "1x16", "status": "finished", "hue": 1}]}))
    with pytest.raises(ValueError, match="results.json: a run entry this version cannot read"):
        ablate.study_records(grid, tmp_path)


def test_active_parameters_count_the_experts_a_token_uses():
    """2 layers of 4 experts, 2 a token: half of each layer's expert tensors (weights and their scales) are idle."""
    moe = ScaleVecConfig(**size_fields("2x64", base="tiny-moe"))
    total, active = num_parameters(moe), active_parameters(moe)
    # a layer's experts: gate_up 4 x 128 x 64, down 4 x 64 x 64, and their scales (4 x (2 + 128 + 2 + 128 + 1 + 64))
    per_layer = 4 * 128 * 64 + 4 * 64 * 64 + 4 * (2 + 128 + 2 + 128 + 1 + 64)
    assert (moe.num_experts, moe.num_experts_per_tok, moe.num_hidden_layers) == (4, 2, 2)
    assert total - active == 2 * per_layer // 2
    dense = ScaleVecConfig(**size_fields("2x64"))
    assert num_parameters(dense) == active_parameters(dense) > 0
