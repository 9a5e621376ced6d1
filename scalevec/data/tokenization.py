"""Documents to token ids, in bounded memory and in parallel.

A document is encoded as ordinary text: a special token's string inside it (`<|endoftext|>`) stays text, so the
only end-of-text tokens in the data are the ones packing puts between documents. A long document is encoded in
pieces cut at line breaks, so memory depends on the piece length, not on the longest line of the corpus (a
tokenizer's encoding of one 200 MB line takes many GB); the tokens at a cut may differ from one whole encoding.
"""

import os
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from multiprocessing import get_all_start_methods, get_context

import numpy as np
from transformers import PreTrainedTokenizerBase

MAX_PIECE_CHARS = 1 << 18  # a document longer than this is encoded in pieces
CHARS_PER_CALL = 1 << 20  # characters per call of the tokenizer, whose encodings take ~250 bytes a token


def token_dtype(vocabulary_size: int) -> np.dtype:
    """uint16 where every id fits, else uint32."""
    return np.dtype(np.uint16 if vocabulary_size <= 1 << 16 else np.uint32)


def text_pieces(text: str, limit: int = MAX_PIECE_CHARS) -> list[str]:
    """`text` cut into pieces of at most `limit` characters, each ending at a line break where the piece has one
    (else at a space, else anywhere)."""
    pieces = []
    start = 0
    while len(text) - start > limit:
        end = start + limit
        newline = text.rfind("\n", start, end - 1)
        space = text.rfind(" ", start + 1, end)  # cut before the space: " word" stays one pre-token
        cut = newline + 1 if newline >= 0 else space if space > 0 else end
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


class DocumentEncoder:
    """Encodes documents to arrays of token ids (`dtype`), with the tokenizer's Rust batch encoder where it is a
    fast tokenizer (which runs on every core)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, dtype: np.dtype):
        self.tokenizer = tokenizer
        self.dtype = dtype
        self.backend = None
        if tokenizer.is_fast:
            from tokenizers import Tokenizer

            self.backend = Tokenizer.from_str(tokenizer.backend_tokenizer.to_str())
            self.backend.encode_special_tokens = True

    def __call__(self, texts: Sequence[str]) -> list[np.ndarray]:
        pieces_of = [text_pieces(text) for text in texts]
        flat = [piece for pieces in pieces_of for piece in pieces]
        encoded: list[np.ndarray] = []
        start = 0
        while start < len(flat):
            end, chars = start, 0
            while end < len(flat) and (end == start or chars + len(flat[end]) <= CHARS_PER_CALL):
                chars += len(flat[end])
                end += 1
            encoded.extend(np.asarray(ids, dtype=self.dtype) for ids in self._ids(flat[start:end]))
            start = end
        documents, position = [], 0
        for pieces in pieces_of:
            parts = encoded[position : position + len(pieces)]
            documents.append(parts[0] if len(parts) == 1 else np.concatenate(parts))
            position += len(pieces)
        return documents

    def _ids(self, pieces: list[str]) -> list[list[int]]:
        if self.backend is not None:  # `_fast`: the same ids, without the character offsets nobody here reads
            return [encoding.ids for encoding in self.backend.encode_batch_fast(pieces, add_special_tokens=False)]
        return self.tokenizer(pieces, add_special_tokens=False, split_special_tokens=True)["input_ids"]


_worker_encoder: DocumentEncoder | None = None  # each pool process's own encoder, set once when it starts


def _start_worker(encoder: DocumentEncoder) -> None:
    global _worker_encoder
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread per process: the pool is the parallelism
    _worker_encoder = encoder


def _encode_in_worker(texts: list[str]) -> list[np.ndarray]:
    return _worker_encoder(texts)


def encode_in_order(
    chunks: Iterable[list[str]], encoder: DocumentEncoder, num_proc: int = 1
) -> Iterator[list[np.ndarray]]:
    """`encoder(chunk)` for every chunk, in order, with at most two chunks per worker in flight: in one thread
    beside this one (the fast tokenizer's Rust threads use every core and release the interpreter, so reading the
    next documents and writing the last tokens overlap with them) or in `num_proc` processes."""
    if num_proc <= 1:
        with ThreadPoolExecutor(1) as pool:
            yield from _in_order(pool, encoder, chunks, 2)
        return
    context = get_context("fork" if "fork" in get_all_start_methods() else "spawn")
    with ProcessPoolExecutor(num_proc, context, initializer=_start_worker, initargs=(encoder,)) as pool:
        yield from _in_order(pool, _encode_in_worker, chunks, 2 * num_proc)


def _in_order(pool: Executor, work, chunks: Iterable[list[str]], in_flight: int) -> Iterator[list[np.ndarray]]:
    pending: deque[Future] = deque()
    for chunk in chunks:
        pending.append(pool.submit(work, chunk))
        if len(pending) >= in_flight:
            yield pending.popleft().result()
    while pending:
        yield pending.popleft().result()
