"""A study's grid: model sizes (each with its token budget) x variants x learning rates x seeds, the run folder of
each point, and the split of the grid into shards. A study folder may hold several grids (calls with other sizes,
variants or rates, e.g. every variant at the largest size and a ladder of sizes for a few): `Grid.union` joins them
into one grid whose points are theirs, each (size, variant) with the learning rates of the grids that hold it."""

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from ...configuration_scalevec import ScaleVecConfig
from ...convert.meta_model import non_embedding_parameters
from ..presets import MODEL_SIZES, SIZE_FIELDS, size_fields


@dataclass
class Size:
    """One model size of the grid and the length of its runs."""

    name: str  # as given: a preset or LAYERSxHIDDEN
    preset: str  # the --model-size its runs pass
    config_overrides: str | None  # the --config-overrides its runs pass: its dimensions, then the user's
    fields: dict  # its ScaleVecConfig fields, the user's overrides included
    non_embedding_parameters: int  # N: no embedding, LM head or scale vector; the same for every variant
    max_steps: int  # <= 0: the runs last --num-train-epochs
    tokens_per_step: int

    @property
    def tokens_per_run(self) -> int | None:
        return self.max_steps * self.tokens_per_step if self.max_steps > 0 else None

    def describe(self) -> str:
        f = self.fields
        layers, heads, kv_heads = f["num_hidden_layers"], f["num_attention_heads"], f["num_key_value_heads"]
        experts = f", {f['num_experts']} experts of {f['moe_intermediate_size']}" if f.get("num_experts") else ""
        shape = (
            f"{layers} layer{'s' * (layers > 1)}, hidden {f['hidden_size']}, {heads} head{'s' * (heads > 1)} "
            f"({kv_heads} key-value), SwiGLU {f['intermediate_size']}{experts}"
        )
        budget = "runs of --num-train-epochs"
        if self.tokens_per_run:
            per_parameter = self.tokens_per_run / self.non_embedding_parameters
            budget = (
                f"{self.max_steps:,} steps x {self.tokens_per_step:,} tokens = {self.tokens_per_run:,} tokens a run "
                f"({per_parameter:.3g} a non-embedding parameter)"
            )
        return f"{self.name}: {shape}; N = {self.non_embedding_parameters:,} non-embedding parameters; {budget}"


def build_sizes(
    names: list[str],
    base: str,
    user: dict,
    tokens_per_step: int,
    tokens_per_parameter: float | None,
    max_steps: int,
) -> list[Size]:
    """The sizes `names` (presets or LAYERSxHIDDEN on the preset `base`, with the ScaleVecConfig fields `user` on
    top), each run for `tokens_per_parameter` x N tokens (rounded up to whole steps) or else `max_steps`."""
    if base not in MODEL_SIZES:
        raise ValueError(f"--model-size must be one of {', '.join(MODEL_SIZES)}; got {base!r}")
    sizes = []
    for name in names:
        try:
            fields = size_fields(name, base)
        except ValueError as error:
            raise ValueError(f"--sizes: {error}") from None
        dimensions = {} if name in MODEL_SIZES else {key: fields[key] for key in SIZE_FIELDS if key in fields}
        fields.update(user)
        n = non_embedding_parameters(ScaleVecConfig(**fields))
        steps = math.ceil(tokens_per_parameter * n / tokens_per_step) if tokens_per_parameter else max_steps
        overrides = json.dumps({**dimensions, **user}) if dimensions or user else None
        preset = name if name in MODEL_SIZES else base
        sizes.append(Size(name, preset, overrides, fields, n, steps, tokens_per_step))
    return sizes


@dataclass(frozen=True)
class GridPoint:
    size: str
    variant: str
    learning_rate: float
    seed: int

    def folder(self, root: Path) -> Path:
        """`SIZE/VARIANT-lrLR-seedSEED`: the same for a point whatever else the grid holds, so later calls with more
        sizes, variants, learning rates or seeds reuse it (--resume)."""
        return Path(root) / self.size / f"{self.variant}-lr{self.learning_rate:g}-seed{self.seed}"


