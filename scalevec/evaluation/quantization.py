"""Weight-only quantization with torchao, and what it costs: the differences of a quantized model's held-out loss
and task scores from the unquantized one's.

Only the linear maps (`nn.Linear`) of the decoder layers are quantized; the embeddings and the output head stay as
they are, as weight-only recipes (GPTQ, AWQ) leave them, so a tied head is never split from its embedding. The
experts of a mixture of experts, stored as fused tensors rather than linear layers, stay as they are too.
The schemes are the weight-only ones that run on a CPU with the torchao this project supports:

- `int8`: int8 weights, one scale per output channel (`Int8WeightOnlyConfig`).
- `int4`: int4 weights, one scale per group of 32 input columns (16 or 8 where 32 does not divide a map's width,
  as in the intermediate size 176 of the 2x64 preset) (`IntxWeightOnlyConfig` with `torch.int4`).
  torchao's `Int4WeightOnlyConfig` needs GPU kernels (the `mslk` package, or CUDA for its plain layout), so this
  is the CPU path torchao offers for the same 4-bit grouped weights: values kept unpacked in int8 storage and
  dequantized in the forward. It measures the same rounding error; it does not save the memory a packed layout does.

ScaleVec imports torchao only here, when a model is quantized (transformers imports it on its own when installed).
"""

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

INT4_GROUP_SIZE = 32  # llama.cpp's Q4_0 block


@dataclass(frozen=True)
class QuantizationScheme:
    description: str
    config: Callable[[int], object]  # the torchao config for linear maps of a given input width, once it is imported


def _int8_config(width: int):
    from torchao.quantization import Int8WeightOnlyConfig

    return Int8WeightOnlyConfig()  # per output channel


def int4_group_size(width: int) -> int:
    """32 input columns a group, or 16 or 8 in a map whose input width 32 does not divide."""
    group = math.gcd(width, INT4_GROUP_SIZE)
    if group < 8:
        raise ValueError(f"int4 quantizes groups of {INT4_GROUP_SIZE} (at least 8) input columns; {width} has none.")
    return group


def _int4_config(width: int):
    from torchao.quantization import IntxWeightOnlyConfig, PerGroup

    return IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(int4_group_size(width)))


QUANTIZATION_SCHEMES: dict[str, QuantizationScheme] = {
    "int8": QuantizationScheme("int8 weights, per output channel (torchao Int8WeightOnlyConfig)", _int8_config),
    "int4": QuantizationScheme(
        f"int4 weights, groups of {INT4_GROUP_SIZE} columns (16 or 8 where it does not divide the width) "
        "(torchao IntxWeightOnlyConfig, CPU layout)",
        _int4_config,
    ),
}
TORCHAO_INSTALL = "pip install 'scalevec[quantize]' (torchao >= 0.17)"


def parse_schemes(text: str) -> list[str]:
    """`"int8,int4"` -> `["int8", "int4"]`, each checked (for a `--quantize` flag)."""
    schemes = [name.strip() for name in text.split(",") if name.strip()]
    for name in schemes:
        _scheme(name)
    return schemes


def require_torchao() -> None:
    """Import torchao, or say in one line (an `ImportError`) that quantizing needs it and how to install it: a command
    calls this before its first forward, so a missing torchao costs nothing."""
    try:
        import torchao.quantization  # noqa: F401
    except Exception as error:  # not installed, or built for another torch (which fails in many ways)
        raise ImportError(
            f"Quantizing weights needs torchao, which could not be imported ({error}): {TORCHAO_INSTALL}."
        ) from None


def quantize_weights(model: nn.Module, scheme: str) -> nn.Module:
    """Quantize the weights of every linear map in `model`'s decoder layers in place with `scheme` (a key of
    `QUANTIZATION_SCHEMES`) and return `model`. Works on any module tree: a ScaleVec model (folded, or in its
    training form, where the scale vectors stay around the quantized maps), its Llama or Qwen3 export."""
    chosen = _scheme(scheme)
    require_torchao()
    from torchao.quantization import quantize_

    widths = {module.in_features for name, module in model.named_modules() if _is_decoder_linear(module, name)}
    for width in sorted(widths):  # one config per input width: int4's groups must divide it
        config = chosen.config(width)

        def of_width(module: nn.Module, name: str, width: int = width) -> bool:
            return _is_decoder_linear(module, name) and module.in_features == width

        quantize_(model, config, filter_fn=of_width)
    return model


def _scheme(name: str) -> QuantizationScheme:
    if name not in QUANTIZATION_SCHEMES:
        raise ValueError(f"Unknown quantization scheme {name!r}; choose from {', '.join(QUANTIZATION_SCHEMES)}.")
    return QUANTIZATION_SCHEMES[name]


def _is_decoder_linear(module: nn.Module, name: str) -> bool:
    return isinstance(module, nn.Linear) and ".layers." in f".{name}"


def quantization_deltas(base: dict, quantized: dict[str, dict]) -> dict[str, dict]:
    """The differences (quantized minus unquantized) of every figure two `scalevec-eval` results share, per scheme:
    `{scheme: {"held_out": {"loss": ..., ...}, "tasks": {task: {"acc": ..., "acc_norm": ..., "bpb": ...}}}}`.
    `base` and each value of `quantized` have the results' `held_out` and `tasks` entries; counts (tokens, items)
    are not differences and are left out."""
    return {
        scheme: {
            "held_out": _differences(base.get("held_out") or {}, result.get("held_out") or {}),
            "tasks": {
                task: _differences(scores, result["tasks"][task])
                for task, scores in (base.get("tasks") or {}).items()
                if task in (result.get("tasks") or {})
            },
        }
        for scheme, result in quantized.items()
    }


_COUNTS = ("tokens", "items", "available", "subset_seed")  # counts, and the key of a task's subset


def _differences(base: dict, other: dict) -> dict[str, float]:
    return {
        key: other[key] - value
        for key, value in base.items()
        if key not in _COUNTS and _is_number(value) and _is_number(other.get(key))
    }


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
