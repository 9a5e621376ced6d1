"""`scalevec-convert inspect`: what a checkpoint is, which scale-vector strategy it uses, how many parameters its
scale vectors hold, and per site (all layers and experts together) the statistics of the scale values."""

import math
import re
from collections import defaultdict
from pathlib import Path

import torch

from .checkpoint import Checkpoint
from .formats import format_of, scalevec_view
from .pipeline import meta_state
from .scales import pop_vector

ARCHITECTURE_FIELDS = (
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "vocab_size",
    "tie_word_embeddings",
    "num_experts",
    "num_experts_per_tok",
    "moe_intermediate_size",
    "norm_topk_prob",
    "shared_expert_intermediate_size",
)
STRATEGY_FIELDS = ("scale_preset", "norm_scale", "linear_scale", "scale_param", "output_norm", "qk_norm", "folded")
_PARAMETER = re.compile(r"\.(weight|magnitude|direction)$")
_LAYER = re.compile(r"\.layers\.\d+\.")


def inspect_checkpoint(path: str | Path) -> dict:
    """A JSON-ready summary of the checkpoint at `path` (any supported format, seen as a ScaleVec model; the
    scale vectors of a stock checkpoint are its norm weights)."""
    checkpoint = Checkpoint(path)
    fmt = format_of(checkpoint.model_type)
    config = scalevec_view(checkpoint, fmt)
    state, roles = meta_state(config)
    return {
        "path": str(checkpoint.path),
        "format": fmt.name,
        "architecture": {field: getattr(config, field) for field in ARCHITECTURE_FIELDS},
        "moe_layers": sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers)),
        "strategy": {field: getattr(config, field) for field in STRATEGY_FIELDS},
        "dtypes": sorted({str(info.dtype).removeprefix("torch.") for info in checkpoint.tensors.values()}),
        "parameters": {
            "total": sum(math.prod(info.shape) for info in checkpoint.tensors.values()),
            "scale_vectors": {role: sum(state[name].numel() for name in names) for role, names in roles.items()},
        },
        "scale_sites": [
            _statistics(checkpoint, site, role, names)
            for role, names in roles.items()
            for site, names in _sites(names)
        ],
    }


def _sites(names: list[str]) -> list[tuple[str, list[str]]]:
    """Scale parameters grouped by site: the scale's module name with the layer index replaced by `*`."""
    sites: dict[str, list[str]] = defaultdict(list)
    for name in names:
        sites[_LAYER.sub(".layers.*.", _PARAMETER.sub("", name))].append(name)
    return list(sites.items())


def _statistics(checkpoint: Checkpoint, site: str, role: str, names: list[str]) -> dict:
    tensors = checkpoint.read(names)
    modules = sorted({_PARAMETER.sub("", name) for name in names})
    vectors = [pop_vector(tensors, module) for module in modules]
    values = torch.cat([vector.reshape(-1) for vector in vectors])
    return {
        "site": site,
        "role": role,
        "vectors": sum(vector.numel() // vector.shape[-1] for vector in vectors),  # per layer and expert
        "values": values.numel(),
        "mean": values.mean().item(),
        "std": values.std().item() if values.numel() > 1 else 0.0,
        "min": values.min().item(),
        "max": values.max().item(),
    }


def format_summary(summary: dict) -> str:
    """The summary as text for a terminal."""
    parameters = summary["parameters"]
    scales = parameters["scale_vectors"]
    lines = [
        f"{summary['path']}: {summary['format']} checkpoint ({', '.join(summary['dtypes'])})",
        "architecture: " + ", ".join(f"{k}={v}" for k, v in summary["architecture"].items()),
        f"MoE layers: {summary['moe_layers']}",
        "strategy: " + ", ".join(f"{k}={v}" for k, v in summary["strategy"].items()),
        f"parameters: {parameters['total']:,} in all; scale vectors: {scales['input']:,} input-role, "
        f"{scales['output']:,} output-role ({(scales['input'] + scales['output']) / parameters['total']:.4%})",
        f"{'site':<52} {'role':<6} {'vectors':>7} {'mean':>9} {'std':>9} {'min':>9} {'max':>9}",
    ]
    for site in summary["scale_sites"]:
        lines.append(
            f"{site['site']:<52} {site['role']:<6} {site['vectors']:>7} {site['mean']:>9.4f} {site['std']:>9.4f} "
            f"{site['min']:>9.4f} {site['max']:>9.4f}"
        )
    return "\n".join(lines)
