"""Scale-vector tensors: materialising them from a state dict, storing a vector in a given parameterisation, and
applying row/column scales to a (possibly stacked) matrix. All arithmetic runs in float32."""

import itertools
from collections.abc import Iterator
from dataclasses import dataclass, replace

import torch

from ..modeling_scalevec import ScaleVecScale

# Vectors that agree to this relative tolerance are the same scale: a magnitude-direction vector rebuilt from
# identical parameters can differ in the last bit depending on the shape it was computed in.
SAME_SCALE_RTOL = 1e-6
BLOCK_ELEMENTS = 1 << 18  # 1 MiB of float32


def pop_vector(tensors: dict[str, torch.Tensor], prefix: str) -> torch.Tensor | None:
    """Remove the scale stored under `prefix` (`.weight`, or `.magnitude` + `.direction`) and return its value, or
    None if there is none."""
    if f"{prefix}.weight" in tensors:
        return tensors.pop(f"{prefix}.weight").float()
    if f"{prefix}.magnitude" not in tensors:
        return None
    magnitude, direction = tensors.pop(f"{prefix}.magnitude").float(), tensors.pop(f"{prefix}.direction").float()
    return ScaleVecScale.magnitude_direction(magnitude, direction)


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


@dataclass(frozen=True)
class ScaledMatrix:
    """`diag(rows) @ weight @ diag(columns)` for each matrix of a stack, computed only when written (`blocks`): a
    few rows at a time into one reused buffer, so that the product is never held whole and each block is written
    out while it is still in the CPU's cache (writing a product computed whole measured 3x slower).

    `weight` is (..., out, in); `rows` (..., out) and `columns` (..., in) match its leading dimensions, or are None.
    `shape` is the shape it presents: the weight's, or with row groups (see `scale_matrix`) the weight's before they
    were split off."""

    weight: torch.Tensor
    rows: torch.Tensor | None
    columns: torch.Tensor | None
    shape: tuple[int, ...]

    @classmethod
    def of(cls, weight: "torch.Tensor | ScaledMatrix") -> "ScaledMatrix":
        return weight if isinstance(weight, ScaledMatrix) else cls(weight, None, None, tuple(weight.shape))

    def unflatten(self, dim: int, sizes: tuple[int, int]) -> "ScaledMatrix":
        """Split the rows into groups (only `dim=-2`), as `Tensor.unflatten` does."""
        if dim != -2 or sizes[0] <= 0:
            raise ValueError("a ScaledMatrix only splits its rows (dim=-2) into a positive number of groups")
        groups = sizes[0]
        if self.weight.dim() > len(self.shape):  # grouped already: present the groups
            if self.weight.shape[-3] != groups:
                raise ValueError(f"rows grouped in {self.weight.shape[-3]}, asked for {groups} groups")
            return replace(self, shape=tuple(self.weight.shape))
        split = self.weight.unflatten(-2, (groups, -1))
        rows = None if self.rows is None else self.rows.unflatten(-1, (groups, -1))
        columns = None if self.columns is None else self.columns.unsqueeze(-2).expand(*split.shape[:-2], -1)
        return ScaledMatrix(split, rows, columns, tuple(split.shape))

    def __getitem__(self, index: int | tuple[int, ...]) -> "ScaledMatrix":
        """One matrix (or sub-stack) of the stack: integer indices into the leading dimensions only."""
        index = index if isinstance(index, tuple) else (index,)
        if tuple(self.weight.shape) != self.shape or not all(isinstance(i, int) for i in index):
            raise IndexError("a ScaledMatrix is indexed by integers into its stack dimensions only")
        if len(index) > self.weight.dim() - 2:
            raise IndexError(f"index {index} reaches into the matrices of a stack of shape {self.shape}")
        weight = self.weight[index]
        return ScaledMatrix(weight, _pick(self.rows, index), _pick(self.columns, index), tuple(weight.shape))

    def scaled(self, rows: torch.Tensor | None, columns: torch.Tensor | None) -> "ScaledMatrix":
        """This product scaled once more, by scales shaped as the weight is stored (row groups split)."""
        rows_shape, columns_shape = self.weight.shape[:-1], (*self.weight.shape[:-2], self.weight.shape[-1])
        rows = None if rows is None else rows.float().expand(rows_shape)
        columns = None if columns is None else columns.float().expand(columns_shape)
        return replace(self, rows=product(self.rows, rows), columns=product(self.columns, columns))

    def blocks(self) -> Iterator[torch.Tensor]:
        """The product in row-major order, as consecutive float32 blocks (views of one buffer, valid until the
        next block is asked for)."""
        columns_count = self.weight.shape[-1]
        step = max(1, BLOCK_ELEMENTS // max(1, columns_count))
        buffer = torch.empty(step, columns_count, dtype=torch.float32)
        for index in itertools.product(*map(range, self.weight.shape[:-2])):  # each matrix: its own scales
            weight, rows, columns = (_pick(t, index) for t in (self.weight, self.rows, self.columns))
            for start in range(0, weight.shape[0], step):
                block = buffer[: min(step, weight.shape[0] - start)]
                if rows is None:
                    block.copy_(weight[start : start + step])
                else:
                    torch.mul(weight[start : start + step], rows[start : start + step, None], out=block)
                if columns is not None:
                    block.mul_(columns)
                yield block


def _pick(tensor: torch.Tensor | None, index: tuple[int, ...]) -> torch.Tensor | None:
    return None if tensor is None else tensor[index]


def scale_matrix(
    weight: "torch.Tensor | ScaledMatrix", rows: torch.Tensor | None, columns: torch.Tensor | None, row_groups: int = 1
) -> "torch.Tensor | ScaledMatrix":
    """`diag(rows) @ weight @ diag(columns)` for a matrix (out, in) or stacked matrices (E, out, in), in float32, as
    a `ScaledMatrix` (computed when written); the weight itself when there is nothing to apply. With `row_groups`,
    the rows are split into that many groups first (the scales of the experts' gate_up_proj are (E, 2, I) and
    (E, 2, H))."""
    if rows is None and columns is None:
        return weight
    matrix = ScaledMatrix.of(weight)
    grouped = matrix.unflatten(-2, (row_groups, -1)) if row_groups > 1 else matrix
    return replace(grouped.scaled(rows, columns), shape=matrix.shape)
