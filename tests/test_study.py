"""The study of `scalevec-ablate` (sizes, learning rates, scaling fit, claims, shards): one tiny grid of 2 sizes x 2
variants x 2 learning rates x 1 seed, trained by two shard processes at once over one folder, then reported by a
third call that must train nothing; every figure of its report is checked against what the runs recorded. Also the
scaling fits on synthetic data and the refusals of bad grids."""

import contextlib
import io
import json
import math
import os
import re
import subprocess
import sys
from itertools import product
from types import SimpleNamespace

import numpy as np
import pytest

from scalevec.train import ablate
from scalevec.train.presets import MODEL_SIZES, size_fields
from scalevec.train.study.claims import claim_verdicts, claims_markdown
from scalevec.train.study.records import RunRecord
from scalevec.train.study.scaling import POWER_LAW, SATURATING, fit_scaling
from scalevec.train.study.summary import best_runs

from ._helpers import SUBPROCESS_ENV, log_history, train_argv

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
SIZES, VARIANTS, RATES, SEED = ("1x16", "1x32"), ("none", "standard"), (0.01, 0.03), 5
GRID = {(size, variant, rate) for size, variant, rate in product(SIZES, VARIANTS, RATES)}
TRAINED = re.compile(r"^\[ablation\] \d+/\d+ (\S+) (\S+) lr (\S+) seed (\d+):", re.MULTILINE)
# The non-embedding parameters of one layer of hidden H, one head, SwiGLU width W: q, k, v, o (4 H^2) and 3 H W.
PARAMETERS = {"1x16": 4 * 16 * 16 + 3 * 16 * 48, "1x32": 4 * 32 * 32 + 3 * 32 * 96}


def study_argv(root, *extra: str) -> list[str]:
    grid = ["--sizes", ",".join(SIZES), "--variants", ",".join(VARIANTS), "--seeds", str(SEED)]
    grid += ["--learning-rates", ",".join(map(str, RATES))]
    flags = ("--config-overrides", "{}", "--max-eval-documents", "2", "--scale-stats", "false")
    return [*grid, *train_argv(root, *flags, *extra, steps=6)]


def final_eval_loss(size: str, variant: str, rate: float, root) -> float:
    run = root / size / f"{variant}-lr{rate:g}-seed{SEED}"
    return [entry["eval_loss"] for entry in log_history(run) if "eval_loss" in entry][-1]


def state_times(root) -> dict:
    return {path: path.stat().st_mtime_ns for path in root.glob("*/*/trainer_state.json")}


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
    return SimpleNamespace(
        root=root,
        shard_outputs=outputs,
        trained=[{(s, v, float(lr)) for s, v, lr, _ in TRAINED.findall(output)} for output in outputs],
        report=report,
        times=(before, state_times(root)),
        results=json.loads((root / "results.json").read_text()),
        evals={key: final_eval_loss(*key, root) for key in GRID},
    )


def test_two_shards_train_disjoint_halves_whose_union_is_the_grid(study):
    first, second = study.trained
    assert len(first) == len(second) == 4 and not first & second and first | second == GRID
    for index, output in enumerate(study.shard_outputs):
        assert "grid: 2 sizes x 2 variants x 2 learning rates x 1 seed = 8 runs" in output
        assert f"shard {index}/2: 4 of the 8 runs (shares of 4, 4); finished already: 0; to train now: 4" in output
    assert "1x16: 1 layer, hidden 16, 1 head (1 key-value), SwiGLU 48; N = 3,328 non-embedding" in output
    assert "6 steps x 128 tokens = 768 tokens a run" in output
    assert not list(study.root.glob("**/*.tmp*"))  # the shards wrote the shared files without leaving pieces


def test_a_report_call_after_the_shards_trains_nothing(study):
    assert "all 8 runs; finished already: 8; to train now: 0" in study.report
    assert "[ablation] trained 0 runs; 8 of the grid's 8 have finished" in study.report
    before, after = study.times
    assert len(before) == 8 and after == before
    assert "# scalevec-ablate: 8 of 8 runs finished" in study.report


