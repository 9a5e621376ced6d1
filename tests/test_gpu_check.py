"""benchmarks/gpu_check.py, the one prepared GPU run: its CPU mode runs every section that a GPU run does, on tiny
models, and each section's failure, error or lack of time is recorded while the others run."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from ._helpers import SUBPROCESS_ENV

BENCHMARKS = Path(__file__).parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))
import gpu_check  # noqa: E402  (a script folder, not a package)

pytestmark = pytest.mark.slow  # it starts processes or trains end to end

MODES = ("eager", "compiled")


def test_cpu_mode_runs_every_section(tmp_path):
    command = [sys.executable, str(BENCHMARKS / "gpu_check.py"), str(tmp_path), "--cpu", "--budget-minutes", "15"]
    env = {**os.environ, **SUBPROCESS_ENV}
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, env=env)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    report = json.loads((tmp_path / "report.json").read_text())
    sections = report["sections"]
    planned = [name for name, _, _ in gpu_check.plan(gpu_check.CPU, tmp_path, tmp_path / "train.log")]
    assert list(sections) == planned and len(planned) == 10  # 6 smoke runs (no flash-attn on CPU), 2 x 2 others
    assert {name: section["status"] for name, section in sections.items()} == dict.fromkeys(sections, "ok")
    pipeline = {check["name"] for check in sections["smoke moe, sdpa, experts eager"]["checks"]}
    for target in ("qwen3_moe", "scalevec"):
        assert {f"{target}: float32 logits", f"{target}: float32 greedy tokens", f"{target}: bf16 logits"} <= pipeline
    for kind, stock in gpu_check.STOCK.items():
        throughput = sections[f"throughput {kind}"]
        rows = {(row["model"], row["mode"]): row for row in throughput["rows"]}
        assert set(rows) == {(name, mode) for name in (stock, "standard", "unified") for mode in MODES}
        for row in rows.values():
            assert row["tokens/s"] > 0 and row["memory GiB"] > row["step peak GiB"] > 0 and row["MFU %"] is None
            assert row["micro-batch"] == gpu_check.CPU.max_micro_batch
            assert row[f"time / {stock}"] == pytest.approx(row["step s"] / rows[stock, row["mode"]]["step s"])
        assert len(sections["decode " + kind]["rows"]) == 2
    assert sections["throughput dense"]["facts"]["graph breaks"] == 0  # each layer one graph, reused by all
    assert len(sections["throughput dense"]["goals"]) == 8
    markdown = (tmp_path / "report.md").read_text()
    assert "everything passed" in markdown and "## throughput moe: ok" in markdown


def test_each_section_is_recorded_whatever_it_does(tmp_path):
    report = gpu_check.Report(tmp_path, budget_s=60, environment={"device": "cpu"})
    report.run("raises", lambda: 1 / 0, estimate_s=1)
    report.run("passes", lambda: {"checks": [gpu_check.check("fine", True, "")]}, estimate_s=1)
    report.run("fails", lambda: {"checks": [gpu_check.check("wrong", False, "off by 2")]}, estimate_s=1)
    report.run("too long", lambda: pytest.fail("a section that does not fit must not run"), estimate_s=3600)
    sections = json.loads((tmp_path / "report.json").read_text())["sections"]
    statuses = {name: section["status"] for name, section in sections.items()}
    assert statuses == {"raises": "error", "passes": "ok", "fails": "failed", "too long": "skipped"}
    assert sections["raises"]["reason"] == "ZeroDivisionError: division by zero"
    assert "1 / 0" in sections["raises"]["traceback"]
    assert not report.ok
    markdown = (tmp_path / "report.md").read_text()
    assert "## raises: error" in markdown and "| wrong | False | off by 2 |" in markdown
