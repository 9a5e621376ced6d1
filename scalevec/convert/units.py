"""A checkpoint is converted unit by unit: the embeddings, each decoder layer, then the head (final norm and
LM head). A unit is small next to a shard, so memory stays bounded while every rule that spans several tensors
(a norm and the maps that read it) sees all of them at once."""

import re
from collections.abc import Iterable

EMBED, HEAD = "embed", "head"
_LAYER_KEY = re.compile(r"layers\.(\d+)\.")


def layer_unit(index: int) -> str:
    return f"layer.{index}"


def layer_prefix(unit: str) -> str | None:
    """`model.layers.{i}.` for a layer unit, None for the embeddings and the head."""
    index = layer_index(unit)
    return None if index is None else f"model.layers.{index}."


def unit_of(key: str, base_prefix: str = "model") -> str:
    """The unit of a tensor whose model keeps its base model under `base_prefix` (the head's tensors: HEAD)."""
    if not key.startswith(f"{base_prefix}."):
        return HEAD
    local = key.removeprefix(f"{base_prefix}.")
    match = _LAYER_KEY.match(local)
    if match:
        return layer_unit(int(match.group(1)))
    return EMBED if local.startswith("embed_tokens.") else HEAD


def unit_order(num_layers: int) -> list[str]:
    return [EMBED, *(layer_unit(i) for i in range(num_layers)), HEAD]


def group_by_unit(keys: Iterable[str], num_layers: int, base_prefix: str = "model") -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {unit: [] for unit in unit_order(num_layers)}
    for key in keys:
        groups.setdefault(unit_of(key, base_prefix), []).append(key)
    return groups


def strip_prefix(unit: str, tensors: dict) -> dict:
    prefix = layer_prefix(unit)
    return tensors if prefix is None else {key.removeprefix(prefix): value for key, value in tensors.items()}


def add_prefix(unit: str, tensors: dict) -> dict:
    prefix = layer_prefix(unit)
    return tensors if prefix is None else {prefix + key: value for key, value in tensors.items()}


def layer_index(unit: str) -> int | None:
    return int(unit.split(".")[1]) if unit.startswith("layer.") else None