@dataclass
class Grid:
    sizes: list[Size]
    variants: list[str]
    learning_rates: list[float]
    seeds: list[int]
    budgets: list[float] = field(default_factory=list)  # the fractions below 1 `--decay-at` branches from each run
    parts: list["Grid"] = field(default_factory=list)  # the grids a union joins (`Grid.union`); empty for one grid

    @classmethod
    def union(cls, grids: list["Grid"]) -> "Grid":
        """One grid of `grids` (their sizes must not contradict each other: `contradiction`): their points, sizes,
        variants, learning rates and seeds, each list in the order first met. A grid whose points another holds
        all of adds nothing and is dropped (of two equal ones, the earlier), so a call that repeats or widens the
        recorded grid gives a single grid, as before."""
        parts = [part for grid in grids for part in (grid.parts or [grid])]
        points = [set(part.points()) for part in parts]
        kept = [
            part
            for i, part in enumerate(parts)
            if not any(points[i] < theirs or (points[i] == theirs and j > i) for j, theirs in enumerate(points))
        ]
        if len(kept) == 1:
            return kept[0]
        sizes = {}
        for size in (size for part in kept for size in part.sizes):
            sizes.setdefault(size.name, size)
        sizes = sorted(sizes.values(), key=lambda size: size.non_embedding_parameters)  # the smallest first

        def joined(name: str) -> list:
            return list(dict.fromkeys(item for part in kept for item in getattr(part, name)))

        return cls(sizes, joined("variants"), joined("learning_rates"), joined("seeds"), joined("budgets"), kept)

    def holds(self, size: str, variant: str) -> bool:
        """Whether a grid of this one (itself, or a part of a union) trains `variant` at `size`."""
        return bool(self._holding(size, variant))

    def learning_rates_of(self, size: str, variant: str) -> list[float]:
        """The learning rates of the grids that hold (`size`, `variant`), in the order first met."""
        return list(dict.fromkeys(rate for part in self._holding(size, variant) for rate in part.learning_rates))

    def _holding(self, size: str, variant: str) -> list["Grid"]:
        return [part for part in self.parts or [self] if variant in part.variants and size in part.size_names()]

    def size_names(self) -> list[str]:
        return [size.name for size in self.sizes]

    def points(self) -> list[GridPoint]:
        """Smallest size first as given, then seed, learning rate and variant: the order runs train in; a union's,
        each grid's in turn (a point two hold, once)."""
        if self.parts:
            return list(dict.fromkeys(point for part in self.parts for point in part.points()))
        return [
            GridPoint(size.name, variant, learning_rate, seed)
            for size in self.sizes
            for seed in self.seeds
            for learning_rate in self.learning_rates
            for variant in self.variants
        ]

    def shard(self, index: int, count: int) -> list[GridPoint]:
        """Every `count`-th point from the `index`-th: disjoint shares that cover the grid, the same on every machine,
        each holding an even share (within one run) of every size."""
        return self.points()[index::count]

    def size(self, name: str) -> Size:
        return next(size for size in self.sizes if size.name == name)

    def describe(self) -> str:
        if self.parts:
            grids = "; ".join(part.describe() for part in self.parts)
            return f"{len(self.parts)} grids: {grids}; {len(self.points())} runs in all"
        counts = [
            (len(self.sizes), "size"),
            (len(self.variants), "variant"),
            (len(self.learning_rates), "learning rate"),
            (len(self.seeds), "seed"),
        ]
        factors = " x ".join(f"{count} {noun}{'s' * (count > 1)}" for count, noun in counts)
        return f"{factors} = {len(self.points())} runs"

    def contradiction(self, other: "Grid") -> str | None:
        """How `other` (a study's recorded grid) defines a size of this grid otherwise, or None: the records of a
        size name hold runs of one shape and length only."""
        theirs = {size.name: size for size in other.sizes}
        for ours in self.sizes:
            recorded = theirs.get(ours.name)
            if recorded is None:
                continue
            if recorded.fields != ours.fields:
                differ = sorted(
                    k for k in {*ours.fields, *recorded.fields} if ours.fields.get(k) != recorded.fields.get(k)
                )
                key = differ[0]
                return f"size {ours.name}: {key} {recorded.fields.get(key)} there, {ours.fields.get(key)} here"
            if (recorded.max_steps, recorded.tokens_per_step) != (ours.max_steps, ours.tokens_per_step):
                return (
                    f"size {ours.name}: runs of {recorded.max_steps:,} steps x {recorded.tokens_per_step:,} tokens "
                    f"there, {ours.max_steps:,} x {ours.tokens_per_step:,} here"
                )
        return None
