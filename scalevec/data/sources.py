"""Where documents come from: local text, JSON-lines, JSON or parquet files (plain or compressed), folders of them,
or Hub datasets. A source is read one shard at a time (a local file, or one of a Hub dataset's data files), and
anything wrong with the data stops the reading with a `DataError` naming the file and the place:
`data/x.jsonl line 201: invalid JSON (Expecting property name ...)`.

Local files are read here rather than through `datasets`' builders, which report a bad line as a traceback without
the file; Hub datasets stream through `datasets`. Both give the same documents as `datasets.load_dataset` would: a
text file holds one document per line, a JSON-lines file one object per line.
"""

import bz2
import gzip
import json
import lzma
import os
import re
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

FORMATS = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
COMPRESSIONS = {".gz": gzip.open, ".bz2": bz2.open, ".xz": lzma.open}
_PARQUET_BATCH_ROWS = 256
# A Hub dataset id as the Hub spells one: `name` or `owner/name`.
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


class DataError(ValueError):
    """Bad data or a bad data argument: the message is one line naming the file (or source) and the place."""


@dataclass(frozen=True)
class Source:
    """One `--dataset` entry: its local files in order, or a Hub dataset id and its number of data files."""

    name: str
    text_column: str
    files: tuple[str, ...] = ()
    hub_config: str | None = None
    hub_shards: int = 0

    @property
    def is_local(self) -> bool:
        return bool(self.files)

    def identity(self) -> dict:
        """What a preparation of this source depends on: the files (paths, sizes and times), or the Hub dataset."""
        if self.is_local:
            stats = [(os.path.abspath(file), os.stat(file)) for file in self.files]
            files = [(path, stat.st_size, stat.st_mtime_ns) for path, stat in stats]
            return {"files": files, "text_column": self.text_column}
        return {"hub": self.name, "config": self.hub_config, "shards": self.hub_shards, "column": self.text_column}

    def shards(self) -> list["Shard"]:
        if self.is_local:
            return [Shard(self, index) for index in range(len(self.files))]
        return [Shard(self, index) for index in range(self.hub_shards)]


@dataclass(frozen=True)
class Shard:
    """The unit that is read whole, by one process: a local file or one data file of a Hub dataset."""

    source: Source
    index: int

    def __str__(self) -> str:
        if self.source.is_local:
            return self.source.files[self.index]
        return f"{self.source.name} (data file {self.index + 1} of {self.source.hub_shards})"


def find_source(name: str, text_column: str = "text", hub_config: str | None = None) -> Source:
    """The `Source` that `name` (a file, a folder or a Hub dataset id) names, checked: a missing path or a folder
    of mixed or unknown files is refused here, before anything is read."""
    path = Path(name).expanduser()
    if path.exists():
        files = _local_files(path)
        if all(os.path.getsize(file) == 0 for file in files):
            raise DataError(f"--dataset {name}: the dataset is empty")
        return Source(name, text_column, files=tuple(files))
    if is_missing_path(name):
        raise DataError(f"--dataset {name}: no such file or folder")
    check_hub_repo("--dataset", name, "dataset")
    return Source(name, text_column, hub_config=hub_config, hub_shards=_hub_dataset(name, hub_config).num_shards)


def is_missing_path(name: str) -> bool:
    """True when `name` names a file or folder (not a Hub dataset id) that does not exist."""
    path = Path(name).expanduser()
    if path.exists():
        return False
    return names_a_local_path(name) or _format_of(path) is not None


def names_a_local_path(name: str) -> bool:
    """True when `name` can only mean a local file or folder, not a Hub id (a dataset's or a tokenizer's): it starts
    with `.`, `/` or `~`, it is not spelled as a Hub id (`name` or `owner/name`), or its first part is a folder here
    (`data/nothere` beside a folder `data`), which no Hub owner's name is read as. Said at once, where the Hub would
    be asked, and retried, for a repository that is not there."""
    owner, separator, _ = name.partition("/")
    in_local_folder = bool(separator) and Path(owner).expanduser().is_dir()
    return name.startswith((".", "/", "~")) or not _HUB_ID.match(name) or in_local_folder


# A name that is no local path is a Hub repository id: asked about once, with a short timeout, before the Hub
# loaders (`transformers`, `datasets`) try it, since they retry an unreachable Hub for a minute and more per file.
PROBE_SECONDS = 5  # one request; the Hub answers a repository query in well under a second


