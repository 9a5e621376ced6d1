"""A study's grid: model sizes (each with its token budget) x variants x learning rates x seeds, the run folder of
each point, and the split of the grid into shards."""

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

    def points(self) -> list[GridPoint]:
        """Smallest size first as given, then seed, learning rate and variant: the order runs train in."""
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
