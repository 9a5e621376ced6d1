"""Prepared data: documents tokenised and packed once into fixed-length blocks, as nanoGPT, Megatron-LM and OLMo-core
store them: raw little-endian uint16 (uint32 for vocabularies over 65,536) token ids, one file per split
(`train.bin`, `eval.bin`), each document followed by the end-of-text token, the last partial block dropped.
`scalevec_data.json` says what the folder holds and how it was made; `tokenizer/` is the tokenizer that made it;
`held_out_digests.npy` names the held-out documents (so that a stream of the same source can leave them out).

Blocks are read with positioned reads (`os.pread`) through the page cache: the ranks of a node share one cached
copy, and a process holds only the blocks it is collating. (A memory map would do the same reads, but count every
page a long run touched as that process's memory.)

The held-out split is every `eval_every`-th document until `max_eval_documents` are held out; no training block
holds a held-out document or a copy of one (documents are compared by a 64-bit digest of their text).
"""

import hashlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field
from itertools import islice
from pathlib import Path

import numpy as np
import torch
from transformers import PreTrainedTokenizerBase

from ..atomic import commit_folder, write_text_atomically
from .sources import DataError, Shard, Source, read_documents
from .tokenization import DocumentEncoder, encode_in_order, token_dtype

METADATA = "scalevec_data.json"
HELD_OUT_DIGESTS = "held_out_digests.npy"
TOKENIZER_FOLDER = "tokenizer"
FORMAT = "scalevec-prepared-blocks"
FORMAT_VERSION = 1
_CHUNK_DOCUMENTS = 512  # documents per encoding task
_FLUSH_TOKENS = 1 << 22  # tokens gathered before whole blocks are written out


@dataclass(frozen=True)
class PrepareOptions:
    """What decides the content of a prepared folder (besides the sources and the tokenizer)."""

    seq_len: int
    eval_every: int = 20
    max_eval_documents: int = 2000
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

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2) + "\n"

    @classmethod
    def read(cls, folder: Path) -> "PreparedMetadata":
        try:
            values = json.loads((folder / METADATA).read_text(encoding="utf-8"))
            values["splits"] = {name: SplitInfo(**info) for name, info in values["splits"].items()}
            metadata = cls(**values)
        except (OSError, ValueError, TypeError, KeyError) as error:
            raise DataError(f"{folder / METADATA}: not a prepared-data description ({error})") from None
        if (metadata.format, metadata.version) != (FORMAT, FORMAT_VERSION):
            raise DataError(f"{folder}: prepared by another version of scalevec (format {metadata.version})")
        return metadata

    def bytes_per_token(self, split: str) -> float | None:
        info = self.splits.get(split)
        return info.bytes / (info.tokens + info.dropped_tokens) if info and info.tokens else None


def is_prepared(path: str | Path) -> bool:
    return (Path(path) / METADATA).is_file()


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


class _BlockWriter:
    """Appends documents, each followed by `eos`, to a raw token file and keeps whole blocks only."""

    def __init__(self, path: Path, seq_len: int, dtype: np.dtype, eos: int):
        self.file = open(path, "wb")  # noqa: SIM115 (closed by `close`)
        self.seq_len, self.eos = seq_len, np.array([eos], dtype=dtype)
        self.pending: list[np.ndarray] = []
        self.pending_tokens = 0
        self.info = SplitInfo()

    def add(self, documents: list[np.ndarray]) -> None:
        for tokens in documents:
            self.pending += [tokens, self.eos]
            self.pending_tokens += len(tokens) + 1
        if self.pending_tokens >= _FLUSH_TOKENS:
            self._write_whole_blocks()

    def _write_whole_blocks(self) -> None:
        tokens = np.concatenate(self.pending) if self.pending else np.empty(0, self.eos.dtype)
        whole = len(tokens) // self.seq_len * self.seq_len
        self.file.write(tokens[:whole].tobytes())
        self.info.blocks += whole // self.seq_len
        self.info.tokens += whole
        self.pending, self.pending_tokens = [tokens[whole:]], len(tokens) - whole

    def close(self) -> SplitInfo:
        self._write_whole_blocks()
        self.info.dropped_tokens = self.pending_tokens
        self.file.close()
        return self.info


def _write_split(texts: Iterator[str], writer: _BlockWriter, encoder: DocumentEncoder, num_proc: int) -> SplitInfo:
    """Encode the non-empty `texts` and write them; what was written."""

    def chunks() -> Iterator[list[str]]:
        chunk = []
        for text in texts:
            if not text:
                writer.info.empty_documents += 1
                continue
            writer.info.documents += 1
            writer.info.bytes += len(text.encode("utf-8"))
            chunk.append(text)
            if len(chunk) == _CHUNK_DOCUMENTS:
                yield chunk
                chunk = []
        if chunk:
            yield chunk

    for tokens in encode_in_order(chunks(), encoder, num_proc):
        writer.add(tokens)
    return writer.close()


