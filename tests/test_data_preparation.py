"""Preparation that resumes and splits (scalevec/data/preparation.py, resumable.py): a `scalevec-data prepare`
killed half-way and run again writes the folder an uninterrupted one writes, byte for byte, without tokenising
again what it had written; the staging folder of a killed preparation is reused or removed by the next one into
the same place (beside --output and in the cache), and a live one is not touched; parts prepared with --shard i/n
and combined are the folder one preparation makes."""

import fcntl
import os
import signal
import subprocess
import sys

import pytest

from scalevec.data import (
    DataArguments,
    DataError,
    PrepareOptions,
    build_training_data,
    default_tokenizer,
    find_source,
    prepare,
)
from scalevec.data.cli import main as data_main
from scalevec.data.tokenization import DocumentEncoder

from ._helpers import SUBPROCESS_ENV, corpus_texts, write_parts

pytestmark = pytest.mark.slow  # it starts processes or trains end to end

OPTIONS = ["--seq-len", "32", "--eval-every", "10", "--max-eval-documents", "40", "--quiet"]

# `scalevec-data prepare` saving its progress after every chunk of documents, and killed (SIGKILL) after its
# third save has flushed `train.bin` but before it records that: the rerun must cut `train.bin` back.
KILLED_PREPARE = """
import os, signal, sys
from scalevec.data import preparation, resumable
from scalevec.data.cli import main

preparation.CHECKPOINT_SECONDS = 0
saves, save = [], resumable.Staging.save


def save_then_die(self, progress):
    saves.append(progress)
    if sum("train" in saved for saved in saves) == 3:
        os.kill(os.getpid(), signal.SIGKILL)
    save(self, progress)


resumable.Staging.save = save_then_die
sys.exit(main(sys.argv[1:]))
"""


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Seven jsonl files of unequal sizes (2,400 documents), a few empty."""
    texts = corpus_texts(2400, seed=2)
    texts[100] = texts[1700] = ""
    return write_parts(tmp_path_factory.mktemp("corpus"), texts, [500, 150, 600, 250, 300, 350, 250])


def tree(folder) -> dict[str, bytes]:
    """Every file under `folder` (relative path: content), hidden ones included."""
    return {str(path.relative_to(folder)): path.read_bytes() for path in sorted(folder.rglob("*")) if path.is_file()}


@pytest.fixture(scope="module")
def uninterrupted(corpus, tmp_path_factory):
    output = tmp_path_factory.mktemp("one") / "prepared"
    assert data_main(["prepare", str(corpus), "--output", str(output), *OPTIONS]) == 0
    return output


def encoded_documents(monkeypatch) -> list[int]:
    calls = []
    encode = DocumentEncoder.__call__
    monkeypatch.setattr(
        DocumentEncoder, "__call__", lambda self, texts: calls.append(len(texts)) or encode(self, texts)
    )
    return calls


def test_a_killed_preparation_continues_to_the_same_bytes(corpus, uninterrupted, tmp_path, monkeypatch, capsys):
    output = tmp_path / "prepared"
    command = [sys.executable, "-c", KILLED_PREPARE, "prepare", str(corpus), "--output", str(output), *OPTIONS]
    killed = subprocess.run(command, capture_output=True, text=True, env={**os.environ, **SUBPROCESS_ENV})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    staging = tmp_path / ".prepared.staging"
    assert not output.exists() and (staging / "progress.json").is_file()
    assert (staging / "train.bin").stat().st_size > 0

    calls = encoded_documents(monkeypatch)
    assert data_main(["prepare", str(corpus), "--output", str(output), *OPTIONS[:-1]]) == 0
    assert "continuing an interrupted preparation after" in capsys.readouterr().err
    assert tree(output) == tree(uninterrupted)
    assert not staging.exists() and sorted(path.name for path in tmp_path.iterdir()) == ["prepared"]
    trained = 2400 - 40 - 2  # documents in train.bin (not held out, not empty), 512 a chunk: two chunks were saved
    assert sum(calls) == trained - 2 * 512


def test_a_staging_folder_left_by_another_preparation_is_emptied_and_a_live_one_refused(corpus, tmp_path):
    output = tmp_path / "prepared"
    staging = tmp_path / ".prepared.staging"
    staging.mkdir()
    (staging / "progress.json").write_text('{"key": "another preparation", "held_out": null}')
    (staging / "train.bin").write_bytes(b"\1" * 1000)
    (tmp_path / ".prepared.staging-k2j3x9").mkdir()  # the random name earlier versions used
    (tmp_path / ".prepared.staging-k2j3x9" / "train.bin").write_bytes(b"\1" * 1000)
    descriptor = os.open(staging, os.O_RDONLY)
    fcntl.flock(descriptor, fcntl.LOCK_EX)  # a live preparation into the same place
    with pytest.raises(DataError, match=f"^{output} is being prepared by another process \\(in {staging}\\)"):
        prepare([find_source(str(corpus))], default_tokenizer(), PrepareOptions(32), output, progress=False)
    assert (staging / "train.bin").stat().st_size == 1000  # untouched
    os.close(descriptor)
    assert data_main(["prepare", str(corpus), "--output", str(output), *OPTIONS]) == 0
    assert sorted(path.name for path in tmp_path.iterdir()) == ["prepared"]


def test_the_cache_reuses_its_own_staging_folder(corpus, tmp_path, capsys):
    args = DataArguments(dataset=str(corpus), seq_len=32, prepared_cache=str(tmp_path / "cache"), eval_every=10)
    tokenizer = default_tokenizer()
    first = build_training_data(args, tokenizer, seed=0, progress=False)
    (folder,) = (tmp_path / "cache").iterdir()
    expected = tree(folder)
    os.rename(folder, tmp_path / "cache" / f".{folder.name}.staging")  # as if killed before its rename
    (tmp_path / "cache" / f".{folder.name}.staging" / "progress.json").write_text('{"key": "stale"}')
    second = build_training_data(args, tokenizer, seed=0, progress=False)
    assert [path.name for path in (tmp_path / "cache").iterdir()] == [folder.name] and tree(folder) == expected
    assert len(second.train) == len(first.train)


def test_two_shards_combined_are_one_preparation(corpus, uninterrupted, tmp_path, capsys):
    parts = [tmp_path / f"part-{index}" for index in range(2)]
    for index, part in enumerate(parts):
        argv = ["prepare", str(corpus), "--output", str(part), "--shard", f"{index}/2", *OPTIONS]
        assert data_main(argv) == 0
    assert "part 1 of a preparation in 2 parts" in capsys.readouterr().out
    assert data_main(["combine", str(parts[1]), "--output", str(tmp_path / "half")]) == 1
    assert capsys.readouterr().err == (
        "scalevec-data: error: the parts given are 1/2: combining takes each part of one --shard i/n once\n"
    )
    assert data_main(["combine", str(parts[1]), str(parts[0]), "--output", str(tmp_path / "combined")]) == 0
    assert tree(tmp_path / "combined") == tree(uninterrupted)
    assert (parts[0] / "train_tail.bin").stat().st_size > 0  # part 1's tokens start inside a block
    sizes = [(part / "train.bin").stat().st_size for part in parts]
    assert min(sizes) > 0.3 * sum(sizes)  # balanced by the files' sizes
    assert data_main(["prepare", str(corpus), "--output", str(tmp_path / "x"), "--shard", "7/7", *OPTIONS]) == 1
    assert "scalevec-data: error: --shard '7/7': give I/N with 0 <= I < N" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
    assert data_main(["prepare", str(corpus), "--output", str(tmp_path / "x"), "--shard", "0/8", *OPTIONS]) == 1
    assert "--shard 0/8: the sources hold 7 files, and a part whole files" in capsys.readouterr().err