def test_each_variant_is_compared_at_its_best_learning_rate(study):
    summary = {(s["size"], s["variant"]): s for s in study.results["summary"]}
    assert set(summary) == set(product(SIZES, VARIANTS))
    best = {}
    for (size, variant), entry in summary.items():
        best[size, variant] = min(RATES, key=lambda rate: study.evals[size, variant, rate])
        assert entry["best_learning_rate"] == best[size, variant]
        assert entry["eval_loss_mean"] == pytest.approx(study.evals[size, variant, best[size, variant]], abs=1e-12)
        losses = {r["learning_rate"]: r["eval_loss_mean"] for r in entry["learning_rates"]}
        assert losses == pytest.approx({rate: study.evals[size, variant, rate] for rate in RATES}, abs=1e-12)
    for size in SIZES:  # none minus standard, each at its own best learning rate, in the one seed
        none, standard = (
            study.evals[size, "none", best[size, "none"]],
            study.evals[size, "standard", best[size, "standard"]],
        )
        entry = summary[size, "none"]
        assert (entry["reference"], entry["reference_learning_rate"]) == ("standard", best[size, "standard"])
        assert entry["differences"] == pytest.approx({str(SEED): none - standard}, abs=1e-12)
    table = (study.root / "results.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| none | "))
    assert row.startswith(f"| none | {best['1x16', 'none']:g} | {summary['1x16', 'none']['eval_loss_mean']:.4f} |")


def test_a_scaling_fit_per_variant_and_its_figure(study):
    sizes = {size["name"]: size for size in study.results["grid"]["sizes"]}
    assert {name: size["non_embedding_parameters"] for name, size in sizes.items()} == PARAMETERS
    summary = {(s["size"], s["variant"]): s["eval_loss_mean"] for s in study.results["summary"]}
    for variant in VARIANTS:
        fit = study.results["scaling"][variant]
        assert fit["form"] == POWER_LAW and fit["E"] is None  # two sizes: the plain power law
        small, large = summary["1x16", variant], summary["1x32", variant]
        slope = math.log(large / small) / math.log(PARAMETERS["1x32"] / PARAMETERS["1x16"])
        assert fit["alpha"] == pytest.approx(-slope, rel=1e-9)
        assert fit["A"] * PARAMETERS["1x16"] ** -fit["alpha"] == pytest.approx(small, rel=1e-9)
    assert (study.root / "scaling.png").read_bytes().startswith(PNG_SIGNATURE)
    assert (study.root / "loss_curves.png").read_bytes().startswith(PNG_SIGNATURE)


def test_claims_have_verdicts_from_the_runs_own_numbers(study):
    claims = (study.root / "claims.md").read_text()
    assert claims in study.report and "holds** at a size when Δ has the predicted sign in every seed" in claims
    summary = {(s["size"], s["variant"]): s for s in study.results["summary"]}
    for size in SIZES:
        difference = summary[size, "none"]["differences"][str(SEED)]
        verdict = "holds" if difference > 0 else "does not hold"
        rate, reference_rate = (summary[size, v]["best_learning_rate"] for v in VARIANTS)
        row = next(
            line for line in claims.splitlines() if line.startswith(f"| Removing the scale vectors hurts | {size} |")
        )
        assert f"| none (lr {rate:g}) − standard (lr {reference_rate:g}) | Δ > 0 | {SEED}: {difference:+.4f} |" in row
        assert row.endswith(f"| {verdict} |")
    for claim in ("Branch-specific norm scales help", "Unified scales more favourably than standard"):
        row = next(line for line in claims.splitlines() if line.startswith(f"| {claim} |"))
        assert row.endswith("| not tested by this grid |")
    verdicts = {(c["claim"], c["size"]): c["verdict"] for c in study.results["claims"]}
    assert verdicts["Removing the scale vectors hurts", "1x16"] in ("holds", "does not hold")