def check_hub_repo(option: str, name: str, repo_type: str = "model", described: str | None = None) -> bool:
    """`name` (for `option`, such as `--tokenizer`) is not a local path: True where the Hub has it (load it
    normally), False where the Hub cannot be reached but a local cache holds it (load with `local_files_only`).
    A `DataError` where there is no such repository, or the Hub cannot be reached and no cache holds it: after one
    question of `PROBE_SECONDS` at most, where the loaders retry for most of a minute. `described`: what the error
    begins with, where `name` is not a path the user gave (a built-in task's dataset)."""
    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, HFValidationError, RepositoryNotFoundError

    here = described or f"{option} {name}: no such {'file or folder' if repo_type == 'dataset' else 'folder'} here"
    try:
        HfApi().repo_info(name, repo_type=repo_type, timeout=PROBE_SECONDS)
    except GatedRepoError:  # there, behind an agreement: the loader says how to get access
        return True
    except RepositoryNotFoundError:
        raise DataError(
            f"{here}, and no {repo_type} repository of that name on the Hub ({constants.ENDPOINT})"
        ) from None
    except HFValidationError as error:
        raise DataError(f"{here}, and not a Hub repository id ({first_line(error)})") from None
    except HfHubHTTPError:  # the Hub answered otherwise (a server error): its loader retries and reports it
        return True
    except Exception as error:  # no answer at all: offline mode, no network, no name resolution, a timeout
        if _hub_cached(name, repo_type):
            return False
        if constants.HF_HUB_OFFLINE:
            reason = "not in the local Hub cache (HF_HUB_OFFLINE is set: the Hub is not asked)"
        else:
            reason = f"the Hub ({constants.ENDPOINT}) cannot be reached to look for it: {first_line(error)}"
        raise DataError(f"{here}, and {reason}") from None
    return True


