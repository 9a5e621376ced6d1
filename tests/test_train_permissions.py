"""What a run leaves on disk is as readable as the user's umask says, as files made by `open` and folders made by
`mkdir` are: prepared folders (here the cache's), the run folder, its checkpoints and weights, and an export. The
atomic writers (`mkdtemp`, `mkstemp`, safetensors' writer) make private files and folders; the shared commit step
(`scalevec.atomic.finish_tree`) gives them the umask's permissions."""

import os
import stat
import tempfile
from contextlib import contextmanager
from pathlib import Path

import pytest

from scalevec.atomic import commit_folder, write_text_atomically
from scalevec.convert import OutputOptions, export_checkpoint
from scalevec.convert.card import card_writer
from scalevec.train.cli import main

from ._helpers import train_argv


@contextmanager
def umask(mask: int):
    previous = os.umask(mask)
    try:
        yield
    finally:
        os.umask(previous)


def modes(folder: Path) -> dict[str, set[str]]:
    """The permission bits found under `folder` (itself included), by kind: {"files": {"0o664"}, "folders": ...}."""
    found = {"files": set(), "folders": {oct(stat.S_IMODE(folder.stat().st_mode))}}
    for root, folders, files in os.walk(folder):
        for name in files:
            found["files"].add(oct(stat.S_IMODE(os.stat(os.path.join(root, name)).st_mode)))
        for name in folders:
            found["folders"].add(oct(stat.S_IMODE(os.stat(os.path.join(root, name)).st_mode)))
    return found


@pytest.mark.slow  # the Trainer's data-loading worker processes
def test_a_run_its_checkpoints_its_prepared_data_and_an_export_follow_the_umask(tmp_path):
    """Under umask 002 (a team's: group-writable) every file is 0664 and every folder 0775, not the 0600 / 0700
    of the atomic writers nor a fixed 0644."""
    run, cache, export = tmp_path / "run", tmp_path / "cache", tmp_path / "export"
    flags = ("--save-strategy", "steps", "--save-steps", "2", "--prepared-cache", str(cache), "--max-documents", "60")
    with umask(0o002):
        assert main(train_argv(run, *flags, steps=2)) == 0
        export_checkpoint(run, export, "llama", OutputOptions(before_commit=card_writer(run)))
    prepared = next(cache.iterdir())
    assert (run / "checkpoint-2" / "model.safetensors").is_file() and (export / "README.md").is_file()
    for folder in (run, prepared, export):
        assert modes(folder) == {"files": {"0o664"}, "folders": {"0o775"}}, folder


def test_the_atomic_writers_follow_a_private_umask_too(tmp_path):
    with umask(0o077):
        staging = Path(tempfile.mkdtemp(dir=tmp_path))
        write_text_atomically(staging / "notes" / "a.txt", "text")
        commit_folder(staging, tmp_path / "done")
    assert modes(tmp_path / "done") == {"files": {"0o600"}, "folders": {"0o700"}}
    with umask(0o022):
        write_text_atomically(tmp_path / "done" / "b.txt", "text")
    assert oct(stat.S_IMODE((tmp_path / "done" / "b.txt").stat().st_mode)) == "0o644"