def test_verdicts_follow_every_seed():
    """Synthetic runs at two sizes and two seeds: a claim holds only where every seed agrees."""
    losses = {  # (size, variant) -> final eval loss in seeds 0 and 1
        ("a", "standard"): (4.0, 4.1),
        ("a", "none"): (4.05, 4.12),
        ("a", "branch"): (3.95, 3.98),
        ("a", "unified"): (3.9, 4.0),
        ("b", "standard"): (3.5, 3.6),
        ("b", "none"): (3.49, 3.7),
        ("b", "branch"): (3.45, 3.55),
        ("b", "unified"): (3.3, 3.35),
    }
    parameters = {"a": 1000, "b": 8000}
    records = [
        RunRecord(size, variant, 1e-3, seed, parameters[size], loss, loss, 0, 0.0, 0, "")
        for (size, variant), pair in losses.items()
        for seed, loss in enumerate(pair)
    ]
    tests = {(t.claim, t.size): t for t in claim_verdicts(best_runs(records), ["a", "b"])}
    removing = "Removing the scale vectors hurts"
    assert tests[removing, "a"].verdict == "holds"
    assert tests[removing, "b"].differences == pytest.approx({0: -0.01, 1: 0.1})
    assert (tests[removing, "b"].held, tests[removing, "b"].verdict) == ([1], "does not hold")
    assert tests["Branch-specific norm scales help", "a"].verdict == "holds"
    lowest = "Unified has the lowest terminal loss of the strategies"
    assert tests[lowest, "a"].differences == pytest.approx({0: 3.9 - 3.95, 1: 4.0 - 3.98})
    assert (tests[lowest, "a"].verdict, tests[lowest, "b"].verdict) == ("does not hold", "holds")
    scaling = tests["Unified scales more favourably than standard", "all"]
    slope = math.log(parameters["b"] / parameters["a"])
    alphas = {
        v: [-math.log(losses["b", v][s] / losses["a", v][s]) / slope for s in (0, 1)] for v in ("unified", "standard")
    }
    assert scaling.differences == pytest.approx({s: alphas["unified"][s] - alphas["standard"][s] for s in (0, 1)})
    assert scaling.verdict == "holds"
    assert tests["Decaying output-role scales hurts", "-"].verdict == "not tested by this grid"
    table = claims_markdown(list(tests.values()), "synthetic")
    assert "| Δ > 0 | 0: -0.0100, 1: +0.1000 | 1 of 2 (1) | does not hold |" in table


def test_scaling_fits_recover_known_laws():
    parameters = np.geomspace(1e4, 1e7, 6)
    saturating = fit_scaling(list(parameters), list(2.0 + 50.0 * parameters**-0.3))
    assert saturating.form == SATURATING
    assert (saturating.E, saturating.A, saturating.alpha) == pytest.approx((2.0, 50.0, 0.3), rel=1e-3)
    assert saturating.rms < 1e-4
    power = fit_scaling(list(parameters[:3]), list(20.0 * parameters[:3] ** -0.1))  # 3 sizes: a power law
    assert (power.form, power.E) == (POWER_LAW, None)
    assert (power.A, power.alpha) == pytest.approx((20.0, 0.1), rel=1e-9)
    assert fit_scaling([1e4, 1e4], [3.0, 3.1]) is None  # one size


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
    shares = [grid.shard(i, 3) for i in range(3)]
    assert [len(share) for share in shares] == [3, 3, 2] and set().union(*shares) == set(grid.points())
    assert [grid.shard(i, 3) for i in range(3)] == shares  # the same split every time


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
    ],
)
def test_bad_grids_are_refused_with_one_line(flags, message, tmp_path, capsys):
    assert ablate.main(study_argv(tmp_path / "refused", *flags)) == 1
    assert message in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()


def test_a_grid_folder_holding_files_needs_resume(tmp_path, capsys):
    run = tmp_path / "grid" / "1x32" / f"standard-lr0.03-seed{SEED}"
    run.mkdir(parents=True)
    (run / "notes.txt").write_text("mine")
    assert ablate.main(study_argv(tmp_path / "grid")) == 1
    assert f"--output-dir {run} already holds files; pass --resume" in capsys.readouterr().err
    assert sorted(p.name for p in (tmp_path / "grid").rglob("*")) == ["1x32", "notes.txt", run.name]
