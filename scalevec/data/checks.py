"""Whether a prepared folder holds what its description says: what `scalevec-data info` checks (every time), and
training before its first step (the scan of the token ids once per version of each file).

The checks: `scalevec_data.json` is there and its values make sense (the dtype one of uint16 and uint32, counts that
add up), each split's file holds exactly its blocks (a part of a sharded preparation: also its tail), every token id
is below the vocabulary size, the held-out digests load, and the tokenizer loads and is the one that prepared the data.
"""

import contextlib
import hashlib
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from .corpus import cache_dir
from .prepared import (
    HELD_OUT_DIGESTS,
    TAIL,
    TOKENIZER_FOLDER,
    PreparedMetadata,
    size_problem,
    split_file,
    tokenizer_fingerprint,
)
from .resumable import unfinished_preparation
from .sources import DataError, first_line

_SCAN_TOKENS = 1 << 24  # token ids read at a time


def problems(folder: Path, scan_ids: bool = True, tokenizer: bool = True) -> list[str]:
    """One line per problem of the prepared `folder` (none: it is usable). Without `scan_ids` the token ids are
    not read; without `tokenizer` the tokenizer is not loaded."""
    if not folder.is_dir():
        return [unfinished_preparation(folder) or f"{folder}: no such folder"]
    try:
        metadata = PreparedMetadata.read(folder)
    except DataError as error:
        return [str(error)]
    found = []
    itemsize = np.dtype(metadata.dtype).itemsize
    for name, info in metadata.splits.items():
        path = split_file(folder, name)
        problem = size_problem(path, info.tokens * itemsize, f"{info.blocks:,} blocks")
        if problem is None and scan_ids:
            problem = id_problem(path, metadata)
        found += [problem] if problem else []
    if metadata.shard and "train" in metadata.splits:
        tail = metadata.splits["train"].dropped_tokens
        found += filter(None, [size_problem(folder / TAIL, tail * itemsize, f"{tail:,} tail tokens")])
    try:
        np.load(folder / HELD_OUT_DIGESTS, allow_pickle=False)
    except (OSError, ValueError) as error:
        found.append(f"{folder / HELD_OUT_DIGESTS}: unreadable ({first_line(error)})")
    if tokenizer:
        try:
            prepared_tokenizer(folder, metadata)
        except DataError as error:
            found.append(str(error))
    return found


def id_problem(path: Path, metadata: PreparedMetadata) -> str | None:
    """The first token id in `path` that is not below the vocabulary size, if there is one."""
    buffer = np.empty(_SCAN_TOKENS, dtype=metadata.dtype)
    start = 0
    with open(path, "rb", buffering=0) as file:
        while count := file.readinto(memoryview(buffer).cast("B")) // buffer.itemsize:
            ids = buffer[:count]
            if ids.max() >= metadata.vocab_size:
                at = start + int(np.argmax(ids >= metadata.vocab_size))
                value = int(ids[at - start])
                return (
                    f"{path}: token id {value:,} (block {at // metadata.seq_len:,}) is not below the vocabulary "
                    f"size {metadata.vocab_size:,}"
                )
            start += count
    return None


def prepared_tokenizer(folder: Path, metadata: PreparedMetadata | None = None) -> PreTrainedTokenizerBase:
    """The tokenizer that prepared `folder`, checked against its description."""
    metadata = metadata or PreparedMetadata.read(folder)
    path = folder / TOKENIZER_FOLDER
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as error:  # transformers raises many types for a missing or damaged tokenizer
        raise DataError(f"{path}: the tokenizer does not load ({first_line(error)})") from None
    if len(tokenizer) != metadata.vocab_size or tokenizer_fingerprint(tokenizer) != metadata.tokenizer_fingerprint:
        raise DataError(
            f"{path}: not the tokenizer that prepared the data ({len(tokenizer):,} tokens, fingerprint "
            f"{tokenizer_fingerprint(tokenizer)}; the data's: {metadata.vocab_size:,} tokens, fingerprint "
            f"{metadata.tokenizer_fingerprint})"
        )
    return tokenizer


def verify(folder: Path) -> None:
    """Refuse, in one line, a prepared folder that training cannot use: `problems` but the tokenizer (training
    loads its tokenizer itself). The token ids of a file are scanned once per version of it (its path, size and
    modification time, remembered in the cache): a 100 B-token folder takes minutes to scan."""
    found = problems(folder, scan_ids=False, tokenizer=False)
    if not found:
        metadata = PreparedMetadata.read(folder)
        for split in metadata.splits:
            path = split_file(folder, split)
            stamp = _scanned_stamp(path)
            if not stamp.exists():
                found += filter(None, [id_problem(path, metadata)])
                if not found:
                    _remember(stamp)
    if found:
        raise DataError(f"{folder} is not usable prepared data: {'; '.join(found)}")


def _scanned_stamp(path: Path) -> Path:
    stat = path.stat()
    version = f"{path.resolve()}\n{stat.st_dev}\n{stat.st_ino}\n{stat.st_size}\n{stat.st_mtime_ns}"
    return cache_dir() / "scanned" / hashlib.sha256(version.encode()).hexdigest()[:32]


def _remember(stamp: Path) -> None:
    with contextlib.suppress(OSError):  # a read-only cache: scan again next time
        stamp.parent.mkdir(parents=True, exist_ok=True)
        stamp.touch()
