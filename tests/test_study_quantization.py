"""`scalevec-ablate --quantize`: each finished run's final model evaluated on the report half unquantized and with
int8 / int4 weights, recorded, and judged as the claim "unified quantizes as well as standard" (non-inferiority with
a stated margin, `--quantization-margin`). One tiny grid end to end; the verdicts on synthetic records."""

import json

import pytest

from scalevec.train.study.claims import QUANTIZATION_MARGIN, QUANTIZES, claim_verdicts, claims_markdown
from scalevec.train.study.records import read_results
from scalevec.train.study.summary import summarise

from .test_study import run_in_process, synthetic_grid, synthetic_records, train_argv

pytest.importorskip("torchao")


@pytest.mark.slow
def test_each_run_records_its_quantized_losses_and_the_claim_gets_a_row(tmp_path):
    root = tmp_path / "grid"
    grid = ["--sizes", "1x32", "--variants", "standard,unified", "--seeds", "3", "--learning-rates", "0.01"]
    flags = ("--config-overrides", "{}", "--max-eval-documents", "4", "--scale-stats", "false")
    output = run_in_process([*grid, "--quantize", "int8,int4", *train_argv(root, *flags, steps=6)])
    assert "of the grid's 2: 2 finished, 0 diverged, 0 missing" in output
    _, records = read_results(root / "results.json")
    for record in records:
        folder = root / "1x32" / f"{record.variant}-lr0.01-seed3"
        losses = json.loads((folder / "quantized.json").read_text())
        assert record.quantized_report_loss == losses and set(losses) == {"none", "int8", "int4"}
        # the same blocks and evaluation code as the run's own report half, unquantized
        assert losses["none"] == pytest.approx(record.eval_report_loss, abs=1e-5)
        assert losses["int4"] != losses["none"] and abs(losses["int8"] - losses["none"]) < 0.05
    claims = (root / "claims.md").read_text()
    for scheme in ("int8", "int4"):
        statement = f"{QUANTIZES} {QUANTIZATION_MARGIN:g} nats of standard ({scheme} weights)"
        assert f"| {statement} | 1x32 | {scheme} loss increase of unified (lr 0.01)" in claims
    increases = {r.variant: r.quantized_report_loss["int4"] - r.quantized_report_loss["none"] for r in records}
    assert f"3: {increases['unified'] - increases['standard'] - QUANTIZATION_MARGIN:+.4f}" in claims
    assert "a non-inferiority test" in claims


@pytest.mark.parametrize(
    "extra, verdict",
    [
        ([0.0, 0.002, -0.001, 0.001], "holds"),  # within the margin in every seed, tightly
        ([0.05, 0.06, 0.055, 0.05], "contradicted"),  # unified loses 0.05 more: beyond the margin
        ([0.0, 0.03, -0.02, 0.01], "unresolved"),
    ],
)
def test_the_quantization_row_is_a_non_inferiority_test(extra, verdict):
    grid = synthetic_grid(variants=("standard", "unified"))
    records = synthetic_records(grid, lambda point: (3.0, 3.2, 3.0))
    for r in records:
        increase = 0.1 + (extra[r.seed] if r.variant == "unified" else 0.0)
        r.quantized_report_loss = {"none": 3.2, "int4": 3.2 + increase}
    tests = claim_verdicts(summarise(records, grid), [], ["1x16"])
    row = next(t for t in tests if t.claim == f"{QUANTIZES} 0.01 nats of standard (int4 weights)")
    assert row.verdict == verdict and row.prediction == "Δ < 0" and row.family == "non-inferiority"
    assert row.differences == pytest.approx({seed: e - QUANTIZATION_MARGIN for seed, e in enumerate(extra)})
    text = claims_markdown(tests, "synthetic", [])
    assert "(unified's increase is within 0.01 nats of standard's)" in text
    assert "no more than" not in text and "as well as" not in text


def test_without_quantize_there_is_no_quantization_row():
    grid = synthetic_grid(variants=("standard", "unified"))
    tests = claim_verdicts(summarise(synthetic_records(grid, lambda p: (3.0, 3.2, 3.0)), grid), [], ["1x16"])
    assert not any(t.claim.startswith(QUANTIZES) for t in tests)
    assert "non-inferiority" not in claims_markdown(tests, "synthetic", [])
