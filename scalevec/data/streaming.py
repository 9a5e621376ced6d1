"""Streamed training blocks, for corpora too large to prepare (Hub datasets, remote parquet, any source).

A source's shards (files) stay visible as the shards of a `datasets.IterableDataset`, in an order seeded by the
run's seed. The work is split between the ranks before anything is tokenised: while every rank can have one, whole
shards are dealt in turn (shard k to rank k mod N, as `split_dataset_by_node` deals them); the windows of the last
(shard count mod N) shards are dealt in turn (window j of such a shard to rank j mod N), so N ranks tokenise the
stream once between them whatever the number of shards. The DataLoader's workers split a rank's share again.
A shard's documents are read in windows of `window` documents (at most 4 M characters); a window is tokenised,
packed into blocks (its last partial block dropped) and its blocks put in a seeded order. Each window is packed on
its own, so the blocks do not depend on which rank or worker reads them (the ranks' blocks together are one
process's), and the position in the stream (shard, window, block) is what `StatefulDataLoader.state_dict` saves:
resuming re-reads the documents of the current shard up to its window, tokenising only that window, and gives the
batches of the uninterrupted run.

Several sources are interleaved at random in proportion to their weights (seeded, resumable). The stream
never ends: after its last shard a rank starts again from its first, in the same order.
"""

import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import datasets
import numpy as np
from transformers import PreTrainedTokenizerBase

from .prepared import document_digest
from .sources import Shard, Source, read_documents
from .tokenization import DocumentEncoder, token_dtype

# A window is tokenised whole before its first block is read, at the start and after a resume: this bounds that
# wait (about a million tokens) whatever the documents' length.
WINDOW_CHARS = 1 << 22


@dataclass(frozen=True)
class RankShare:
    """The windows of one shard that a rank packs: every `step`-th, from the `offset`-th (all of them: step 1)."""

    shard: Shard
    step: int = 1
    offset: int = 0


def rank_shares(shards: Sequence[Shard], rank: int, world_size: int) -> list[RankShare]:
    """What rank `rank` of `world_size` reads: whole shards while every rank gets one, then its turn of the windows
    of the shards left over."""
    whole = len(shards) - len(shards) % world_size
    shares = [RankShare(shard) for shard in shards[rank:whole:world_size]]
    return shares + [RankShare(shard, world_size, rank) for shard in shards[whole:]]


def _windows(shares: list[RankShare], window: int, held_out: frozenset[int]) -> Iterator[dict]:
    """This rank's windows of up to `window` non-empty documents (and `WINDOW_CHARS` characters) of one shard at a
    time, held-out documents left out. The windows that are not this rank's are read but not tokenised."""
    for share in shares:
        for number, texts in enumerate(_shard_windows(share.shard, window, held_out)):
            if number % share.step == share.offset:
                yield {"texts": texts}


def _shard_windows(shard: Shard, window: int, held_out: frozenset[int]) -> Iterator[list[str]]:
    texts, chars = [], 0
    for text in read_documents(shard):
        if text and (not held_out or document_digest(text) not in held_out):
            texts.append(text)
            chars += len(text)
            if len(texts) == window or chars >= WINDOW_CHARS:
                yield texts
                texts, chars = [], 0
    if texts:
        yield texts


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
        shares = rank_shares(seeded_shards(source, seed), rank, world_size)
        windows = datasets.IterableDataset.from_generator(
            _windows,
            features=datasets.Features({"texts": datasets.List(datasets.Value("string"))}),
            gen_kwargs={"shares": shares, "window": window, "held_out": excluded},
        )
        blocks = windows.map(packer, batched=True, batch_size=1, remove_columns=["texts"], features=features)
        streams.append(blocks.repeat(None) if endless else blocks)
    if len(streams) == 1:
        return streams[0].with_format("numpy")
    probabilities = [weight / sum(weights) for weight in weights]
    mixed = datasets.interleave_datasets(streams, probabilities, seed=seed, stopping_strategy="all_exhausted")
    return mixed.with_format("numpy")
