"""Preparing a folder of prepared data (prepared.py says what it holds): resumable after a kill, and splittable
across machines.

The folder is written into its staging folder (resumable.py) and renamed into place when complete. About every
`CHECKPOINT_SECONDS` the preparation flushes `train.bin` to the disk and saves its progress: the position in the
documents, the length of `train.bin`, the tokens of the partial block not written yet and the counts so far. A
preparation killed at any point and run again with the same sources (the same files, sizes and times), tokenizer and
options continues from the last save, and writes the bytes that an uninterrupted one writes.

`shard=(i, n)` prepares part i of n: the documents of a contiguous range of the files (balanced by size), with the
same held-out split in every part (each reads the start of the corpus to find it), and the tokens after its last
whole block in `train_tail.bin`. `combine` joins the n parts into the folder that one preparation makes, byte for
byte: the parts' token streams end to end, cut into blocks again.
"""

import errno
import hashlib
import json
import os
import shutil
import sys
import time
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, replace
from itertools import islice
from pathlib import Path
from typing import BinaryIO

import numpy as np
from transformers import PreTrainedTokenizerBase

from ..atomic import fsync_path, write_text_atomically
from .prepared import (
    FORMAT_VERSION,
    HELD_OUT_DIGESTS,
    METADATA,
    TAIL,
    TOKENIZER_FOLDER,
    PreparedMetadata,
    PrepareOptions,
    SplitInfo,
    document_digest,
    held_out_documents,
    load_held_out_digests,
    size_problem,
    tokenizer_fingerprint,
)
from .resumable import staged
from .sources import DataError, Shard, Source, read_documents
from .tokenization import CHARS_PER_CALL, DocumentEncoder, encode_in_order, token_dtype

CHECKPOINT_SECONDS = 2.0  # at most this much work (and one chunk) is done again after a kill
_CHUNK_DOCUMENTS = 512  # at most this many documents per encoding task
_FLUSH_TOKENS = 1 << 22  # tokens gathered before whole blocks are written out
_NO_KERNEL_COPY = (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL)


@dataclass
class _Counts:
    """What a chunk of documents adds to a split, and the position after its last document: (file, documents
    of that file read, documents read in all)."""

    position: tuple[int, int, int] | None = None
    documents: int = 0
    bytes: int = 0
    empty_documents: int = 0


class _BlockWriter:
    """Appends documents, each followed by `eos`, to a raw token file and keeps whole blocks only; `saved` (what
    `progress` returned) continues the file from there."""

    def __init__(self, path: Path, seq_len: int, dtype: np.dtype, eos: int, saved: dict | None = None):
        saved = saved or {}
        self.file = open(path, "r+b" if saved else "wb")  # noqa: SIM115 (closed by `close`)
        if saved:
            self.file.truncate(saved["bytes"])
            self.file.seek(saved["bytes"])
        self.seq_len, self.eos = seq_len, np.array([eos], dtype=dtype)
        self.pending: list[np.ndarray] = [np.array(saved.get("pending", []), dtype=dtype)]
        self.pending_tokens = len(self.pending[0])
        self.info = SplitInfo(**saved.get("info", {}))

    def add(self, documents: list[np.ndarray], counts: _Counts) -> None:
        self.info.documents += counts.documents
        self.info.bytes += counts.bytes
        self.info.empty_documents += counts.empty_documents
        for tokens in documents:
            self.pending += [tokens, self.eos]
            self.pending_tokens += len(tokens) + 1
        if self.pending_tokens >= _FLUSH_TOKENS:
            self._write_whole_blocks()

    def _write_whole_blocks(self) -> None:
        tokens = np.concatenate(self.pending)
        whole = len(tokens) // self.seq_len * self.seq_len
        self.file.write(tokens[:whole].tobytes())
        self.info.blocks += whole // self.seq_len
        self.info.tokens += whole
        self.pending, self.pending_tokens = [tokens[whole:]], len(tokens) - whole

    def progress(self) -> dict:
        """What continues this file from here, once it is on the disk."""
        self._write_whole_blocks()
        self.file.flush()
        os.fsync(self.file.fileno())
        return {"bytes": self.file.tell(), "pending": self.pending[0].tolist(), "info": asdict(self.info)}

    def close(self) -> np.ndarray:
        """Write the whole blocks left; the tokens after the last one."""
        self._write_whole_blocks()
        self.info.dropped_tokens = self.pending_tokens
        self.file.close()
        return self.pending[0]


