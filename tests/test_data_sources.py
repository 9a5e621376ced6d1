"""Reading sources (scalevec/data/sources.py): every local format gives the documents `datasets.load_dataset`
gives, and bad data stops with one line naming the file and the place, from the library and from the command line,
leaving nothing behind."""

import gzip
import json
import re
import time

import datasets
import pyarrow.parquet as pq
import pytest

from scalevec.data import DataArguments, DataError, find_source
from scalevec.data.build import load_tokenizer
from scalevec.data.sources import check_hub_repo, is_missing_path, read_documents
from scalevec.evaluation.cli import check_model_source
from scalevec.train.cli import main

from ._helpers import corpus_texts, train_argv, write_dataset


def documents(path, column: str = "text") -> list[str]:
    source = find_source(str(path), column)
    return [text for shard in source.shards() for text in read_documents(shard)]


@pytest.mark.parametrize("kind", ["txt", "jsonl", "json", "jsonl.gz", "parquet", "folder"])
def test_every_format_reads_what_datasets_reads(kind, tmp_path):
    texts = corpus_texts(40)
    column = "text" if kind == "txt" else "body"
    path = write_dataset(tmp_path / "data", kind, texts, column)
    assert documents(path, column) == texts
    if kind not in ("folder", "json"):  # `datasets` reads the rest by file type
        builder = {"txt": "text", "jsonl": "json", "jsonl.gz": "json", "parquet": "parquet"}[kind]
        loaded = datasets.load_dataset(builder, data_files=str(path), split="train")
        assert loaded["text" if kind == "txt" else column] == texts


def test_null_and_empty_texts_are_empty_documents(tmp_path):
    path = tmp_path / "docs.jsonl"
    path.write_text('{"text": "a"}\n{"text": null}\n\n{"text": ""}\n{"text": "b"}\n')
    assert documents(path) == ["a", "", "", "b"]  # a blank line is no record


def bad_jsonl(folder):
    lines = [json.dumps({"text": f"document {i}"}) for i in range(300)]
    lines[200] = '{"text": "cut'
    (folder / "x.jsonl").write_text("\n".join(lines) + "\n")
    return folder / "x.jsonl"


def not_utf8(folder):
    (folder / "u.txt").write_bytes(b"hello\n" * 100 + b"caf\xe9 au lait\n" + b"more\n")
    return folder / "u.txt"


def binary(folder):
    (folder / "b.txt").write_bytes(b"text\n" + bytes(range(256)))
    return folder / "b.txt"


