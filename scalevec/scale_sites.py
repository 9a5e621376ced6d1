"""Scale-vector sites: the names under which training diagnostics (`scale/<site>/<statistic>`) and
`scalevec-convert inspect` report a scale vector of every layer together, and the statistics both report."""

import re

import torch

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
OUTSIDE_BLOCKS = -1  # the layer of a scale that no decoder layer holds (the final norm)


def scale_site(module_name: str) -> tuple[str, int]:
    """(site, layer) of the scale module `module_name`: the module path without the layer index and the
    model's `model.` prefix, e.g. `model.layers.3.self_attn.q_proj.in_scale` -> (`self_attn.q_proj.in_scale`, 3)
    and `model.norm` -> (`norm`, -1)."""
    match = _LAYER.search(module_name)
    site = _LAYER.sub(".", module_name).strip(".").removeprefix("model.")
    return site, int(match.group(1)) if match else OUTSIDE_BLOCKS


def vector_statistics(values: torch.Tensor) -> dict[str, float]:
    """Mean, std, min and max of scale values (any shape), in float32."""
    values = values.detach().float().reshape(-1)
    return {
        "mean": values.mean().item(),
        "std": values.std().item() if values.numel() > 1 else 0.0,
        "min": values.min().item(),
        "max": values.max().item(),
    }