def _hub_cached(name: str, repo_type: str) -> bool:
    """Whether a local cache holds the repository `name`: the Hub's, or for a dataset also `datasets`' own (which
    keeps what it prepared from the Hub's files)."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    if Path(constants.HF_HUB_CACHE, repo_folder_name(repo_id=name, repo_type=repo_type)).is_dir():
        return True
    if repo_type != "dataset":
        return False
    import datasets

    return Path(datasets.config.HF_DATASETS_CACHE, name.replace("/", "___")).is_dir()


def _format_of(path: Path) -> str | None:
    suffixes = path.suffixes[-2:]
    if suffixes and suffixes[-1] in COMPRESSIONS:
        suffixes = suffixes[:-1]
    return FORMATS.get(suffixes[-1]) if suffixes else None


def _local_files(path: Path) -> list[str]:
    if path.is_file():
        if _format_of(path) is None:
            raise DataError(f"--dataset {path}: not one of the file types {', '.join(sorted(FORMATS))}")
        return [str(path)]
    files = sorted(p for p in path.rglob("*") if p.is_file() and _format_of(p) is not None)
    if not files:
        raise DataError(f"--dataset {path}: no {', '.join(sorted(FORMATS))} files in this folder")
    formats = {_format_of(p) for p in files}
    if len(formats) > 1:
        raise DataError(f"--dataset {path}: the files must share one format; this folder mixes {sorted(formats)}")
    return [str(p) for p in files]


def _hub_dataset(name: str, config: str | None):
    import datasets

    try:
        return datasets.load_dataset(name, name=config, split="train", streaming=True)
    except Exception as error:  # the Hub's and `datasets`' many error types: name the source, keep the cause
        raise DataError(f"--dataset {name}: cannot open it as a Hub dataset ({first_line(error)})") from error


def read_documents(shard: Shard) -> Iterator[str]:
    """The documents of one shard, in order; a missing or null text is an empty document."""
    source = shard.source
    if not source.is_local:
        yield from _hub_documents(shard)
        return
    path = Path(source.files[shard.index])
    readers = {"text": _text_documents, "json": _json_documents, "parquet": _parquet_documents}
    count = 0
    try:
        for count, text in enumerate(readers[_format_of(path)](path, source.text_column), 1):  # noqa: B007
            yield text
    except (OSError, EOFError, zlib.error, lzma.LZMAError) as error:  # unreadable, or compressed and cut short
        raise DataError(f"{path}: unreadable after {count} documents ({first_line(error)})") from error


def _open_binary(path: Path):
    return COMPRESSIONS.get(path.suffix, open)(path, "rb")


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    with _open_binary(path) as file:
        for number, raw in enumerate(file, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as error:
                byte, column = raw[error.start : error.start + 1].hex(), error.start + 1
                raise DataError(f"{path} line {number}: not UTF-8 text (byte 0x{byte} at column {column})") from None
            if "\0" in line:
                raise DataError(f"{path} line {number}: binary data (a NUL byte), not text")
            yield number, line.rstrip("\r\n")


def _text_documents(path: Path, text_column: str) -> Iterator[str]:
    for _, line in _lines(path):
        yield line


def _json_documents(path: Path, text_column: str) -> Iterator[str]:
    lines = _lines(path)
    first = True
    for number, line in lines:
        if not line.strip():
            continue
        if first and line.lstrip().startswith("["):  # one JSON array of objects rather than JSON lines
            rest = "\n".join([line, *(text for _, text in lines)])
            yield from _json_array_documents(path, rest, text_column)
            return
        try:
            record = json.loads(line)
        except ValueError as error:
            raise DataError(f"{path} line {number}: invalid JSON ({error})") from None
        first = False
        yield _text_of(record, text_column, f"{path} line {number}")


def _json_array_documents(path: Path, text: str, text_column: str) -> Iterator[str]:
    try:
        records = json.loads(text)
    except ValueError as error:
        raise DataError(f"{path}: invalid JSON ({error})") from None
    for number, record in enumerate(records, 1):
        yield _text_of(record, text_column, f"{path} item {number}")


def _text_of(record: object, text_column: str, place: str) -> str:
    if not isinstance(record, dict):
        raise DataError(f"{place}: expected a JSON object with a {text_column!r} field, got {type(record).__name__}")
    if text_column not in record:
        raise DataError(f"{place}: no {text_column!r} field (it has {sorted(record)}); choose one with --text-column")
    return _checked_text(record[text_column], text_column, place)


def _checked_text(value: object, text_column: str, place: str) -> str:
    if value is None:
        return ""
    if not isinstance(value, str):
        raise DataError(f"{place}: {text_column!r} holds a {type(value).__name__}, not text")
    return value


def _parquet_documents(path: Path, text_column: str) -> Iterator[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as error:
        raise DataError(f"{path}: not a readable parquet file ({first_line(error)})") from None
    if text_column not in file.schema_arrow.names:
        columns = file.schema_arrow.names
        raise DataError(f"{path}: no {text_column!r} column (it has {columns}); choose one with --text-column")
    first_row = 0
    for group in range(file.num_row_groups):
        rows = file.metadata.row_group(group).num_rows
        place = f"{path} row group {group + 1} of {file.num_row_groups} (rows {first_row + 1}-{first_row + rows})"
        batches = file.iter_batches(_PARQUET_BATCH_ROWS, row_groups=[group], columns=[text_column])
        while True:
            try:
                batch = next(batches, None)
            except (pa.ArrowException, OSError) as error:
                raise DataError(f"{place}: damaged ({first_line(error)})") from None
            if batch is None:
                break
            for value in batch.column(0).to_pylist():
                yield _checked_text(value, text_column, place)
        first_row += rows


def _hub_documents(shard: Shard) -> Iterator[str]:
    source = shard.source
    stream = _hub_dataset(source.name, source.hub_config).shard(num_shards=source.hub_shards, index=shard.index)
    count = 0
    try:
        for record in stream:
            if count == 0 and source.text_column not in record:
                columns = sorted(record)
                raise DataError(f"{shard}: no {source.text_column!r} column (it has {columns}); use --text-column")
            yield _checked_text(record[source.text_column], source.text_column, f"{shard} row {count + 1}")
            count += 1
    except DataError:
        raise
    except Exception as error:  # whatever `datasets` or the network raised while reading this shard
        raise DataError(f"{shard}: unreadable after {count} documents ({first_line(error)})") from error


def first_line(error: BaseException) -> str:
    text = str(error).strip() or type(error).__name__
    return text.splitlines()[0]
