"""Folding: a ScaleVec state dict of any strategy -> the folded form, one unit at a time.

The folded form holds exactly the tensors of a `folded=True` ScaleVec model with `norm_scale="shared"` (the Llama /
Qwen3 / Qwen3-MoE layout): every branch, column and row scale is multiplied into its matrix,
`W' = diag(beta) W diag(alpha * gamma)`, magnitude-direction vectors are materialised, and output-role scales
become plain norm weights. An input norm whose consumers all end up with the same column factor keeps that factor
as its weight and leaves their matrices untouched (this is how a standard checkpoint, or one imported from a stock
model, folds back to its original weights); otherwise its weight is ones. The final norm's scale always stays its
weight, so tied embeddings stay tied and the head's layer (any head's: see heads.py) passes through unchanged.
"""

import torch

from .errors import ConversionError
from .heads import HEAD_LAYERS
from .layout import EMBEDDINGS, FINAL_NORM, INNER_LINEARS, NORM_CONSUMERS, OUTPUT_NORMS, LinearSite
from .scales import common_vector, pop_vector, product, ratio, scale_matrix
from .units import EMBED, HEAD, add_prefix, strip_prefix

Tensors = dict[str, torch.Tensor]


def fold_unit(unit: str, tensors: Tensors, hidden_size: int) -> Tensors:
    """The folded tensors of one unit. Matrices with nothing to fold are the source's tensors; the others are
    `ScaledMatrix` products (float32), computed when written."""
    remaining = dict(strip_prefix(unit, tensors))
    if unit == EMBED:
        folded = {EMBEDDINGS: remaining.pop(EMBEDDINGS)}
    elif unit == HEAD:
        norm = pop_vector(remaining, FINAL_NORM)
        folded = {f"{FINAL_NORM}.weight": torch.ones(hidden_size) if norm is None else norm}
        folded |= _pop_head_layer(remaining)
    else:
        folded = _fold_layer(remaining)
    if remaining:
        raise ConversionError(f"folding does not know these tensors: {sorted(add_prefix(unit, remaining))}")
    return add_prefix(unit, folded)


def _pop_head_layer(tensors: Tensors) -> Tensors:
    """The weight and bias of the head's layer (none for an LM head tied to the embeddings)."""
    names = [key for key in tensors if key.partition(".")[0] in HEAD_LAYERS]
    return {key: tensors.pop(key) for key in names}


def _fold_layer(tensors: Tensors) -> Tensors:
    """Folds every scale of one layer (layer-local names), removing what it used from `tensors`."""
    folded: Tensors = {}
    for norm, consumers in NORM_CONSUMERS.items():
        present = [site for site in consumers if site.matrix in tensors]
        folded |= _fold_norm(tensors, norm, present)
    for site in INNER_LINEARS:
        if site.matrix in tensors:
            folded[site.matrix] = _fold_linear(tensors, site, pop_vector(tensors, site.in_scale))
    for norm in OUTPUT_NORMS:
        vector = pop_vector(tensors, norm)
        if vector is not None:
            folded[f"{norm}.weight"] = vector
    return folded


def _fold_norm(tensors: Tensors, norm: str, consumers: list[LinearSite]) -> Tensors:
    gamma = pop_vector(tensors, norm)
    columns = [product(gamma, pop_vector(tensors, site.in_scale)) for site in consumers]
    common = None if any(c is None for c in columns) else common_vector(columns)
    if common is not None:
        columns = [ratio(column, common) for column in columns]
    elif all(c is None for c in columns):
        common = gamma  # nothing to fold: the norm keeps its own scale, if it has one
    hidden_size = tensors[consumers[0].matrix].shape[-1]
    folded = {f"{norm}.weight": torch.ones(hidden_size) if common is None else common}
    for site, column in zip(consumers, columns):
        folded[site.matrix] = _fold_linear(tensors, site, column)
    return folded


def _fold_linear(tensors: Tensors, site: LinearSite, columns: torch.Tensor | None) -> torch.Tensor:
    return scale_matrix(tensors.pop(site.matrix), pop_vector(tensors, site.out_scale), columns, site.row_groups)
