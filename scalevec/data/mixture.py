"""A weighted mixture of block datasets, as one map-style dataset for the Trainer's seeded sampler.

The mixture holds as many blocks as its sources together; source k fills `round(w_k · total)` of them. A source
with fewer places than blocks is thinned evenly (every block is as likely to be used: place j takes block
`j · n_k // places_k`); one with more places than blocks repeats in order. The sampler's permutation then makes any
stretch of the run draw from each source in proportion to its weight, deterministically for the seed, and a
resumed run skips batches by index as for a single source. Memory is a few numbers per source.
"""

import bisect
from collections.abc import Sequence

import torch


def places(total: int, weights: Sequence[float]) -> list[int]:
    """Largest-remainder rounding of `weights` (normalised) times `total`, summing to `total`."""
    weight_sum = sum(weights)
    exact = [total * weight / weight_sum for weight in weights]
    counts = [int(value) for value in exact]
    by_remainder = sorted(range(len(exact)), key=lambda k: exact[k] - counts[k], reverse=True)
    for k in by_remainder[: total - sum(counts)]:
        counts[k] += 1
    return counts


class WeightedMixture(torch.utils.data.Dataset):
    def __init__(self, sources: Sequence[torch.utils.data.Dataset], weights: Sequence[float]):
        self.sources = list(sources)
        self.sizes = [len(source) for source in self.sources]
        self.places = places(sum(self.sizes), weights)
        self.starts = [0]
        for count in self.places:
            self.starts.append(self.starts[-1] + count)

    def __len__(self) -> int:
        return self.starts[-1]

    def locate(self, index: int) -> tuple[int, int]:
        """(source, block) of the mixture's block `index`."""
        if not 0 <= index < len(self):
            raise IndexError(f"block {index} of {len(self)}")
        k = bisect.bisect_right(self.starts, index) - 1
        place, size, count = index - self.starts[k], self.sizes[k], self.places[k]
        return k, place * size // count if count <= size else place % size

    def __getitem__(self, index: int) -> dict:
        k, block = self.locate(index)
        return self.sources[k][block]

    def __getitems__(self, indices: list[int]) -> list[dict]:
        return [self[index] for index in indices]
