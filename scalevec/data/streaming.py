"""Streamed training blocks, for corpora too large to prepare (Hub datasets, remote parquet, any source).

A source's shards (files) stay visible as the shards of a `datasets.IterableDataset`, in an order seeded by the
run's seed: each rank reads its own shards (every rank reads every shard and keeps every N-th window where the
shard count is not a multiple of the number of ranks), and the DataLoader's workers split a rank's shards again.
A shard's documents are read in windows of `window` documents (at most 4 M characters); a window is tokenised,
packed into blocks (its last partial block dropped) and its blocks put in a seeded order. Each window is packed on
its own, so the blocks do not depend on which rank or worker reads them, and the position in the stream (shard,
window, block) is what `StatefulDataLoader.state_dict` saves: resuming re-reads the documents of the current shard
up to its window, tokenising only that window, and gives the batches of the uninterrupted run.

Several sources are interleaved at random in proportion to their weights (seeded, resumable). The stream
never ends: after its last shard a rank starts again from its first, in the same order.
"""

import zlib
from collections.abc import Iterator, Sequence

import datasets
import numpy as np
from datasets.distributed import split_dataset_by_node
from transformers import PreTrainedTokenizerBase

from .prepared import document_digest
from .sources import Shard, Source, read_documents
from .tokenization import DocumentEncoder, token_dtype

# A window is tokenised whole before its first block is read, at the start and after a resume: this bounds that
# wait (about a million tokens) whatever the documents' length.
WINDOW_CHARS = 1 << 22


def _windows(shards: list[Shard], window: int, held_out: frozenset[int]) -> Iterator[dict]:
    """Windows of up to `window` non-empty documents (and `WINDOW_CHARS` characters) of one shard at a time,
    held-out documents left out."""
    for shard in shards:
        texts, chars = [], 0
        for text in read_documents(shard):
            if text and (not held_out or document_digest(text) not in held_out):
                texts.append(text)
                chars += len(text)
                if len(texts) == window or chars >= WINDOW_CHARS:
                    yield {"texts": texts}
                    texts, chars = [], 0
        if texts:
            yield {"texts": texts}


class WindowPacker:
    """Tokenises one window of documents, packs it into blocks and orders them by a seed and the window's
    content (so that the order is the same whoever packs the window, and again on resume)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, seq_len: int, seed: int):
        self.dtype = token_dtype(len(tokenizer))
        self.encoder = DocumentEncoder(tokenizer, self.dtype)
        self.eos = np.array([tokenizer.eos_token_id], dtype=self.dtype)
        self.seq_len, self.seed = seq_len, seed

    def __call__(self, batch: dict[str, list]) -> dict[str, list[np.ndarray]]:
        texts = batch["texts"][0]
        tokens = np.concatenate([part for ids in self.encoder(texts) for part in (ids, self.eos)])
        count = len(tokens) // self.seq_len
        blocks = tokens[: count * self.seq_len].reshape(count, self.seq_len)
        order = np.random.default_rng([self.seed, zlib.crc32(texts[0].encode("utf-8"))]).permutation(count)
        return {"input_ids": list(blocks[order])}


def seeded_shards(source: Source, seed: int) -> list[Shard]:
    shards = source.shards()
    return [shards[index] for index in np.random.default_rng(seed).permutation(len(shards))]


def streamed_blocks(
    sources: Sequence[Source],
    weights: Sequence[float],
    tokenizer: PreTrainedTokenizerBase,
    seq_len: int,
    seed: int,
    window: int,
    held_out: Sequence[frozenset[int]],
    rank: int = 0,
    world_size: int = 1,
    endless: bool = True,
) -> datasets.IterableDataset:
    """This rank's stream of `{"input_ids": block}`: the sources interleaved by `weights`, each without the
    documents whose digests are in its `held_out`; endless, or one pass over each source."""
    packer = WindowPacker(tokenizer, seq_len, seed)
    features = datasets.Features({"input_ids": datasets.List(datasets.Value(packer.dtype.name), length=seq_len)})
    streams = []
    for source, excluded in zip(sources, held_out):
        windows = datasets.IterableDataset.from_generator(
            _windows,
            features=datasets.Features({"texts": datasets.List(datasets.Value("string"))}),
            gen_kwargs={"shards": seeded_shards(source, seed), "window": window, "held_out": excluded},
        )
        windows = split_dataset_by_node(windows, rank, world_size)
        blocks = windows.map(packer, batched=True, batch_size=1, remove_columns=["texts"], features=features)
        streams.append(blocks.repeat(None) if endless else blocks)
    if len(streams) == 1:
        return streams[0].with_format("numpy")
    probabilities = [weight / sum(weights) for weight in weights]
    mixed = datasets.interleave_datasets(streams, probabilities, seed=seed, stopping_strategy="all_exhausted")
    return mixed.with_format("numpy")
