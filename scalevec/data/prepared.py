"""Prepared data: documents tokenised and packed once into fixed-length blocks, as nanoGPT, Megatron-LM and OLMo-core
store them: raw little-endian uint16 (uint32 for vocabularies over 65,536) token ids, one file per split
(`train.bin`, `eval.bin`), each document followed by the end-of-text token, the last partial block dropped.
`scalevec_data.json` says what the folder holds and how it was made; `tokenizer/` is the tokenizer that made it;
`held_out_digests.npy` names the held-out documents (so that a stream of the same source can leave them out). A part
of a preparation split across machines (`shard`) also keeps the tokens after its last block, in `train_tail.bin`.

Blocks are read with positioned reads (`os.pread`) through the page cache: the ranks of a node share one cached
copy, and a process holds only the blocks it is collating. (A memory map would do the same reads, but count every
page a long run touched as that process's memory.) The blocks of a batch are read with one read per run of
consecutive blocks, after telling the kernel about all of them (`POSIX_FADV_WILLNEED`), so that a batch of blocks
that are not in the page cache is read from the disk in parallel rather than one block after the other.

The held-out split is every `eval_every`-th document until `max_eval_documents` are held out; no training block
holds a held-out document or a copy of one (documents are compared by a 64-bit digest of their text).
"""

import hashlib
import json
import os
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, fields
from itertools import islice
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from .sources import DataError, Shard, read_documents

METADATA = "scalevec_data.json"
HELD_OUT_DIGESTS = "held_out_digests.npy"
TOKENIZER_FOLDER = "tokenizer"
TAIL = "train_tail.bin"
FORMAT = "scalevec-prepared-blocks"
FORMAT_VERSION = 1
DTYPES = ("uint16", "uint32")
DEFAULT_EVAL_EVERY = 20  # every n-th document held out
DEFAULT_MAX_EVAL_DOCUMENTS = 2000


@dataclass(frozen=True)
class PrepareOptions:
    """What decides the content of a prepared folder (besides the sources and the tokenizer)."""

    seq_len: int
    eval_every: int = DEFAULT_EVAL_EVERY
    max_eval_documents: int = DEFAULT_MAX_EVAL_DOCUMENTS
    max_documents: int | None = None


@dataclass
class SplitInfo:
    blocks: int = 0
    documents: int = 0  # non-empty documents written
    tokens: int = 0  # in whole blocks
    dropped_tokens: int = 0  # the last partial block
    bytes: int = 0  # UTF-8 bytes of the documents' text
    empty_documents: int = 0  # skipped: nothing to learn from


@dataclass
class PreparedMetadata:
    seq_len: int
    dtype: str
    eos_token_id: int
    vocab_size: int
    tokenizer_name: str
    tokenizer_fingerprint: str
    sources: list[str]
    options: dict
    splits: dict[str, SplitInfo] = field(default_factory=dict)
    format: str = FORMAT
    version: int = FORMAT_VERSION
    shard: list[int] | None = None  # [index, count] of a part of a preparation split across machines

    def to_json(self) -> str:
        values = asdict(self)
        if values["shard"] is None:  # as earlier versions wrote it, so that they read it
            del values["shard"]
        return json.dumps(values, indent=2) + "\n"

    @classmethod
    def read(cls, folder: Path) -> "PreparedMetadata":
        """The description of the prepared `folder`, its values checked (a `DataError` names the first bad one)."""
        path = folder / METADATA
        if not path.is_file():
            raise DataError(f"{folder}: no {METADATA}, so not a prepared folder (or one that lost its description)")
        try:
            values = json.loads(path.read_text(encoding="utf-8"))
            values["splits"] = {name: SplitInfo(**info) for name, info in values["splits"].items()}
            metadata = cls(**values)
        except (OSError, ValueError, TypeError, KeyError, AttributeError) as error:
            raise DataError(f"{path}: not a prepared-data description ({error})") from None
        if (metadata.format, metadata.version) != (FORMAT, FORMAT_VERSION):
            raise DataError(f"{folder}: prepared by another version of scalevec (format {metadata.version})")
        problem = metadata._problem()
        if problem:
            raise DataError(f"{path}: {problem}")
        return metadata

    def _problem(self) -> str | None:
        """What makes these values unusable, if anything."""
        if self.dtype not in DTYPES:
            return f"dtype {self.dtype!r} is none of {', '.join(DTYPES)}"
        numbers = {"seq_len": self.seq_len, "vocab_size": self.vocab_size, "eos_token_id": self.eos_token_id}
        for name, value in numbers.items():
            if type(value) is not int or value < (0 if name == "eos_token_id" else 2):
                return f"{name} {value!r} is not a valid number"
        if self.vocab_size > np.iinfo(self.dtype).max + 1:
            return f"a vocabulary of {self.vocab_size:,} tokens does not fit {self.dtype}"
        if self.eos_token_id >= self.vocab_size:
            return f"eos_token_id {self.eos_token_id} is not below vocab_size {self.vocab_size}"
        for name, info in self.splits.items():
            counts = [getattr(info, counter.name) for counter in fields(SplitInfo)]
            if not all(type(count) is int and count >= 0 for count in counts):
                return f"the {name!r} split's counts {counts} are not all numbers of at least 0"
            if info.tokens != info.blocks * self.seq_len:
                return f"the {name!r} split's {info.tokens:,} tokens are not {info.blocks:,} blocks of {self.seq_len}"
        return None