def damaged_parquet(folder):
    """Bytes overwritten inside the compressed text of the middle row group (of 13)."""
    path = write_dataset(folder, "parquet", corpus_texts(200))
    metadata = pq.ParquetFile(path).metadata
    text = metadata.row_group(metadata.num_row_groups // 2).column(0)
    chunk_start = text.dictionary_page_offset if text.has_dictionary_page else text.data_page_offset
    start = chunk_start + text.total_compressed_size // 2
    data = bytearray(path.read_bytes())
    data[start : start + 32] = b"\xff" * 32
    path.write_bytes(bytes(data))
    return path


def not_parquet(folder):
    (folder / "p.parquet").write_bytes(b"this is no parquet file at all, not even close")
    return folder / "p.parquet"


def wrong_column(folder):
    return write_dataset(folder, "jsonl", ["a", "b"], column="body")


def wrong_parquet_column(folder):
    return write_dataset(folder, "parquet", ["a", "b"], column="body")


def number_text(folder):
    (folder / "n.jsonl").write_text('{"text": "fine"}\n{"text": 42}\n')
    return folder / "n.jsonl"


def not_objects(folder):
    (folder / "l.jsonl").write_text('{"text": "fine"}\n["a", "list"]\n')
    return folder / "l.jsonl"


def truncated_gzip(folder):
    data = gzip.compress(("\n".join(json.dumps({"text": t}) for t in corpus_texts(200))).encode())
    (folder / "t.jsonl.gz").write_bytes(data[: len(data) // 2])
    return folder / "t.jsonl.gz"


BAD = {
    "malformed jsonl line": (bad_jsonl, "x.jsonl line 201: invalid JSON (Unterminated string"),
    "not UTF-8": (not_utf8, "u.txt line 101: not UTF-8 text (byte 0xe9 at column 4)"),
    "binary": (binary, "b.txt line 2: binary data (a NUL byte), not text"),
    "parquet damaged in the middle": (damaged_parquet, "docs.parquet row group 7 of 13 (rows 97-112): damaged"),
    "not parquet": (not_parquet, "p.parquet: not a readable parquet file"),
    "no such field": (wrong_column, "docs.jsonl line 1: no 'text' field (it has ['body', 'id'])"),
    "no such column": (wrong_parquet_column, "docs.parquet: no 'text' column (it has ['body', 'id'])"),
    "a number for text": (number_text, "n.jsonl line 2: 'text' holds a int, not text"),
    "not an object": (not_objects, "l.jsonl line 2: expected a JSON object with a 'text' field, got list"),
    "truncated gzip": (truncated_gzip, "t.jsonl.gz: unreadable after "),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_data_names_the_file_and_the_place(case, tmp_path):
    make, message = BAD[case]
    path = make(tmp_path)
    with pytest.raises(DataError) as raised:
        documents(path)
    assert str(raised.value).startswith(f"{tmp_path}/{message}"), str(raised.value)
    assert "\n" not in str(raised.value)


@pytest.mark.parametrize(
    "name, message",
    [
        ("missing.jsonl", "--dataset {tmp}/missing.jsonl: no such file or folder"),
        ("empty.jsonl", "--dataset {tmp}/empty.jsonl: the dataset is empty"),
        ("mixed", "--dataset {tmp}/mixed: the files must share one format; this folder mixes ['json', 'text']"),
        ("notes.md", "--dataset {tmp}/notes.md: not one of the file types"),
        ("nothing", "--dataset {tmp}/nothing: no .json, .jsonl, .parquet, .text, .txt files in this folder"),
    ],
)
def test_bad_dataset_paths(name, message, tmp_path):
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "notes.md").write_text("# notes")
    (tmp_path / "nothing").mkdir()
    write_dataset(tmp_path / "mixed", "txt", ["a b c"])
    write_dataset(tmp_path / "mixed", "jsonl", ["a b c"])
    with pytest.raises(DataError) as raised:
        find_source(str(tmp_path / name))
    assert str(raised.value).startswith(message.format(tmp=tmp_path))


@pytest.mark.parametrize("case", ["malformed jsonl line", "not UTF-8", "parquet damaged in the middle"])
def test_scalevec_train_says_one_line_and_leaves_nothing(case, tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    path = BAD[case][0](data)
    cache, output = tmp_path / "cache", tmp_path / "run"
    argv = train_argv(output, "--dataset", str(path), "--prepared-cache", str(cache), "--max-documents", "100000")
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    errors = [line for line in err.splitlines() if "error" in line.lower()]
    assert len(errors) == 1 and errors[0].startswith(f"scalevec-train: error: {data}/{BAD[case][1]}"), errors
    assert not output.exists()
    assert list(cache.iterdir()) == []  # the half-prepared copy is gone


def test_a_missing_path_spelled_as_a_hub_id_is_named_at_once(tmp_path, monkeypatch):
    """`data/nothere` beside a folder `data`, `bad/name` beside a folder `bad`: no such file or folder, said at once
    instead of after the Hub's retries; an `owner/name` with no folder `owner` here is still a Hub id."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "bad").mkdir()
    started = time.monotonic()
    with pytest.raises(DataError, match=r"^--dataset data/nothere: no such file or folder$"):
        find_source("data/nothere")
    with pytest.raises(DataError, match=r"^--tokenizer bad/name: no such folder$"):
        load_tokenizer(DataArguments(tokenizer="bad/name"))
    assert time.monotonic() - started < 5  # no request to the Hub
    assert is_missing_path("data/nothere") and is_missing_path("./nothere") and is_missing_path("a b/c")
    assert not is_missing_path("someone/corpus") and not is_missing_path("wikitext")  # Hub ids
    assert not is_missing_path("data")  # there


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """An empty Hub cache of this test's own, and offline mode as each test sets it (read at import otherwise)."""
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub-cache"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    return tmp_path / "hub-cache"


def test_a_name_neither_here_nor_on_the_hub_fails_within_seconds_saying_both(tmp_path, monkeypatch, hub_cache):
    """With no folder `data`, `bad` or `runs` here, each name is a Hub id: asked about once (this machine has no
    network; with one, the Hub says there is no such repository) instead of after a minute of the loaders' retries."""
    monkeypatch.chdir(tmp_path)
    unreachable = r"the Hub \(https://[^)]+\) cannot be reached to look for it: .+"
    hub = rf"({unreachable}|no (model|dataset) repository of that name on the Hub \(.+\))$"
    attempts = {
        "--dataset data/nothere: no such file or folder here, and ": lambda: find_source("data/nothere"),
        "--tokenizer bad/name: no such folder here, and ": lambda: load_tokenizer(DataArguments(tokenizer="bad/name")),
        "model runs/nothere: no such folder here, and ": lambda: check_model_source("model", "runs/nothere"),
        "--init-from runs/nothere: no such folder here, and ": lambda: check_model_source(
            "--init-from", "runs/nothere"
        ),
    }
    for start, attempt in attempts.items():
        started = time.monotonic()
        with pytest.raises(ValueError, match="^" + re.escape(start) + hub):
            attempt()
        assert time.monotonic() - started < 15


def test_the_hub_is_asked_once_and_its_answer_or_the_cache_decides(hub, hub_cache, monkeypatch):
    """A repository the Hub has loads as before; one it lacks is refused naming the Hub; offline, a repository in the
    local cache is read from there alone, and one not in it is refused saying so."""
    from huggingface_hub import constants

    from tests.hub_server import Repo

    monkeypatch.setattr(constants, "ENDPOINT", hub.url)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    hub.repos["tester/there"] = Repo(private=False)
    hub.repos["tester/there"].add_commit({"config.json": b"{}"}, "main")
    assert check_hub_repo("--tokenizer", "tester/there") is True
    missing = f"no such folder here, and no model repository of that name on the Hub ({hub.url})"
    with pytest.raises(DataError, match=rf"^--tokenizer tester/gone: {re.escape(missing)}$"):
        check_hub_repo("--tokenizer", "tester/gone")
    assert hub.requests == [("GET", "/api/models/tester/there"), ("GET", "/api/models/tester/gone")]
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    (hub_cache / "models--tester--cached").mkdir(parents=True)
    assert check_hub_repo("--tokenizer", "tester/cached") is False  # read with local_files_only
    offline = "no such folder here, and not in the local Hub cache (HF_HUB_OFFLINE is set: the Hub is not asked)"
    with pytest.raises(DataError, match=rf"^--tokenizer tester/there: {re.escape(offline)}$"):
        check_hub_repo("--tokenizer", "tester/there")
    assert len(hub.requests) == 2
