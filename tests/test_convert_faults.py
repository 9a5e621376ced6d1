"""The converter's outputs survive faults a user can cause: a full or read-only disk ends in one line naming the
destination with nothing left behind, and two conversions racing for one destination never replace each other."""

import subprocess
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from scalevec.convert import TargetError, fold_checkpoint
from scalevec.convert import staging as staging_module
from scalevec.convert.cli import main

from ._helpers import mounted_tmpfs, record_fsyncs, run_python, saved_scalevec, tiny_config
from .test_convert_safety import _medium_source, _start_export, names_in

pytestmark = pytest.mark.slow  # it starts processes or trains end to end


@pytest.fixture
def tmpfs(tmp_path):
    """A 1 MiB tmpfs: the medium source's export (several MB) does not fit."""
    with mounted_tmpfs(tmp_path / "disk", "1m") as mount_point:
        yield mount_point


def convert_errors(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr
    return [line for line in stderr.splitlines() if line.startswith("scalevec-convert:")]


def test_a_full_disk_names_the_destination_and_leaves_nothing(tmp_path, tmpfs, capsys):
    _medium_source(tmp_path / "src")
    destination = tmpfs / "out"
    assert main(["export", str(tmp_path / "src"), str(destination), "--to", "llama", "-q"]) == 1
    assert convert_errors(capsys.readouterr().err) == [
        f"scalevec-convert: error: cannot write {destination}: no space left on the device; nothing was written"
    ]
    assert names_in(tmpfs) == []


def test_a_read_only_destination_is_named(tmp_path, tmpfs, capsys):
    saved_scalevec(tmp_path / "src", tiny_config())
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    destination = tmpfs / "out"
    assert main(["fold", str(tmp_path / "src"), str(destination), "-q"]) == 1
    assert convert_errors(capsys.readouterr().err) == [
        f"scalevec-convert: error: cannot write {destination}: read-only file system; nothing was written"
    ]


def test_an_output_is_flushed_to_disk_before_it_is_reported(tmp_path, monkeypatch):
    """Every file, then the parent's entry once renamed: after a power loss the destination is whole or absent."""
    saved_scalevec(tmp_path / "src", tiny_config())
    flushed = record_fsyncs(monkeypatch)
    fold_checkpoint(tmp_path / "src", tmp_path / "out")
    staged_files = {Path(path).name for path in flushed if ".scalevec-convert-" in path}
    assert set(names_in(tmp_path / "out")) <= staged_files
    assert flushed[-1] == str(tmp_path)  # the rename itself, last


def test_a_destination_appearing_during_the_commit_is_never_replaced(tmp_path, monkeypatch):
    """Another process creates the destination between the commit's check and its rename (here: while the
    staging folder is being flushed); the commit fails and leaves that output as it is."""
    saved_scalevec(tmp_path / "src", tiny_config())
    flush = staging_module.finish_tree

    def flush_then_race(folder):
        flush(folder)
        (tmp_path / "out").mkdir()  # an empty folder: a plain rename would replace it silently
        (tmp_path / "out" / "theirs.txt").write_text("the other output")

    monkeypatch.setattr(staging_module, "finish_tree", flush_then_race)
    with pytest.raises(TargetError, match="appeared while this output was being written"):
        fold_checkpoint(tmp_path / "src", tmp_path / "out")
    assert names_in(tmp_path / "out") == ["theirs.txt"]
    assert names_in(tmp_path) == ["out", "src"]


def test_two_exports_racing_for_one_destination(tmp_path):
    """Two real processes, no --overwrite: exactly one writes the destination, the other fails cleanly, and the
    written output is whole (every tensor readable)."""
    _medium_source(tmp_path / "src")
    racers = [_start_export(tmp_path / "src", tmp_path / "out") for _ in range(2)]
    results = [(racer.wait(timeout=300), racer.communicate()[1]) for racer in racers]
    assert sorted(code for code, _ in results) == [0, 1], results
    (loser_errors,) = [convert_errors(err) for code, err in results if code == 1]
    assert len(loser_errors) == 1
    assert "already exists; pass --overwrite" in loser_errors[0] or "appeared while" in loser_errors[0]
    assert names_in(tmp_path) == ["out", "src"]
    with safe_open(tmp_path / "out" / "model.safetensors", framework="pt") as weights:
        assert all(weights.get_tensor(name).numel() for name in weights.keys())  # noqa: SIM118


SHRINK_WHILE_READING = """
import os, sys
import scalevec.convert.checkpoint as checkpoint
from scalevec.convert.cli import main

read = checkpoint._read_tensor

def read_then_shrink(handle, name, info):
    tensor = read(handle, name, info)
    os.truncate(info.file, 200)  # another process rewrites the source while the export reads it
    return tensor

checkpoint._read_tensor = read_then_shrink
sys.exit(main(["export", sys.argv[1], sys.argv[2], "--to", "llama", "-q"]))
"""


def test_a_source_shrinking_while_it_is_read_is_an_error_not_a_crash(tmp_path):
    """Through a memory map, the read after the shrink would kill the process with SIGBUS and no message."""
    saved_scalevec(tmp_path / "src", tiny_config())
    result = run_python(SHRINK_WHILE_READING, str(tmp_path / "src"), str(tmp_path / "out"))
    assert result.returncode == 1, (result.returncode, result.stderr[-2000:])
    (error,) = convert_errors(result.stderr)
    assert f"{tmp_path / 'src' / 'model.safetensors'} ended inside tensor" in error
    assert "shrank while it was being read" in error
    assert names_in(tmp_path) == ["src"]


SHRINK_BIN_WHILE_READING = """
import os, sys
import scalevec.convert.checkpoint as checkpoint
from scalevec.convert.cli import main

load = checkpoint._load_bin

def load_then_shrink(file, device="cpu"):
    state = load(file, device)
    if device != "meta":  # reading tensors, not only their names and shapes
        os.truncate(file, 200)  # another process rewrites the source while the export reads it
    return state

checkpoint._load_bin = load_then_shrink
sys.exit(main(["export", sys.argv[1], sys.argv[2], "--to", "llama", "-q"]))
"""


def test_a_bin_source_shrinking_while_it_is_read_is_an_error_not_a_crash(tmp_path):
    """As for safetensors: the tensors already read stay valid, and the next read fails with a message."""
    model = saved_scalevec(tmp_path / "src", tiny_config())
    (tmp_path / "src" / "model.safetensors").unlink()
    torch.save(model.state_dict(), tmp_path / "src" / "pytorch_model.bin")  # the zip format, which can be mapped
    result = run_python(SHRINK_BIN_WHILE_READING, str(tmp_path / "src"), str(tmp_path / "out"))
    assert result.returncode == 1, (result.returncode, result.stderr[-2000:])
    (error,) = convert_errors(result.stderr)
    assert f"{tmp_path / 'src' / 'pytorch_model.bin'} is not a readable PyTorch state dict" in error
    assert "changed while it was being read" in error
    assert names_in(tmp_path) == ["src"]
