"""The order in which training reads blocks, in memory that does not grow with the corpus.

A seeded permutation of `[0, n)` is computed position by position, never stored: a Feistel network (six rounds of
a 64-bit mixing function, keyed by the seed and the epoch) is a bijection of `[0, 4^h)`, and cycle walking (apply
it again while the result is `>= n`) restricts it to `[0, n)`. Any stretch of the order costs time and memory in
proportion to its length, so a sampler over 50 M blocks holds a few numbers where a stored permutation
(`torch.randperm(n).tolist()`, the Trainer's `RandomSampler`) holds ~36 bytes a block, and a resumed run starts at
its position without computing what came before it.

The same permutation, with a fixed key, picks the held-out blocks an evaluation reads (`evaluation_blocks`).
"""

from collections.abc import Iterator

import numpy as np
import torch

_ROUNDS = 6
_CHUNK = 1 << 16  # positions computed at a time while iterating
_GOLDEN, _MIX1, _MIX2 = np.uint64(0x9E3779B97F4A7C15), np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
EVALUATION_SEED = 0  # the key of the held-out subset: the same blocks for every run on the same held-out data


class BlockPermutation:
    """A seeded bijection of `[0, size)`, evaluated on any array of positions."""

    def __init__(self, size: int, seed: int, epoch: int = 0):
        if size < 0:
            raise ValueError(f"size must be at least 0; got {size}")
        self.size = size
        self.half_bits = max(1, (max(size - 1, 1).bit_length() + 1) // 2)
        self.mask = np.uint64((1 << self.half_bits) - 1)
        self.keys = np.random.SeedSequence([seed, epoch]).generate_state(_ROUNDS, dtype=np.uint64)

    def __call__(self, positions: np.ndarray) -> np.ndarray:
        """The permuted index of each position in `positions` (each in `[0, size)`), as int64."""
        values = self._feistel(np.asarray(positions, dtype=np.uint64))
        outside = np.flatnonzero(values >= self.size)
        while len(outside):  # cycle walking: each position leaves the range with probability < 3/4
            values[outside] = self._feistel(values[outside])
            outside = outside[values[outside] >= self.size]
        return values.astype(np.int64)

    def _feistel(self, values: np.ndarray) -> np.ndarray:
        shift = np.uint64(self.half_bits)
        left, right = values >> shift, values & self.mask
        for key in self.keys:
            left, right = right, left ^ (_mix(right ^ key) & self.mask)
        return (left << shift) | right


def _mix(values: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: every input bit changes about half of the output bits."""
    values = values * _GOLDEN
    values = (values ^ (values >> np.uint64(30))) * _MIX1
    values = (values ^ (values >> np.uint64(27))) * _MIX2
    return values ^ (values >> np.uint64(31))


def evaluation_blocks(size: int, count: int) -> np.ndarray:
    """`count` of the `size` held-out blocks, in ascending order: the first `count` positions of a permutation with
    a fixed key, so a smaller budget's blocks are part of a larger one's, whatever the run's seed or process count."""
    count = min(count, size)
    return np.sort(BlockPermutation(size, EVALUATION_SEED)(np.arange(count)))


class ShuffledBlockSampler(torch.utils.data.Sampler[int]):
    """The training order: a permutation of the blocks for each epoch (keyed by the seed and the epoch), read from
    position `start`. Each epoch is a whole number of global batches (`global_batch`: blocks per step over all
    processes, without accumulation): the few blocks left over, different ones each epoch, wait for a later epoch,
    as Megatron-LM drops them. So no process pads its last batch with blocks from the epoch's start, and a run
    resumed at any step reads exactly the blocks of the uninterrupted run; two processes with batches of 4 read
    the blocks of one process with batches of 8 (accelerate deals out the batches of this one order)."""

    def __init__(self, size: int, seed: int, global_batch: int = 1, start: int = 0):
        self.size, self.seed, self.global_batch = size, seed, global_batch
        self.epoch = 0
        # Fewer blocks than one global batch: read them all, as the stock sampler would.
        self.per_epoch = size - size % global_batch if size >= global_batch else size
        if not 0 <= start <= self.per_epoch:
            raise ValueError(f"start {start} is outside the {self.per_epoch} positions of an epoch")
        self.start = start

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def resumed(self, start: int) -> "ShuffledBlockSampler":
        """The same order from position `start` of the current epoch."""
        sampler = ShuffledBlockSampler(self.size, self.seed, self.global_batch, start)
        sampler.set_epoch(self.epoch)
        return sampler

    @property
    def whole_batches(self) -> bool:
        """True when every epoch is a whole number of global batches (always, unless the data hold fewer blocks)."""
        return self.per_epoch % self.global_batch == 0

    def __len__(self) -> int:
        return self.per_epoch - self.start

    def __iter__(self) -> Iterator[int]:
        permutation = BlockPermutation(self.size, self.seed, self.epoch)
        for first in range(self.start, self.per_epoch, _CHUNK):
            yield from permutation(np.arange(first, min(first + _CHUNK, self.per_epoch))).tolist()
