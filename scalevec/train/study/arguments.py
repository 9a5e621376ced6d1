"""The flags of `scalevec-ablate` that set its grid and its report (`AblationArguments`), beside the training's own."""

from dataclasses import dataclass, field
from pathlib import Path

from ...run_records import read_json
from ...shards import parse_shard
from ..presets import SIZE_RULE
from .claims import MIN_EFFECT, QUANTIZATION_MARGIN
from .metric import LOSS
from .variants import VARIANT_GROUPS, VARIANTS

_GRID_FLAGS = ("sizes", "variants", "learning_rates", "seeds", "tokens_per_parameter")
DEFAULT_VARIANTS = "strategies"
RESULTS = "results.json"


@dataclass
class AblationArguments:
    variants: str | None = field(
        default=None,
        metadata={
            "help": f"Comma-separated variants {list(VARIANTS)} or groups {list(VARIANT_GROUPS)} (default: "
            f"{DEFAULT_VARIANTS})."
        },
    )
    seeds: str | None = field(default=None, metadata={"help": "Comma-separated seeds (default: --seed)."})
    sizes: str | None = field(
        default=None,
        metadata={"help": f"Comma-separated model sizes (default: --model-size): presets or {SIZE_RULE}."},
    )
    learning_rates: str | None = field(
        default=None,
        metadata={
            "help": "Comma-separated peak learning rates (default: --learning-rate); each size and variant is "
            "compared at its best one, chosen on the selection half of the held-out blocks."
        },
    )
    tokens_per_parameter: float | None = field(
        default=None,
        metadata={
            "help": "Train each size on this many tokens per non-embedding parameter N: --max-steps = "
            "ceil(R x N / tokens per step), per size. Instead of --max-steps."
        },
    )
    shard: str | None = field(
        default=None,
        metadata={
            "help": "I/N: train only the I-th of N disjoint shares of the grid (I from 0, as Slurm array task ids), "
            "the same on every machine; the report covers every finished run of the grid."
        },
    )
    metric: str = field(
        default=LOSS,
        metadata={
            "help": "The logged figure the claims are judged on: the held-out loss (its report half) by default, or "
            "another of the final evaluation's, e.g. eval_hellaswag_acc_norm (--eval-tasks); accuracies count "
            "higher as better. Learning rates are chosen on the held-out loss's selection half whatever it is."
        },
    )
    quantize: str | None = field(
        default=None,
        metadata={
            "help": "Comma-separated weight schemes (int8, int4; torchao): after each run, its final model is "
            "evaluated on the report half unquantized and with each scheme's weights (main process), and the claims "
            "gain a row per scheme and size: unified quantizes within --quantization-margin nats of standard."
        },
    )
    min_effect: float = field(
        default=MIN_EFFECT,
        metadata={
            "help": "The floor of a paired claim's effect, in the metric's units (nats of held-out loss, where 0.01 "
            "is 1 %% of perplexity; on an accuracy 0.01 is a point): a row holds (or is contradicted) only when its "
            "interval excludes 0 and its mean Δ lies beyond the floor; a smaller mean leaves it unresolved."
        },
    )
    quantization_margin: float = field(
        default=QUANTIZATION_MARGIN,
        metadata={
            "help": "The quantization rows' non-inferiority margin in nats: a row holds when unified's loss increase "
            "is within this margin of standard's (the 95 %% interval of their difference minus the margin lies "
            "below 0)."
        },
    )
    report_only: bool = field(
        default=False,
        metadata={
            "help": "Train nothing: write the report from the grid's run folders, and from the records of the "
            "folder's results.json for runs whose folders are gone. Without --sizes, --variants, --learning-rates, "
            "--seeds or --tokens-per-parameter, the grids results.json records (every call's), reported as one; "
            "with them, that grid alone."
        },
    )
    merge_records: str | None = field(
        default=None,
        metadata={
            "help": "Comma-separated results.json files (or the study folders holding them) of other shards of this "
            "study: their finished and diverged runs join the records of --output-dir (its own runs first), so "
            "--report-only reports them and --resume does not train them again."
        },
    )

    def variant_names(self) -> list[str]:
        names = []
        for name in _items(DEFAULT_VARIANTS if self.variants is None else self.variants):
            if name in VARIANT_GROUPS:
                names.extend(VARIANT_GROUPS[name])
            elif name in VARIANTS:
                names.append(name)
            else:
                choices = ", ".join([*VARIANT_GROUPS, *VARIANTS])
                raise ValueError(f"--variants: unknown {name!r}; choose from {choices}")
        if not names:
            raise ValueError("--variants: empty list")
        return list(dict.fromkeys(names))

    def seed_list(self, default: int) -> list[int]:
        if self.seeds is None:
            return [default]
        try:
            return list(dict.fromkeys(int(seed) for seed in _items(self.seeds)))
        except ValueError:
            raise ValueError(f"--seeds must be comma-separated integers; got {self.seeds!r}") from None

    def size_names(self, default: str) -> list[str]:
        names = list(dict.fromkeys(_items(self.sizes))) if self.sizes is not None else [default]
        if not names:
            raise ValueError("--sizes: empty list")
        return names

    def learning_rate_list(self, default: float) -> list[float]:
        if self.learning_rates is None:
            return [default]
        try:
            rates = list(dict.fromkeys(float(rate) for rate in _items(self.learning_rates)))
        except ValueError:
            rates = []
        if not rates or any(not rate >= 0 for rate in rates):  # `not >=` refuses NaN too
            raise ValueError(f"--learning-rates must be comma-separated numbers >= 0; got {self.learning_rates!r}")
        return rates

    def shard_index(self) -> tuple[int, int]:
        return (0, 1) if self.shard is None else parse_shard(self.shard)

    def grid_flags(self) -> list[str]:
        """The flags given that set the grid."""
        return [f"--{name.replace('_', '-')}" for name in _GRID_FLAGS if getattr(self, name) is not None]

    def merged_results(self) -> dict[Path, dict]:
        """Each --merge-records file (a study folder's results.json) as loaded, by its path."""
        results = {}
        for item in _items(self.merge_records or ""):
            path = Path(item) / RESULTS if Path(item).is_dir() else Path(item)
            loaded = read_json(path)
            if loaded is None or "runs" not in loaded:
                raise ValueError(f"--merge-records {item}: {path} is no study's results.json (missing or unreadable)")
            results[path] = loaded
        return results


def _items(text: str) -> list[str]:
    return [item.strip() for item in text.split(",") if item.strip()]
