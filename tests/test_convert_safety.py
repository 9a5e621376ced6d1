"""The user's data is safe: refusals happen before anything is written, broken sources are named precisely, and
neither an exception, Ctrl-C nor SIGKILL leaves a partial output or a staging folder behind."""

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from scalevec import ScaleVecForCausalLM
from scalevec.convert import (
    OutputOptions,
    TargetError,
    VerificationError,
    export_checkpoint,
    fold_checkpoint,
)
from scalevec.convert.cli import main

from ._helpers import (
    logits,
    random_ids,
    saved_scalevec,
    tiny_config,
    tiny_moe_config,
)

pytestmark = pytest.mark.slow  # it starts processes or trains end to end


def names_in(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


@pytest.mark.parametrize(
    "config, target, reasons",
    [
        (tiny_config(output_norm=True), "llama", ["output_norm=True"]),
        (tiny_config(qk_norm=True), "llama", ["qk_norm=True", "use qwen3"]),
        (tiny_config(), "qwen3", ["qk_norm=False"]),
        (tiny_config(), "mixtral", ["dense model"]),
        (tiny_moe_config(), "qwen3", ["mixture-of-experts"]),
        (tiny_moe_config(shared_expert_intermediate_size=8, qk_norm=True), "qwen3_moe", ["shared expert"]),
        (tiny_moe_config(mlp_only_layers=[1]), "mixtral", ["dense layers among the MoE layers"]),
        (tiny_moe_config(norm_topk_prob=False), "mixtral", ["norm_topk_prob=False"]),
        (tiny_moe_config(output_norm=True, qk_norm=True), "mixtral", ["output_norm=True", "qk_norm=True"]),
    ],
)
def test_inadmissible_targets_are_refused_before_anything_is_written(tmp_path, capsys, config, target, reasons):
    saved_scalevec(tmp_path / "src", config)
    with pytest.raises(TargetError) as error:
        export_checkpoint(tmp_path / "src", tmp_path / "out", target)
    for reason in [*reasons, "`--to scalevec` (remote code) always works"]:
        assert reason in str(error.value)
    assert main(["export", str(tmp_path / "src"), str(tmp_path / "out"), "--to", target]) == 1
    assert "always works" in capsys.readouterr().err
    assert names_in(tmp_path) == ["src"]


def test_an_existing_destination_is_refused_unless_overwrite(tmp_path):
    saved_scalevec(tmp_path / "src", tiny_config())
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "keep.txt").write_text("mine")
    with pytest.raises(TargetError, match="already exists; pass --overwrite"):
        fold_checkpoint(tmp_path / "src", tmp_path / "out")
    assert names_in(tmp_path / "out") == ["keep.txt"]
    fold_checkpoint(tmp_path / "src", tmp_path / "out", OutputOptions(overwrite=True))
    assert "keep.txt" not in names_in(tmp_path / "out") and "model.safetensors" in names_in(tmp_path / "out")
    assert names_in(tmp_path) == ["out", "src"]


def test_a_checkpoint_can_be_folded_in_place(tmp_path):
    model = saved_scalevec(tmp_path / "model", tiny_moe_config(qk_norm=True))
    fold_checkpoint(tmp_path / "model", tmp_path / "model", OutputOptions(overwrite=True))
    folded = ScaleVecForCausalLM.from_pretrained(tmp_path / "model")
    assert folded.config.folded
    ids = random_ids(model.config)
    torch.testing.assert_close(logits(folded, ids), logits(model, ids), atol=1e-4, rtol=0)
    assert names_in(tmp_path) == ["model"]


@pytest.fixture
def sharded_source(tmp_path) -> Path:
    torch.manual_seed(0)
    ScaleVecForCausalLM(tiny_config()).save_pretrained(tmp_path / "src", max_shard_size="20KB")
    return tmp_path / "src"


def _export_fails(source: Path, capsys, *messages: str) -> None:
    destination = source.parent / "out"
    assert main(["export", str(source), str(destination), "--to", "llama"]) == 1
    err = capsys.readouterr().err
    for message in messages:
        assert message in err, err
    assert not destination.exists()
    assert [p for p in source.parent.iterdir() if "scalevec-convert" in p.name] == []


def test_a_truncated_shard_is_named(sharded_source, capsys):
    shard = sorted(sharded_source.glob("model-*.safetensors"))[1]
    shard.write_bytes(shard.read_bytes()[:-100])
    _export_fails(sharded_source, capsys, str(shard), "truncated or corrupted")


