"""Scale-vector tensors: materialising them from a state dict, storing a vector in a given parameterisation, and
applying row/column scales to a (possibly stacked) matrix. All arithmetic runs in float32."""

import itertools

import torch

# Vectors that agree to this relative tolerance are the same scale: a magnitude-direction vector rebuilt from
# identical parameters can differ in the last bit depending on the shape it was computed in.
SAME_SCALE_RTOL = 1e-6
_BLOCK_ELEMENTS = 1 << 18  # 1 MiB of float32


def pop_vector(tensors: dict[str, torch.Tensor], prefix: str) -> torch.Tensor | None:
    """Remove the scale stored under `prefix` (`.weight`, or `.magnitude` + `.direction`) and return its value, or
    None if there is none. Same formula as `ScaleVecScale.vector`."""
    if f"{prefix}.weight" in tensors:
        return tensors.pop(f"{prefix}.weight").float()
    if f"{prefix}.magnitude" not in tensors:
        return None
    magnitude, direction = tensors.pop(f"{prefix}.magnitude").float(), tensors.pop(f"{prefix}.direction").float()
    return magnitude * direction * torch.rsqrt(direction.pow(2).mean(-1, keepdim=True))


def has_scale(expected: dict[str, torch.Tensor], prefix: str) -> bool:
    return f"{prefix}.weight" in expected or f"{prefix}.magnitude" in expected


def stored_as(vector: torch.Tensor, prefix: str, expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The parameters that make the scale under `prefix` equal `vector` (broadcast to the expected shape), in the
    parameterisation `expected` (a meta state dict) uses there."""
    if f"{prefix}.weight" in expected:
        return {f"{prefix}.weight": vector.expand(expected[f"{prefix}.weight"].shape).clone()}
    direction = vector.expand(expected[f"{prefix}.direction"].shape)
    magnitude = direction.pow(2).mean(-1, keepdim=True).sqrt()
    # A zero vector has no direction: any unit direction with magnitude 0 represents it.
    direction = torch.where(magnitude == 0, 1.0, direction / magnitude.clamp_min(torch.finfo(torch.float32).tiny))
    return {f"{prefix}.magnitude": magnitude, f"{prefix}.direction": direction}


def product(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """Elementwise product where None stands for a vector of ones."""
    if a is None or b is None:
        return b if a is None else a
    return a * b


def common_vector(vectors: list[torch.Tensor]) -> torch.Tensor | None:
    """The 1-D vector that every (possibly stacked, e.g. per-expert) vector equals, if they all agree."""
    reference = vectors[0].reshape(-1, vectors[0].shape[-1])[0]
    same = all(torch.allclose(v, reference.expand_as(v), rtol=SAME_SCALE_RTOL, atol=0) for v in vectors)
    return reference if same else None


def ratio(vector: torch.Tensor, common: torch.Tensor) -> torch.Tensor | None:
    """`vector / common`, or None where that is all ones. Where `common` is 0 the norm zeroes that feature, so the
    matching column never matters: leave it as it is."""
    quotient = torch.where(common == 0, 1.0, vector / torch.where(common == 0, 1.0, common))
    return None if bool((quotient == 1).all()) else quotient


def scale_matrix(
    weight: torch.Tensor, rows: torch.Tensor | None, columns: torch.Tensor | None, row_groups: int = 1
) -> torch.Tensor:
    """`diag(rows) @ weight @ diag(columns)` for a matrix (out, in) or stacked matrices (E, out, in), in float32;
    the weight itself when there is nothing to apply. With `row_groups`, the rows are split into that many groups
    first (the scales of the experts' gate_up_proj are (E, 2, I) and (E, 2, H))."""
    if rows is None and columns is None:
        return weight
    grouped = weight.unflatten(-2, (row_groups, -1)) if row_groups > 1 else weight
    out = torch.empty(grouped.shape, dtype=torch.float32)
    stack_shape = grouped.shape[:-2]
    rows = None if rows is None else rows.expand(grouped.shape[:-1])
    columns = None if columns is None else columns.expand(*stack_shape, grouped.shape[-1])
    for index in itertools.product(*map(range, stack_shape)):  # each matrix of a stack: its own scales
        _scale_rows_in_blocks(
            grouped[index],
            out[index],
            None if rows is None else rows[index],
            None if columns is None else columns[index],
        )
    return out.reshape(weight.shape)


def _scale_rows_in_blocks(
    weight: torch.Tensor, out: torch.Tensor, rows: torch.Tensor | None, columns: torch.Tensor | None
) -> None:
    # Blocks of rows small enough for the cache: the second multiplication reads what the first just wrote.
    step = max(1, _BLOCK_ELEMENTS // weight.shape[-1])
    for start in range(0, weight.shape[0], step):
        block = slice(start, start + step)
        if rows is None:
            out[block].copy_(weight[block])
        else:
            torch.mul(weight[block], rows[block, None], out=out[block])
        if columns is not None:
            out[block].mul_(columns)
