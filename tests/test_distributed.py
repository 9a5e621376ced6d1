"""Multi-process training on CPU (gloo, 2 processes): FSDP2 with AdamW and Muon against one process, checkpoints of
the sharded run folded and exported, and `scalevec-train` with Muon under DDP, resumed."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from scalevec import ScaleVecForCausalLM
from scalevec.convert import OutputOptions, export_checkpoint
from scalevec.train.optim import DecayConfig, parameter_groups

from ._helpers import SUBPROCESS_ENV, log_history, logged_losses, random_ids, run_torchrun, train_argv

pytestmark = pytest.mark.slow  # it starts processes or trains end to end

ROOT = Path(__file__).parents[1]
CASES = ["dense-adamw", "dense-muon", "moe-adamw", "moe-muon"]
STOCK_CLASSES = {"llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM"}


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory) -> tuple[dict, Path]:
    """benchmarks/fsdp_check.py: 2 FSDP2 processes and one plain process per case, 3 steps each."""
    folder = tmp_path_factory.mktemp("fsdp")
    command = [sys.executable, str(ROOT / "benchmarks" / "fsdp_check.py"), "--nproc", "2", "--steps", "3"]
    command += ["--save-dir", str(folder), "--json", str(folder / "report.json")]
    result = subprocess.run(command, capture_output=True, text=True, timeout=300, env={**os.environ, **SUBPROCESS_ENV})
    assert result.returncode == 0, result.stdout + result.stderr[-3000:]
    return json.loads((folder / "report.json").read_text()), folder


@pytest.mark.parametrize("case", CASES)
def test_fsdp2_matches_one_process(case, fsdp_run):
    row = fsdp_run[0][case]
    assert row["max_loss_diff"] <= 1e-5 and row["max_param_diff"] <= 1e-5
    assert row["losses"] == pytest.approx(row["reference_losses"], abs=1e-5)
    assert row["losses"][-1] < row["losses"][0]  # it trained: the comparison means something


@pytest.mark.parametrize("case", ["dense-muon", "moe-muon"])
def test_muon_gathers_each_matrix_once(case, fsdp_run):
    """One all-gather and one scatter per Muon matrix (an expert stack as one), where Newton–Schulz on the DTensor
    shards redistributes inside its matmuls."""
    collectives = fsdp_run[0][case]["collectives"]
    matrices = collectives["muon_matrices"]
    by_kind = {"c10d_functional.all_gather_into_tensor": matrices, "c10d.scatter_": matrices}
    assert collectives["gathered_step_by_kind"] == by_kind
    assert collectives["dtensor_newton_schulz"] > 4 * collectives["gathered_step"]


@pytest.mark.parametrize(("case", "target"), [("dense-muon", "llama"), ("moe-muon", "mixtral")])
def test_sharded_checkpoint_loads_unsharded_and_exports(case, target, fsdp_run, tmp_path):
    folder = fsdp_run[1] / case
    sharded = ScaleVecForCausalLM.from_pretrained(folder / "sharded").eval()
    reference = ScaleVecForCausalLM.from_pretrained(folder / "reference").eval()
    reference_state = reference.state_dict()
    for name, tensor in sharded.state_dict().items():
        torch.testing.assert_close(tensor, reference_state[name], rtol=0, atol=1e-5, msg=name)
    ids = random_ids(sharded.config, batch=2, length=12)
    with torch.no_grad():
        expected = sharded(ids).logits
    for to in (target, "scalevec"):
        export_checkpoint(folder / "sharded", tmp_path / to, to, OutputOptions())
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path / to).eval()
        assert type(loaded).__name__ == STOCK_CLASSES.get(to, "ScaleVecForCausalLM")
        with torch.no_grad():
            torch.testing.assert_close(loaded(ids).logits, expected, rtol=0, atol=1e-4, msg=to)


def test_ddp_muon_through_the_cli_trains_and_resumes(tmp_path):
    """`scalevec-train --optim muon` under torchrun (2 gloo processes, DDP): 6 steps checkpointing at 3, then a run
    holding only checkpoint-3 resumed to step 6 gives the same losses."""
    flags = ["--optim", "muon", "--eval-every", "0", "--scale-stats", "false", "--max-documents", "200"]
    flags += ["--per-device-train-batch-size", "2", "--save-strategy", "steps", "--save-steps", "3"]
    flags += ["--learning-rate", "1e-2", "--lr-scheduler-type", "constant", "--warmup-steps", "0"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    result = run_torchrun("-m", "scalevec.train.cli", *train_argv(straight, *flags, steps=6))
    assert result.returncode == 0, result.stderr[-3000:]
    shutil.copytree(straight / "checkpoint-3", resumed / "checkpoint-3")
    result = run_torchrun("-m", "scalevec.train.cli", *train_argv(resumed, *flags, "--resume", "true", steps=6))
    assert result.returncode == 0, result.stderr[-3000:]

    losses = logged_losses(straight)
    assert len(losses) == 6 and losses[-1] < losses[0]
    assert [e["step"] for e in log_history(resumed) if "loss" in e] == list(range(1, 7))
    assert logged_losses(resumed) == pytest.approx(losses, abs=1e-5)
    tokens = [e["num_input_tokens_seen"] for e in log_history(straight) if "loss" in e]
    assert tokens == [128 * step for step in range(1, 7)]  # 2 blocks of 32 tokens on each of 2 ranks

    # DDP, not FSDP: each rank held whole matrices, so the Muon momenta saved are full-size plain tensors.
    model = ScaleVecForCausalLM.from_pretrained(straight)
    muon_shapes = sorted(
        tuple(p.shape) for group in parameter_groups(model, DecayConfig()) if group["muon"] for p in group["params"]
    )
    state = torch.load(straight / "checkpoint-6" / "optimizer.pt", weights_only=False)["state"].values()
    momenta = [s["momentum_buffer"] for s in state if "momentum_buffer" in s]
    assert not any(isinstance(m, DTensor) for m in momenta)
    assert sorted(tuple(m.shape) for m in momenta) == muon_shapes