def prepare(
    sources: Sequence[Source],
    tokenizer: PreTrainedTokenizerBase,
    options: PrepareOptions,
    output: str | Path,
    num_proc: int = 1,
    progress: bool = True,
    with_train: bool = True,
    shard: tuple[int, int] | None = None,
    wait: bool = False,
) -> PreparedMetadata:
    """Tokenise and pack `sources` (in order, as one corpus) into the prepared folder `output`, which must not
    exist; `with_train=False` prepares the held-out split alone (for a streamed source); `shard=(i, n)` prepares
    part i of n (see `combine`). The work of a killed preparation into `output` is continued; a live one is waited
    for (`wait`) or refused."""
    output = Path(output)
    if output.exists():
        raise DataError(f"{output} already exists (nothing is overwritten)")
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no eos_token: packing needs one between documents")
    if shard is not None and options.max_documents is not None:
        raise DataError("--shard prepares whole files: it cannot take --max-documents")
    files = [part for source in sources for part in source.shards()]
    train_files = files if shard is None else shard_files(files, *shard)
    what = {"sources": [source.identity() for source in sources], "tokenizer": tokenizer_fingerprint(tokenizer)}
    what |= {"options": asdict(options), "with_train": with_train, "shard": shard, "format": FORMAT_VERSION}
    with staged(output, _digest(what), wait) as staging:
        try:
            preparation = _Preparation(staging, tokenizer, options, num_proc, progress and with_train)
            names = [source.name for source in sources]
            metadata = preparation.run(names, files, train_files if with_train else None, shard)
            write_text_atomically(staging.path / METADATA, metadata.to_json())
        except DataError:  # the data must change before a preparation can succeed: nothing worth keeping
            staging.discard()
            raise
        staging.commit()
    return metadata


class _Preparation:
    def __init__(self, staging, tokenizer: PreTrainedTokenizerBase, options: PrepareOptions, num_proc, progress):
        self.staging, self.folder, self.tokenizer, self.options = staging, staging.path, tokenizer, options
        self.dtype = token_dtype(len(tokenizer))
        self.encoder, self.num_proc, self.progress = DocumentEncoder(tokenizer, self.dtype), num_proc, progress
        self.record = dict(staging.progress or {})

    def writer(self, name: str, saved: dict | None = None) -> _BlockWriter:
        return _BlockWriter(self.folder / name, self.options.seq_len, self.dtype, self.tokenizer.eos_token_id, saved)

    def run(self, names: list[str], files: list[Shard], train_files: list[Shard] | None, shard) -> PreparedMetadata:
        splits = {}
        if "held_out" not in self.record:
            self.record["held_out"] = self.held_out(files)
        if self.record["held_out"]:
            splits["eval"] = SplitInfo(**self.record["held_out"])
        if train_files is not None:
            splits["train"] = self.train(train_files, load_held_out_digests(self.folder), shard is not None)
        self.tokenizer.save_pretrained(self.folder / TOKENIZER_FOLDER)
        return PreparedMetadata(
            seq_len=self.options.seq_len,
            dtype=self.dtype.name,
            eos_token_id=self.tokenizer.eos_token_id,
            vocab_size=len(self.tokenizer),
            tokenizer_name=self.tokenizer.name_or_path,
            tokenizer_fingerprint=tokenizer_fingerprint(self.tokenizer),
            sources=names,
            options=asdict(self.options),
            splits=splits,
            shard=list(shard) if shard else None,
        )

    def held_out(self, files: list[Shard]) -> dict | None:
        """Write the held-out split and its documents' digests; its counts (None without one)."""
        digests: set[int] = set()

        def recorded(texts: Iterator[str]) -> Iterator[tuple[None, str]]:
            for text in texts:
                if text:
                    digests.add(document_digest(text))
                yield None, text

        info = None
        if self.options.eval_every and self.options.max_eval_documents:
            writer = self.writer("eval.bin")
            for _ in _write(recorded(held_out_documents(files, self.options)), set(), writer, self.encoder, 1):
                pass
            writer.close()
            fsync_path(self.folder / "eval.bin")
            info = asdict(writer.info)
        np.save(self.folder / HELD_OUT_DIGESTS, np.array(sorted(digests), dtype=np.uint64), allow_pickle=False)
        fsync_path(self.folder / HELD_OUT_DIGESTS)
        self.staging.save({"held_out": info})
        return info

    def train(self, files: list[Shard], held_out: set[int], keep_tail: bool) -> SplitInfo:
        saved, path = self.record.get("train"), self.folder / "train.bin"
        if saved and (not path.is_file() or path.stat().st_size < saved["bytes"]):
            saved = None  # not what was saved: start the split again
        writer = self.writer("train.bin", saved)
        start = tuple(saved["position"]) if saved else (0, 0, 0)
        documents = _documents_from(files, start, self.options.max_documents)
        if self.progress:
            documents = _with_progress(documents, start[2], resumed=saved is not None)
        last_save = time.monotonic()
        for position in _write(documents, held_out, writer, self.encoder, self.num_proc):
            if position is not None and time.monotonic() - last_save >= CHECKPOINT_SECONDS:
                self.staging.save({**self.record, "train": {**writer.progress(), "position": position}})
                last_save = time.monotonic()
        tail = writer.close()
        if writer.info.documents == 0:
            raise DataError(f"{', '.join(dict.fromkeys(file.source.name for file in files))}: every document is empty")
        if keep_tail:
            (self.folder / TAIL).write_bytes(tail.tobytes())
        return writer.info