def split_file(folder: str | Path, split: str) -> Path:
    """The file of a prepared folder that holds the blocks of `split` ("train" or "eval")."""
    return Path(folder) / f"{split}.bin"


def is_prepared(path: str | Path) -> bool:
    return (Path(path) / METADATA).is_file()


def looks_prepared(path: str | Path) -> bool:
    """A folder holding what a preparation writes, with or without its description."""
    return split_file(path, "train").is_file() or (Path(path) / HELD_OUT_DIGESTS).is_file()


def tokenizer_fingerprint(tokenizer: PreTrainedTokenizerBase) -> str:
    """A digest of everything that decides how the tokenizer encodes text and which id ends a document."""
    if tokenizer.is_fast:
        content = tokenizer.backend_tokenizer.to_str()
    else:
        content = json.dumps(sorted(tokenizer.get_vocab().items()))
    return hashlib.sha256(f"{content}\n{tokenizer.eos_token_id}".encode()).hexdigest()[:16]


def document_digest(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode("utf-8"), digest_size=8).digest(), "little")


def documents_of(shards: Sequence[Shard], limit: int | None = None) -> Iterator[str]:
    """The documents of `shards` in order, the first `limit` of them."""
    documents = (text for shard in shards for text in read_documents(shard))
    return islice(documents, limit)


def held_out_documents(shards: Sequence[Shard], options: PrepareOptions) -> Iterator[str]:
    """Every `eval_every`-th document (among the first `max_documents`) until `max_eval_documents` are taken."""
    every, wanted = options.eval_every, options.max_eval_documents
    if not every or not wanted:
        return iter(())
    scanned = every * wanted if options.max_documents is None else min(every * wanted, options.max_documents)
    return islice(documents_of(shards, scanned), every - 1, None, every)


class PreparedBlocks(torch.utils.data.Dataset):
    """The blocks of one split of a prepared folder, `{"input_ids": array of seq_len token ids}` each."""

    def __init__(self, folder: str | Path, split: str = "train"):
        self._descriptor: tuple[int, int] | None = None  # (process id, file descriptor): reopened after a fork
        self.folder = Path(folder)
        self.metadata = PreparedMetadata.read(self.folder)
        if split not in self.metadata.splits:
            raise DataError(f"{self.folder}: holds no {split!r} split")
        self.split = split
        self.path = split_file(self.folder, split)
        self.dtype = np.dtype(self.metadata.dtype)
        self.seq_len = self.metadata.seq_len
        self.block_bytes = self.seq_len * self.dtype.itemsize
        self.num_blocks = self.metadata.splits[split].blocks
        problem = size_problem(self.path, self.num_blocks * self.block_bytes, f"{self.num_blocks:,} blocks")
        if problem:
            raise DataError(problem)

    def __len__(self) -> int:
        return self.num_blocks

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        return self.__getitems__([index])[0]

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, np.ndarray]]:
        """The blocks at `indices`, in that order: one read per run of consecutive blocks, the runs announced to
        the kernel first so that those not in the page cache are read from the disk together."""
        blocks = np.asarray(indices, dtype=np.int64)
        outside = (blocks < -self.num_blocks) | (blocks >= self.num_blocks)
        if outside.any():
            raise IndexError(f"block {blocks[outside][0]} of {self.num_blocks}")
        blocks %= max(self.num_blocks, 1)
        order = np.argsort(blocks, kind="stable")
        ordered = blocks[order]
        runs = np.split(np.arange(len(ordered)), np.flatnonzero(np.diff(ordered) != 1) + 1)
        descriptor = self._file()
        if len(runs) > 1:
            for run in runs:
                offset = int(ordered[run[0]]) * self.block_bytes
                os.posix_fadvise(descriptor, offset, len(run) * self.block_bytes, os.POSIX_FADV_WILLNEED)
        rows: list[dict[str, np.ndarray] | None] = [None] * len(blocks)
        for run in runs:
            first, size = int(ordered[run[0]]), len(run) * self.block_bytes
            data = os.pread(descriptor, size, first * self.block_bytes)
            if len(data) != size:
                raise DataError(f"{self.path}: ends before block {first + len(data) // self.block_bytes:,} (changed)")
            read = np.frombuffer(data, dtype=self.dtype).reshape(len(run), self.seq_len)
            for row, position in zip(read, order[run]):
                rows[position] = {"input_ids": row}
        return rows

    def _file(self) -> int:
        if self._descriptor is None or self._descriptor[0] != os.getpid():
            self._descriptor = (os.getpid(), os.open(self.path, os.O_RDONLY))
        return self._descriptor[1]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_descriptor": None}

    def __del__(self):
        if self._descriptor is not None and self._descriptor[0] == os.getpid():
            os.close(self._descriptor[1])


def size_problem(path: Path, expected: int, holding: str) -> str | None:
    """What is wrong with the size of `path`, which should hold `expected` bytes (`holding` says of what)."""
    size = path.stat().st_size if path.is_file() else None
    if size is None:
        return f"{path}: missing, where its {holding} should be"
    return None if size == expected else f"{path}: {size:,} bytes where its {holding} take {expected:,}"


def load_held_out_digests(folder: Path) -> set[int]:
    return {int(digest) for digest in np.load(folder / HELD_OUT_DIGESTS, allow_pickle=False)}
