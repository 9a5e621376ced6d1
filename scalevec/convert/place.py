"""Placement: the folded form -> the state dict of a ScaleVec model of any strategy, one unit at a time, so that
the function is unchanged (the inverse of folding).

Where the target strategy stores each scale is read off its meta-device state dict (`expected`), so the rules of
`modeling_scalevec.py` are not restated here. An input norm's weight goes to the norm's own scale (`shared`), to
every consumer's branch scale (`branch`), or into the consumers' columns (`none`); the final norm's weight stays
the final norm's scale, or goes into the columns of the head's layer when the strategy has none; output-role
weights stay where they are; every other scale (row and column scales) starts at one.
"""

import torch

from .errors import ConversionError
from .heads import HEAD_LAYERS
from .layout import FINAL_NORM, NORM_CONSUMERS, OUTPUT_NORMS
from .scales import has_scale, scale_matrix, stored_as
from .units import HEAD, add_prefix, strip_prefix

Tensors = dict[str, torch.Tensor]


def place_unit(unit: str, folded: Tensors, expected: Tensors, scale_names: set[str]) -> Tensors:
    """`expected`: the unit's tensors in a meta-device model of the target strategy (full names); `scale_names`:
    the names of its scale-vector parameters, the only tensors that may start at one."""
    remaining, local_expected = dict(strip_prefix(unit, folded)), strip_prefix(unit, expected)
    placed: Tensors = {}
    if unit == HEAD:
        placed |= _place_final_norm(remaining, local_expected)
    for norm, consumers in NORM_CONSUMERS.items():
        if f"{norm}.weight" in remaining:
            present = [site for site in consumers if site.matrix in remaining]
            placed |= _place_norm(remaining, local_expected, norm, present)
    for norm in OUTPUT_NORMS:
        if f"{norm}.weight" in remaining:
            placed |= stored_as(remaining.pop(f"{norm}.weight"), norm, local_expected)
    placed = add_prefix(unit, placed)
    remaining = add_prefix(unit, remaining)
    for key, meta in expected.items():
        if key in placed:
            continue
        if key in remaining:
            placed[key] = remaining.pop(key)
        elif key in scale_names:
            placed[key] = torch.ones(meta.shape)
        else:
            raise ConversionError(f"the folded checkpoint has no tensor for {key}")
    if remaining:
        raise ConversionError(f"the target strategy has no place for these tensors: {sorted(remaining)}")
    return placed


def _place_norm(tensors: Tensors, expected: Tensors, norm: str, consumers: list) -> Tensors:
    gamma = tensors.pop(f"{norm}.weight").float()
    if has_scale(expected, norm):
        return stored_as(gamma, norm, expected)
    placed: Tensors = {}
    for site in consumers:
        if has_scale(expected, site.in_scale):
            placed |= stored_as(gamma, site.in_scale, expected)
        else:  # norm_scale="none": nothing holds gamma but the matrices
            placed[site.matrix] = scale_matrix(tensors.pop(site.matrix), None, gamma, site.row_groups)
    return placed


def _place_final_norm(tensors: Tensors, expected: Tensors) -> Tensors:
    gamma = tensors.pop(f"{FINAL_NORM}.weight").float()
    if has_scale(expected, FINAL_NORM):
        return stored_as(gamma, FINAL_NORM, expected)
    matrices = [f"{layer}.weight" for layer in HEAD_LAYERS if f"{layer}.weight" in tensors]
    if not matrices:
        raise ConversionError(
            "the target strategy has no final-norm scale (norm_scale='none') and the embeddings are tied, so the "
            "final norm's weight has nowhere to go"
        )
    (matrix,) = matrices  # a bias, if the layer has one, is added after the product: it stays as it is
    return {matrix: scale_matrix(tensors.pop(matrix), None, gamma)}