def prepare(
    sources: Sequence[Source],
    tokenizer: PreTrainedTokenizerBase,
    options: PrepareOptions,
    output: str | Path,
    num_proc: int = 1,
    progress: bool = True,
    with_train: bool = True,
) -> PreparedMetadata:
    """Tokenise and pack `sources` (in order, as one corpus) into the prepared folder `output`, which must not
    exist; `with_train=False` prepares the held-out split alone (for a streamed source). The folder is written
    into a staging folder beside it and renamed into place when complete."""
    output = Path(output)
    if output.exists():
        raise DataError(f"{output} already exists (nothing is overwritten)")
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no eos_token: packing needs one between documents")
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=output.parent, prefix=f".{output.name}.staging-"))
    try:
        metadata = _prepare_into(staging, sources, tokenizer, options, num_proc, progress and with_train, with_train)
        commit_folder(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return metadata


def _prepare_into(staging, sources, tokenizer, options, num_proc, progress, with_train) -> PreparedMetadata:
    dtype = token_dtype(len(tokenizer))
    encoder = DocumentEncoder(tokenizer, dtype)
    shards = [shard for source in sources for shard in source.shards()]
    eos = tokenizer.eos_token_id
    digests: set[int] = set()

    def recorded(texts: Iterator[str]) -> Iterator[str]:
        for text in texts:
            if text:
                digests.add(document_digest(text))
            yield text

    splits = {}
    if options.eval_every and options.max_eval_documents:
        eval_writer = _BlockWriter(staging / "eval.bin", options.seq_len, dtype, eos)
        splits["eval"] = _write_split(recorded(held_out_documents(shards, options)), eval_writer, encoder, num_proc)
    np.save(staging / HELD_OUT_DIGESTS, np.array(sorted(digests), dtype=np.uint64), allow_pickle=False)
    if with_train:
        texts = documents_of(shards, options.max_documents)
        if digests:
            texts = (text for text in texts if not text or document_digest(text) not in digests)
        train_writer = _BlockWriter(staging / "train.bin", options.seq_len, dtype, eos)
        splits["train"] = _write_split(_with_progress(texts, progress), train_writer, encoder, num_proc)
        if splits["train"].documents == 0:
            raise DataError(f"{', '.join(source.name for source in sources)}: every document is empty")
    tokenizer.save_pretrained(staging / TOKENIZER_FOLDER)
    metadata = PreparedMetadata(
        seq_len=options.seq_len,
        dtype=dtype.name,
        eos_token_id=eos,
        vocab_size=len(tokenizer),
        tokenizer_name=tokenizer.name_or_path,
        tokenizer_fingerprint=tokenizer_fingerprint(tokenizer),
        sources=[source.name for source in sources],
        options=asdict(options),
        splits=splits,
    )
    write_text_atomically(staging / METADATA, metadata.to_json())
    return metadata


def _with_progress(texts: Iterator[str], enabled: bool) -> Iterator[str]:
    if not enabled:
        return texts
    from tqdm.auto import tqdm

    return tqdm(texts, desc="preparing", unit=" documents", file=sys.stderr, mininterval=2)


class PreparedBlocks(torch.utils.data.Dataset):
    """The blocks of one split of a prepared folder, `{"input_ids": array of seq_len token ids}` each."""

    def __init__(self, folder: str | Path, split: str = "train"):
        self._descriptor: tuple[int, int] | None = None  # (process id, file descriptor): reopened after a fork
        self.folder = Path(folder)
        self.metadata = PreparedMetadata.read(self.folder)
        if split not in self.metadata.splits:
            raise DataError(f"{self.folder}: holds no {split!r} split")
        self.split = split
        self.path = self.folder / f"{split}.bin"
        self.dtype = np.dtype(self.metadata.dtype)
        self.block_bytes = self.metadata.seq_len * self.dtype.itemsize
        self.num_blocks = self.metadata.splits[split].blocks
        size, expected = (self.path.stat().st_size if self.path.exists() else 0), self.num_blocks * self.block_bytes
        if size != expected:
            raise DataError(f"{self.path}: {size:,} bytes where its {self.num_blocks:,} blocks take {expected:,}")
        self._descriptor: tuple[int, int] | None = None  # (process id, file descriptor): reopened after a fork

    def __len__(self) -> int:
        return self.num_blocks

    def __getitem__(self, index: int) -> dict[str, np.ndarray]:
        if not -self.num_blocks <= index < self.num_blocks:
            raise IndexError(f"block {index} of {self.num_blocks}")
        index %= self.num_blocks
        data = os.pread(self._file(), self.block_bytes, index * self.block_bytes)
        return {"input_ids": np.frombuffer(data, dtype=self.dtype)}

    def __getitems__(self, indices: list[int]) -> list[dict[str, np.ndarray]]:
        return [self[index] for index in indices]

    def _file(self) -> int:
        if self._descriptor is None or self._descriptor[0] != os.getpid():
            self._descriptor = (os.getpid(), os.open(self.path, os.O_RDONLY))
        return self._descriptor[1]

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_descriptor": None}

    def __del__(self):
        if self._descriptor is not None and self._descriptor[0] == os.getpid():
            os.close(self._descriptor[1])


def load_held_out_digests(folder: Path) -> set[int]:
    return {int(digest) for digest in np.load(folder / HELD_OUT_DIGESTS, allow_pickle=False)}
