"""Prepared folders checked (scalevec/data/checks.py): `scalevec-data info` finds a truncated, padded, garbage-filled
or bogus-dtype folder, one without `scalevec_data.json` and one with a broken tokenizer, one line per problem and a
non-zero exit (`--quick` skips the scan of the token ids); training refuses each before its first step, in one line,
and a folder without `scalevec_data.json` is not read as raw data."""

import fcntl
import json
import os
import shutil

import numpy as np
import pytest

from scalevec.data import PrepareOptions, default_tokenizer, find_source, preparation, prepare, resumable
from scalevec.data.cli import main as data_main
from scalevec.train.cli import main as train_main

from ._helpers import corpus_texts, train_argv, write_dataset


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    folder = tmp_path_factory.mktemp("good") / "prepared"
    source = find_source(str(write_dataset(folder.parent / "data", "jsonl", corpus_texts(300))))
    prepare([source], default_tokenizer(), PrepareOptions(32, eval_every=10), folder, progress=False)
    return folder


def truncated(folder):
    train = folder / "train.bin"
    train.write_bytes(train.read_bytes()[:-64])
    return f"{train}: {train.stat().st_size:,} bytes where its"


def padded(folder):
    train = folder / "train.bin"
    train.write_bytes(train.read_bytes() + b"\0" * 64)
    return f"{train}: {train.stat().st_size:,} bytes where its"


def garbage(folder):
    train = folder / "train.bin"
    ids = np.fromfile(train, dtype=np.uint16)
    ids[3 * 32 + 5] = 65000
    ids.tofile(train)
    return f"{train}: token id 65,000 (block 3) is not below the vocabulary size 4,096"


def bogus_dtype(folder):
    metadata = json.loads((folder / "scalevec_data.json").read_text())
    (folder / "scalevec_data.json").write_text(json.dumps({**metadata, "dtype": "bogus"}))
    return f"{folder / 'scalevec_data.json'}: dtype 'bogus' is none of uint16, uint32"


def no_description(folder):
    (folder / "scalevec_data.json").unlink()
    return f"{folder}: no scalevec_data.json, so not a prepared folder (or one that lost its description)"


def broken_tokenizer(folder):
    (folder / "tokenizer" / "tokenizer.json").write_text("{")
    return f"{folder / 'tokenizer'}: the tokenizer does not load ("


DAMAGE = [truncated, padded, garbage, bogus_dtype, no_description, broken_tokenizer]


@pytest.mark.parametrize("damage", DAMAGE, ids=lambda damage: damage.__name__)
def test_info_names_each_problem_and_fails(damage, good, tmp_path, capsys):
    folder = tmp_path / "prepared"
    shutil.copytree(good, folder)
    message = damage(folder)
    assert data_main(["info", str(folder)]) == 1
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 1 and errors[0].startswith(f"scalevec-data: error: {message}"), errors
    assert data_main(["info", str(folder), "--quick"]) == (0 if damage is garbage else 1)


def test_info_checks_a_good_folder_and_another_problem_gets_a_line_of_its_own(good, tmp_path, capsys):
    assert data_main(["info", str(good)]) == 0
    assert "checked: file sizes, token ids below the vocabulary size, held-out digests, tokenizer" in (
        capsys.readouterr().out
    )
    folder = tmp_path / "prepared"
    shutil.copytree(good, folder)
    garbage(folder)
    (folder / "eval.bin").write_bytes(b"")
    assert data_main(["info", str(folder)]) == 1
    errors = capsys.readouterr().err.splitlines()
    assert len(errors) == 2 and all(line.startswith("scalevec-data: error: ") for line in errors)


@pytest.mark.parametrize("damage", [truncated, garbage, bogus_dtype, no_description], ids=lambda d: d.__name__)
def test_training_refuses_a_damaged_folder_before_its_first_step(damage, good, tmp_path, capsys):
    folder = tmp_path / "prepared"
    shutil.copytree(good, folder)
    message = damage(folder)
    argv = train_argv(tmp_path / "run", "--dataset", str(folder), max_documents=None)
    assert train_main([flag for flag in argv if flag not in ("--seq-len", "32")]) == 1
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("scalevec-train:")]
    assert "Traceback" not in err and len(errors) == 1, err[-3000:]
    if damage is no_description:  # not read as raw data, and not blamed on the tokenizer's JSON files
        message = f"--dataset {folder}: a prepared folder without its scalevec_data.json; prepare it again"
    assert message in errors[0]
    assert not (tmp_path / "run").exists()


def test_info_on_a_missing_or_unfinished_folder_says_which_and_that_rerunning_continues(tmp_path, capsys, monkeypatch):
    data = write_dataset(tmp_path / "data", "jsonl", corpus_texts(300))
    folder = tmp_path / "prepared"
    assert data_main(["info", str(folder)]) == 1
    assert capsys.readouterr().err == f"scalevec-data: error: {folder}: no such folder\n"

    def interrupted(self, progress):  # as a Ctrl-C (or a kill) during the preparation, after it saved nothing
        raise KeyboardInterrupt

    prepare_argv = ["prepare", str(data), "--output", str(folder), "--seq-len", "32", "--quiet"]
    monkeypatch.setattr(resumable.Staging, "save", interrupted)
    monkeypatch.setattr(preparation, "CHECKPOINT_SECONDS", 0)
    with pytest.raises(KeyboardInterrupt):
        data_main(prepare_argv)
    monkeypatch.undo()
    staging = tmp_path / ".prepared.staging"
    assert data_main(["info", str(folder)]) == 1
    assert capsys.readouterr().err == (
        f"scalevec-data: error: {folder}: not prepared yet: a preparation into it was interrupted, and what it had "
        f"done is in {staging}; run the same `scalevec-data prepare ... --output {folder}` again and it continues "
        "from there\n"
    )
    descriptor = os.open(staging, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fcntl.flock(descriptor, fcntl.LOCK_EX)  # as a live preparation holds it
        assert data_main(["info", str(folder)]) == 1
        assert f"{folder}: not prepared yet: another process is preparing it now (in {staging})" in (
            capsys.readouterr().err
        )
    finally:
        os.close(descriptor)
    assert data_main(prepare_argv) == 0 and data_main(["info", str(folder)]) == 0
    assert not staging.exists()