def _documents_from(files: Sequence[Shard], start: tuple[int, int, int], limit: int | None) -> Iterator[tuple]:
    """(position after it, text) of each document from `start` on (see `_Counts`), the first `limit` in all."""
    first_file, first_document, read = start
    for index in range(first_file, len(files)):
        skipped = first_document if index == first_file else 0
        for number, text in enumerate(islice(read_documents(files[index]), skipped, None), skipped + 1):
            if limit is not None and read >= limit:
                return
            read += 1
            yield (index, number, read), text


def _write(documents: Iterator[tuple], held_out: set[int], writer: _BlockWriter, encoder, num_proc: int):
    """Encode the non-empty documents whose digests are not in `held_out`, and write them; yields the position
    after each chunk of documents written."""
    counted: deque[_Counts] = deque()  # the counts of the chunks given to the encoder, in order

    def chunks() -> Iterator[list[str]]:  # one call of the tokenizer each, where the documents are not longer
        texts, counts, chars = [], _Counts(), 0
        for position, text in documents:
            if texts and (len(texts) == _CHUNK_DOCUMENTS or chars + len(text) > CHARS_PER_CALL):
                counted.append(counts)
                yield texts
                texts, counts, chars = [], _Counts(), 0
            counts.position = position
            if not text:
                counts.empty_documents += 1
            elif not held_out or document_digest(text) not in held_out:
                counts.documents += 1
                counts.bytes += len(text.encode("utf-8"))
                texts.append(text)
                chars += len(text)
        counted.append(counts)
        yield texts

    for tokens in encode_in_order(chunks(), encoder, num_proc):
        counts = counted.popleft()
        writer.add(tokens, counts)
        yield counts.position


def _with_progress(documents: Iterator[tuple], done: int, resumed: bool) -> Iterator[tuple]:
    from tqdm.auto import tqdm

    if resumed:
        print(f"scalevec-data: continuing an interrupted preparation after {done:,} documents", file=sys.stderr)
    return tqdm(documents, desc="preparing", unit=" documents", file=sys.stderr, mininterval=2, initial=done)


def shard_files(files: Sequence[Shard], index: int, count: int) -> list[Shard]:
    """Part `index` of `count` of `files`: a contiguous range, the ranges balanced by the files' sizes (by their
    number for a Hub dataset), each of at least one file."""
    if not 0 <= index < count:
        raise DataError(f"--shard {index}/{count}: the part must be one of 0 to {count - 1}")
    if count > len(files):
        raise DataError(f"--shard {index}/{count}: the sources hold {len(files)} files, and a part whole files")
    sizes = [os.path.getsize(file.source.files[file.index]) if file.source.is_local else 1 for file in files]
    ends = np.cumsum(sizes)
    bounds = [0]
    for k in range(1, count):
        cut = int(np.searchsorted(ends, ends[-1] * k / count)) + 1
        bounds.append(min(max(cut, bounds[-1] + 1), len(files) - (count - k)))
    bounds.append(len(files))
    return list(files[bounds[index] : bounds[index + 1]])


