"""`scalevec-convert inspect`: what a checkpoint is, which scale-vector strategy it uses, how many parameters its
scale vectors hold, per site (all layers and experts together) the statistics of the scale values, and which
tensors hold NaN or Inf. The checkpoint is checked against its config first, as a conversion checks it."""

from collections import defaultdict
from pathlib import Path

import torch

from ..configuration_scalevec import SCALE_FIELDS
from ..scale_sites import scale_site, vector_statistics
from .checkpoint import count_nonfinite
from .meta_model import scale_parameters
from .pipeline import CheckedSource, open_source
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
STRATEGY_FIELDS = ("scale_preset", *SCALE_FIELDS, "output_norm", "qk_norm", "folded")


def inspect_checkpoint(path: str | Path) -> dict:
    """A JSON-ready summary of the checkpoint at `path` (any supported format, seen as a ScaleVec model; the
    scale vectors of a stock checkpoint are its norm weights). Raises `CheckpointError` for a checkpoint that does
    not match its config."""
    source = open_source(path)
    config, checkpoint = source.config, source.checkpoint
    return {
        "path": str(checkpoint.path),
        "format": source.format.name,
        "architecture": {field: getattr(config, field) for field in ARCHITECTURE_FIELDS if hasattr(config, field)},
        "moe_layers": sum(config.is_moe_layer(i) for i in range(config.num_hidden_layers)),
        "strategy": {field: getattr(config, field) for field in STRATEGY_FIELDS},
        "dtypes": sorted({str(info.dtype).removeprefix("torch.") for info in checkpoint.tensors.values()}),
        "parameters": {"total": checkpoint.num_values, "scale_vectors": scale_parameters(config)},
        "nonfinite": _nonfinite(source),
        "scale_sites": [
            _statistics(source, site, role, names)
            for role, names in source.roles.items()
            for site, names in _sites(names).items()
        ],
    }


def _nonfinite(source: CheckedSource) -> dict[str, int]:
    """The number of NaN and infinite values of every tensor that holds any, read a unit at a time."""
    counts = {}
    for names in source.units.values():
        for name, tensor in source.checkpoint.read(names).items():
            if count := count_nonfinite(tensor):
                counts[name] = count
    return counts


def _sites(names: list[str]) -> dict[str, list[str]]:
    """Scale parameter names grouped by the site of their module."""
    sites: dict[str, list[str]] = defaultdict(list)
    for name in names:
        site, _ = scale_site(_module(name))
        sites[site].append(name)
    return sites


def _module(parameter_name: str) -> str:
    return parameter_name.rpartition(".")[0]


def _statistics(source: CheckedSource, site: str, role: str, names: list[str]) -> dict:
    tensors = source.checkpoint.read(names)
    vectors = [pop_vector(tensors, module) for module in sorted({_module(name) for name in names})]
    return {
        "site": site,
        "role": role,
        "vectors": sum(vector.numel() // vector.shape[-1] for vector in vectors),  # per layer and expert
        "values": sum(vector.numel() for vector in vectors),
        **vector_statistics(torch.cat([vector.reshape(-1) for vector in vectors])),
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
        "non-finite values (NaN or Inf): "
        + (", ".join(f"{count:,} in {name}" for name, count in summary["nonfinite"].items()) or "none"),
        f"{'site':<40} {'role':<6} {'vectors':>7} {'mean':>9} {'std':>9} {'min':>9} {'max':>9}",
    ]
    for site in summary["scale_sites"]:
        lines.append(
            f"{site['site']:<40} {site['role']:<6} {site['vectors']:>7} {site['mean']:>9.4f} {site['std']:>9.4f} "
            f"{site['min']:>9.4f} {site['max']:>9.4f}"
        )
    return "\n".join(lines)