def test_a_corrupted_shard_header_is_named(sharded_source, capsys):
    shard = sorted(sharded_source.glob("model-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[8:12] = b"\x00\xff\x00\xff"
    shard.write_bytes(bytes(data))
    _export_fails(sharded_source, capsys, str(shard), "not a readable safetensors file")


def test_a_missing_shard_is_named(sharded_source, capsys):
    shard = sorted(sharded_source.glob("model-*.safetensors"))[-1]
    shard.unlink()
    _export_fails(sharded_source, capsys, f"shard {shard}", "does not exist")


def _edit_single_file(source: Path, edit) -> None:
    tensors = load_file(source / "model.safetensors")
    edit(tensors)
    save_file(tensors, source / "model.safetensors", metadata={"format": "pt"})


def test_missing_unexpected_and_misshapen_tensors_are_named(tmp_path, capsys):
    saved_scalevec(tmp_path / "src", tiny_config(scale_preset="standard"))
    _edit_single_file(tmp_path / "src", lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    _export_fails(tmp_path / "src", capsys, "lacks tensors", "model.layers.1.mlp.up_proj.weight")

    saved_scalevec(tmp_path / "src2", tiny_config(scale_preset="standard"))
    _edit_single_file(tmp_path / "src2", lambda t: t.update({"model.layers.0.extra.in_scale.weight": torch.ones(3)}))
    _export_fails(tmp_path / "src2", capsys, "does not", "model.layers.0.extra.in_scale.weight")

    saved_scalevec(tmp_path / "src3", tiny_config(scale_preset="standard"))
    config = json.loads((tmp_path / "src3" / "config.json").read_text())
    (tmp_path / "src3" / "config.json").write_text(json.dumps({**config, "intermediate_size": 40}))
    _export_fails(tmp_path / "src3", capsys, "model.layers.0.mlp.gate_proj.weight", "shape [48, 32]", "needs [40, 32]")


def test_broken_configs_and_unknown_architectures_are_named(tmp_path, capsys):
    saved_scalevec(tmp_path / "src", tiny_config())
    (tmp_path / "src" / "config.json").write_text("{not json")
    _export_fails(tmp_path / "src", capsys, "config.json is not readable JSON")
    saved_scalevec(tmp_path / "src2", tiny_config())
    (tmp_path / "src2" / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    _export_fails(tmp_path / "src2", capsys, "unsupported model_type 'gpt2'")


def test_a_truncated_bin_is_named(tmp_path, capsys):
    model = saved_scalevec(tmp_path / "src", tiny_config())
    (tmp_path / "src" / "model.safetensors").unlink()
    torch.save(model.state_dict(), tmp_path / "src" / "pytorch_model.bin")
    data = (tmp_path / "src" / "pytorch_model.bin").read_bytes()
    (tmp_path / "src" / "pytorch_model.bin").write_bytes(data[: len(data) // 2])
    _export_fails(tmp_path / "src", capsys, "pytorch_model.bin is not a readable PyTorch state dict")


def test_a_failed_verification_writes_nothing(tmp_path):
    saved_scalevec(tmp_path / "src", tiny_config())
    with pytest.raises(VerificationError, match="EXCEEDS"):
        fold_checkpoint(tmp_path / "src", tmp_path / "out", OutputOptions(dtype="bfloat16", atol=1e-9))
    assert names_in(tmp_path) == ["src"]


def test_the_before_commit_hook_adds_files_and_its_failure_writes_nothing(tmp_path):
    saved_scalevec(tmp_path / "src", tiny_config())

    def card(folder: Path, result) -> None:
        assert result.verification.passed and folder.name.endswith(".tmp")
        (folder / "README.md").write_text(f"# {result.target}\n")

    fold_checkpoint(tmp_path / "src", tmp_path / "out", OutputOptions(before_commit=card))
    assert (tmp_path / "out" / "README.md").read_text() == "# scalevec\n"

    def broken(folder: Path, result) -> None:
        raise RuntimeError("card failed")

    with pytest.raises(RuntimeError, match="card failed"):
        fold_checkpoint(tmp_path / "src", tmp_path / "out2", OutputOptions(before_commit=broken))
    assert names_in(tmp_path) == ["out", "src"]


def test_leftovers_of_a_conversion_killed_with_its_watchdog_are_cleaned_up(tmp_path):
    saved_scalevec(tmp_path / "src", tiny_config())
    stale = ".other.scalevec-convert-1-dead"
    (tmp_path / f"{stale}.tmp").mkdir()
    (tmp_path / f"{stale}.old").mkdir()
    (tmp_path / f"{stale}.old" / "kept.txt").write_text("the old destination")
    (tmp_path / f"{stale}.lock").touch()
    alive = ".busy.scalevec-convert-2-live"
    (tmp_path / f"{alive}.tmp").mkdir()
    with open(tmp_path / f"{alive}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        fold_checkpoint(tmp_path / "src", tmp_path / "out")
    # The dead conversion was undone (the destination it was replacing is back); the live one is left alone.
    assert names_in(tmp_path) == [f"{alive}.lock", f"{alive}.tmp", "other", "out", "src"]
    assert (tmp_path / "other" / "kept.txt").read_text() == "the old destination"


def _medium_source(path: Path) -> None:
    config = tiny_config(vocab_size=2048, hidden_size=256, intermediate_size=512, num_hidden_layers=4)
    saved_scalevec(path, config)


def _start_export(source: Path, destination: Path) -> subprocess.Popen:
    command = [sys.executable, "-m", "scalevec.convert.cli", "export", str(source), str(destination), "--to", "llama"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _wait_for_staged_shard(parent: Path, process: subprocess.Popen, timeout: float = 120) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        shards = list(parent.glob(".out.scalevec-convert-*.tmp/model*.safetensors"))
        if shards:
            return shards[0].parent
        assert process.poll() is None, process.communicate()
        time.sleep(0.005)
    raise AssertionError("the export never started writing")


def test_sigkill_mid_export_leaves_no_destination_and_the_watchdog_removes_the_staging_folder(tmp_path):
    _medium_source(tmp_path / "src")
    process = _start_export(tmp_path / "src", tmp_path / "out")
    staging = _wait_for_staged_shard(tmp_path, process)
    process.kill()
    process.communicate()
    assert process.returncode == -signal.SIGKILL
    assert not (tmp_path / "out").exists()
    deadline = time.monotonic() + 30
    while names_in(tmp_path) != ["src"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not staging.exists()
    assert names_in(tmp_path) == ["src"]


def test_ctrl_c_mid_export_leaves_nothing(tmp_path):
    _medium_source(tmp_path / "src")
    process = _start_export(tmp_path / "src", tmp_path / "out")
    _wait_for_staged_shard(tmp_path, process)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    assert "interrupted; nothing was written" in err
    assert names_in(tmp_path) == ["src"]