def combine(parts: Sequence[str | Path], output: str | Path) -> PreparedMetadata:
    """Join the parts of a preparation split by `shard` (given in any order) into the prepared folder `output`:
    the folder that one preparation of all the files makes."""
    output = Path(output)
    if output.exists():
        raise DataError(f"{output} already exists (nothing is overwritten)")
    described = [(PreparedMetadata.read(Path(part)), Path(part)) for part in parts]
    for metadata, folder in described:
        if metadata.shard is None:
            raise DataError(f"{folder}: not a part of a preparation split with --shard")
    described.sort(key=lambda item: item[0].shard[0])
    (first, base), count = described[0], described[0][0].shard[1]
    if [metadata.shard for metadata, _ in described] != [[index, count] for index in range(count)]:
        given = ", ".join(f"{metadata.shard[0]}/{metadata.shard[1]}" for metadata, _ in described)
        raise DataError(f"the parts given are {given}: combining takes each part of one --shard i/n once")
    digests = (base / HELD_OUT_DIGESTS).read_bytes()
    for metadata, folder in described:
        for name in ("seq_len", "dtype", "vocab_size", "tokenizer_fingerprint", "sources", "options"):
            if getattr(metadata, name) != getattr(first, name):
                ours, theirs = getattr(metadata, name), getattr(first, name)
                raise DataError(f"{folder}: {name} {ours!r}, where {base} has {theirs!r}: parts of other preparations")
        held_out = (metadata.splits.get("eval"), (folder / HELD_OUT_DIGESTS).read_bytes())
        if held_out != (first.splits.get("eval"), digests):
            raise DataError(f"{folder}: another held-out split than {base}'s: not a part of the same preparation")
        itemsize, info = np.dtype(metadata.dtype).itemsize, metadata.splits["train"]
        for name, tokens in (("train.bin", info.tokens), (TAIL, info.dropped_tokens)):
            problem = size_problem(folder / name, tokens * itemsize, f"{tokens:,} tokens")
            if problem:
                raise DataError(problem)
    what = {"combined": [str(folder.resolve()) for _, folder in described]}
    with staged(output, _digest(what), wait=False) as staging:
        shutil.copytree(base / TOKENIZER_FOLDER, staging.path / TOKENIZER_FOLDER)
        for name in ("eval.bin", HELD_OUT_DIGESTS):
            if (base / name).exists():
                shutil.copyfile(base / name, staging.path / name)
        train, itemsize = SplitInfo(), np.dtype(first.dtype).itemsize
        with open(staging.path / "train.bin", "wb", buffering=0) as file:
            for metadata, folder in described:
                _append(folder / "train.bin", file)
                _append(folder / TAIL, file)
                for name in ("documents", "bytes", "empty_documents"):
                    setattr(train, name, getattr(train, name) + getattr(metadata.splits["train"], name))
            total = file.tell() // itemsize
            train.blocks = total // first.seq_len
            train.tokens = train.blocks * first.seq_len
            train.dropped_tokens = total - train.tokens
            file.truncate(train.tokens * itemsize)
        metadata = replace(first, shard=None, splits={**first.splits, "train": train})
        write_text_atomically(staging.path / METADATA, metadata.to_json())
        staging.commit()
    return metadata


def _append(source: Path, destination: BinaryIO) -> None:
    """Copy the file `source` to the end of the unbuffered `destination`, in the kernel where it can (no copy
    through this process, and none at all on a file system that shares blocks)."""
    with open(source, "rb") as file:
        left = os.fstat(file.fileno()).st_size
        try:
            while left and (copied := os.copy_file_range(file.fileno(), destination.fileno(), left)):
                left -= copied
        except OSError as error:
            if error.errno not in _NO_KERNEL_COPY:
                raise
        shutil.copyfileobj(file, destination, 1 << 24)  # the rest: all of it where the kernel cannot copy


def _digest(what: dict) -> str:
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]
