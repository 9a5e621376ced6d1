"""How ScaleVec is made fast. `modeling_scalevec.py` says what the model computes; this file computes the same with
less time or memory, and nothing else.

The contract: every function here equals the model file's plain reference — a projection's `b * proj(a * x)`, the
fold `diag(b) W diag(a)` of its scales into its weight (`fold` there, `fold_scales` here), a scale's `g * u / rms(u)`
— up to float rounding. The model file imports:

- `scaled_linear`: several scaled linear maps of one input in one autograd node. The scales are folded into each
  weight inside the matmul and refolded in backward, so that a scale costs no saved activation; q/k/v or gate/up run
  as one fused matmul, experts as one grouped GEMM per projection.
- `scaled_projections` and `expert_maps`: what a layer multiplies by in this forward. Without gradients (`generate`,
  evaluation) each folded weight is computed once and reused while its parameters are unchanged, so a training-form
  model decodes at the speed of a folded one; with gradients the weights and scales themselves, folded on the fly
  (and the cached folded weights freed: training needs the memory more than a later evaluation needs the time).
- `prepared_scales`: the one `with` block of `ScaleVecModel.forward`, which checks the cached folded weights once for
  the forward inside it, or forms all its magnitude-direction vectors at once.
- `sorted_group_sizes`, `forget_checked_kv_cache` and `SCALEVEC_EXPERTS_FUNCTIONS` (transformers' experts kernels on
  the folded expert weights).

Also public, for tests and benchmarks: `fold_scales`, `fold_backward`, `receiving_experts`, `formed_scale_vectors`,
`reuses_folded_weights`. A module whose maps this file folds (a projection, the router, the experts) offers
`scaled_maps()`: its linear maps as `ScaledMap`s. Ships to the Hub beside the model file and imports only `torch` and
`transformers`; ScaleVec's opt-in CPU kernels are taken from the installed package where there is one.
"""

import contextlib
import functools
import os
import weakref
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface

# A linear map as `scaled_linear` takes it: the weight (..., out, in), its column scale (..., in) and its row scale
# (..., out), None where there is no such scale.
ScaledMap = tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]


# --- The fold and its backward -------------------------------------------------------------------------------------


def fold_scales(
    weight: torch.Tensor, in_scale: torch.Tensor | None, out_scale: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """`diag(b) W diag(a)` in `dtype`, not differentiable: one pass per scale, the second in place (one pass in all
    with the CPU kernels)."""
    if in_scale is None and out_scale is None:
        return weight.to(dtype)
    kernels = _cpu_kernels(dtype, weight, in_scale, out_scale)
    if kernels is not None:
        return kernels.fold(*_kernel_operands(weight, in_scale, out_scale)).view(weight.shape)
    first = in_scale.unsqueeze(-2) if out_scale is None else out_scale.unsqueeze(-1)
    folded = torch.mul(weight, first, out=weight.new_empty(weight.shape, dtype=dtype))
    return folded if in_scale is None or out_scale is None else folded.mul_(in_scale.unsqueeze(-2))


def fold_backward(
    grad_folded: torch.Tensor,
    weight: torch.Tensor,
    in_scale: torch.Tensor | None,
    out_scale: torch.Tensor | None,
    dtype: torch.dtype,
    refold: bool,
) -> tuple[torch.Tensor | None, tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]]:
    """The backward's folded weight (in `dtype`; None unless `refold`) and the gradients of W, a and b from the
    gradient G of the folded weight (which becomes W's, rescaled in place): eager passes, or one read of W and G by
    the CPU kernels."""
    kernels = _cpu_kernels(dtype, weight, in_scale, out_scale, grad_folded)
    if kernels is None:
        folded = fold_scales(weight, in_scale, out_scale, dtype) if refold else None
        return folded, _scale_grads(grad_folded, weight, in_scale, out_scale)
    stack, stacked_in, stacked_out = _kernel_operands(weight, in_scale, out_scale)
    folded, grad_in, grad_out = kernels.fold_backward(stack, grad_folded.view(stack.shape), stacked_in, stacked_out)
    return folded.view(weight.shape), (grad_folded, grad_in.view(in_scale.shape), grad_out.view(out_scale.shape))


def _scale_grads(grad_folded, weight, in_scale, out_scale):
    """`diag(b) G diag(a)` (G rescaled in place) and the column / row sums of `G * W` weighted by the other scale."""
    if in_scale is None and out_scale is None:
        return grad_folded, None, None
    product = grad_folded * weight
    grad_in = grad_out = None
    if in_scale is not None:
        grad_in = _column_sums(product, out_scale)
        grad_folded.mul_(in_scale.unsqueeze(-2))
    if out_scale is not None:
        grad_out = _row_sums(product, in_scale)
        grad_folded.mul_(out_scale.unsqueeze(-1))
    return grad_folded, grad_in, grad_out


def _column_sums(matrix: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """`sum_i w_i M_ij` over the rows of `M` (..., out, in): a vector-matrix product, no temporary."""
    if weights is None:
        return matrix.sum(-2)
    return weights @ matrix if matrix.dim() == 2 else (weights.unsqueeze(-2) @ matrix).squeeze(-2)


def _row_sums(matrix: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """`sum_j w_j M_ij` over the columns of `M` (..., out, in). Batched as a row vector times the transpose: BLAS
    is much slower at the batched matrix-vector product on expert stacks (benchmarks/RESULTS.md)."""
    if weights is None:
        return matrix.sum(-1)
    return matrix @ weights if matrix.dim() == 2 else (weights.unsqueeze(-2) @ matrix.mT).squeeze(-2)


def _cpu_kernels(dtype: torch.dtype, weight, in_scale, out_scale, *others: torch.Tensor) -> ModuleType | None:
    """ScaleVec's fused CPU kernels (`scalevec/cpu_kernels.py`) where they apply: asked for with
    SCALEVEC_CPU_KERNELS=1, a map with both scales (with one the eager passes are few and the kernels are no faster),
    folded in its own dtype, plain contiguous fp32 CPU tensors, outside torch.compile. None where ScaleVec itself is
    not installed (remote code) or the kernels cannot be built."""
    if in_scale is None or out_scale is None or dtype != weight.dtype:
        return None
    if os.environ.get("SCALEVEC_CPU_KERNELS") != "1" or torch.compiler.is_compiling():
        return None
    for tensor in (weight, in_scale, out_scale, *others):
        plain = type(tensor) in (torch.Tensor, nn.Parameter) and tensor.device.type == "cpu"
        if not (plain and tensor.dtype == torch.float32 and tensor.is_contiguous()):
            return None
    return _built_cpu_kernels()


@functools.cache
def _built_cpu_kernels() -> ModuleType | None:
    try:
        from scalevec.cpu_kernels import load
    except ImportError:
        return None
    return load()


def _kernel_operands(weight: torch.Tensor, in_scale, out_scale) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The weight as (B, out, in) and its scales as (B, in), (B, out)."""
    out_features, in_features = weight.shape[-2:]
    return weight.view(-1, out_features, in_features), in_scale.view(-1, in_features), out_scale.view(-1, out_features)


# --- Grouped GEMMs: the rows of each expert's tokens by that expert's weight --------------------------------------


def sorted_group_sizes(sorted_groups: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Rows per group of a sorted group index. `searchsorted`, not `bincount`: the output shape does not depend on
    the data (torch.compile traces it), there is no host sync, and it is deterministic on GPUs, unlike `histc`."""
    groups = torch.arange(num_groups, device=sorted_groups.device, dtype=sorted_groups.dtype)
    ends = torch.searchsorted(sorted_groups, groups, right=True)
    return ends.diff(prepend=ends.new_zeros(1))


def _use_grouped_mm(*operands: torch.Tensor) -> bool:
    # torch's grouped GEMM takes bf16 on CUDA and fp32/bf16 on CPU, and needs 16-byte aligned strides; its fake
    # kernel (what torch.compile traces) takes bf16 only.
    bf16_only = operands[0].is_cuda or torch.compiler.is_compiling()
    dtypes = (torch.bfloat16,) if bf16_only else (torch.float32, torch.bfloat16)
    aligned = all(stride * t.element_size() % 16 == 0 for t in operands for stride in t.stride() if stride != 1)
    return hasattr(F, "grouped_mm") and operands[0].dtype in dtypes and aligned


def _grouped_mm_loop(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """`F.grouped_mm` as one matmul per group: rows of `a` by `b[g]` (b 3-D), or `a[:, group] @ b[group]` (b 2-D)."""
    out = _grouped_mm_shape(a, b, offs)
    start = 0
    for group, end in enumerate(offs.tolist()):
        if b.ndim == 3:
            torch.mm(a[start:end], b[group], out=out[start:end])
        else:
            torch.mm(a[:, start:end], b[start:end], out=out[group])
        start = end
    return out


def _grouped_mm_shape(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    shape = (a.shape[0], b.shape[-1]) if b.ndim == 3 else (offs.shape[0], a.shape[0], b.shape[-1])
    return a.new_empty(shape)


# An opaque operator, so that torch.compile never sees the loop's data-dependent group sizes. Each copy of this file
# (the package, remote code) shares the first one's registration.
if not hasattr(torch.ops.scalevec, "grouped_mm_loop"):
    torch.library.custom_op("scalevec::grouped_mm_loop", _grouped_mm_loop, mutates_args=()).register_fake(
        _grouped_mm_shape
    )


def _grouped_mm(a: torch.Tensor, b: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    offs = group_sizes.cumsum(0).to(torch.int32)
    return F.grouped_mm(a, b, offs=offs) if _use_grouped_mm(a, b) else torch.ops.scalevec.grouped_mm_loop(a, b, offs)


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """Rows of `x` sorted by group; group `g` is multiplied by `weight[g].T` (weight: (G, out, in))."""
    return _grouped_mm(x, weight.transpose(-2, -1), group_sizes)


def _grouped_weight_grad(grad: torch.Tensor, x: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """Per group `grad_g.T @ x_g`, shape (G, out, in)."""
    return _grouped_mm(grad.T, x, group_sizes)


# --- The fused scaled matmul -------------------------------------------------------------------------------------


class _ScaledLinearFunction(torch.autograd.Function):
    """`y_i = x @ (diag(b_i) W_i diag(a_i)).T` for several maps of one input, optionally grouped by expert.

    The scales are folded into each weight on the fly: `out x in` work that does not grow with the token count and
    no extra saved activation. The folded weights are recomputed in backward rather than saved, so the scales cost
    no memory beyond their own size. Each map keeps its own output (as separate projections do), so backward never
    concatenates gradients.
    """

    @staticmethod
    def forward(ctx, x, group_sizes, experts, num_maps, *tensors):
        dtype = _compute_dtype(x)
        ctx.input_dtype, ctx.num_maps = x.dtype, num_maps
        x = x.to(dtype)
        ctx.save_for_backward(x, group_sizes, experts, *tensors)
        outputs = []
        for weight, in_scale, out_scale in _maps_of(tensors, num_maps, experts):
            folded = fold_scales(weight, in_scale, out_scale, dtype)
            outputs.append(
                F.linear(x, folded) if group_sizes is None else _grouped_linear(x, folded.flatten(1, -2), group_sizes)
            )
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        x, group_sizes, experts, *tensors = ctx.saved_tensors
        flat_x = x.reshape(-1, x.shape[-1])
        grad_x, grads_of_maps = None, []
        for grad, (weight, in_scale, out_scale) in zip(grads, _maps_of(tensors, ctx.num_maps, experts)):
            flat_grad = grad.reshape(-1, grad.shape[-1]).to(x.dtype)
            if any(ctx.needs_input_grad[4:]):
                if group_sizes is None:
                    grad_folded = flat_grad.T @ flat_x
                else:
                    grad_folded = _grouped_weight_grad(flat_grad.contiguous(), flat_x, group_sizes).view(weight.shape)
                folded, grads_of_map = fold_backward(
                    grad_folded.to(weight.dtype), weight, in_scale, out_scale, x.dtype, refold=ctx.needs_input_grad[0]
                )
                grads_of_maps.append(grads_of_map)
            else:
                folded = fold_scales(weight, in_scale, out_scale, x.dtype) if ctx.needs_input_grad[0] else None
                grads_of_maps.append((None, None, None))
            if ctx.needs_input_grad[0]:
                if group_sizes is None:
                    grad_x_of_map = flat_grad @ folded
                else:
                    grad_x_of_map = _grouped_linear(flat_grad.contiguous(), folded.flatten(1, -2).mT, group_sizes)
                grad_x = grad_x_of_map if grad_x is None else grad_x.add_(grad_x_of_map)
        grad_x = None if grad_x is None else grad_x.view(x.shape).to(ctx.input_dtype)
        grads_in_order = (g for grads_of_kind in zip(*grads_of_maps) for g in grads_of_kind)
        return grad_x, None, None, None, *(_scattered(g, experts, t) for g, t in zip(grads_in_order, tensors))


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    device_type = x.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype


def _maps_of(tensors: Sequence[torch.Tensor | None], n: int, experts: torch.Tensor | None) -> list[ScaledMap]:
    """The maps of the flat (weights, in_scales, out_scales); of only the given experts' rows if `experts` is set."""
    if experts is not None:
        tensors = [None if t is None else t[experts] for t in tensors]
    return list(zip(tensors[:n], tensors[n : 2 * n], tensors[2 * n :]))


def _scattered(grad: torch.Tensor | None, experts: torch.Tensor | None, like: torch.Tensor | None):
    """The gradient of a whole expert stack from that of the given experts' rows (zero for the others)."""
    if grad is None or experts is None:
        return grad
    return grad.new_zeros(like.shape).index_copy_(0, experts, grad)


def scaled_linear(
    x: torch.Tensor,
    maps: Sequence[ScaledMap],
    group_sizes: torch.Tensor | None = None,
    experts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """`b * ((a * x) @ W.T)` for each map of the same input `x`, in one autograd node; one output per map. Grouped
    by expert (`group_sizes`: rows of `x` per expert, sorted), optionally over only the `experts` given (weights and
    scales indexed by them on the fly, so that nothing beyond the parameters is saved for backward)."""
    weights, in_scales, out_scales = zip(*maps)
    return _ScaledLinearFunction.apply(x, group_sizes, experts, len(maps), *weights, *in_scales, *out_scales)


# --- What a forward multiplies by: cached folded weights without gradients, the maps themselves with them --------


def reuses_folded_weights() -> bool:
    """Whether this forward multiplies by cached folded weights: when no gradient is recorded. Not under
    torch.compile (which fuses the fold itself) nor torch.distributed: sharded parameters (FSDP) are gathered into
    fresh storage for every forward, which a cached fold could outlive."""
    return not (torch.is_grad_enabled() or torch.compiler.is_compiling() or _distributed())


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _forward_maps(owners: Sequence[nn.Module]) -> tuple[list[list[ScaledMap]], bool]:
    """Each owner's `scaled_maps()` as this forward takes them, and whether they are folded. Without gradients:
    folded (no scales left), computed once and kept on the owner for the forwards that follow (`prepared_scales`
    checks them against the parameters, and so does this function where that check cannot see them: see
    `_changed_for_its_forward`). With gradients: as they are, for `scaled_linear` to fold on the fly, and the cached
    folded weights freed, except under torch.compile, which must not touch them (a compiled forward that changed
    them would be recompiled at its next call)."""
    if reuses_folded_weights():
        return [_cached_folded_maps(owner) for owner in owners], True
    if not torch.compiler.is_compiling():
        for owner in owners:
            owner.__dict__.pop("_folded_weights", None)
    return [owner.scaled_maps() for owner in owners], False


def _cached_folded_maps(owner: nn.Module) -> list[ScaledMap]:
    cached = owner.__dict__.get("_folded_weights")
    if cached is None or (_changed_for_its_forward(owner) and cached[0] != _parameters_key(owner)):
        folded = [(fold_scales(*scaled_map, scaled_map[0].dtype), None, None) for scaled_map in owner.scaled_maps()]
        cached = owner.__dict__["_folded_weights"] = (_parameters_key(owner), folded)
    return cached[1]


def _changed_for_its_forward(owner: nn.Module) -> bool:
    """Whether a library may change `owner`'s weights for its forward only, after `prepared_scales` checked them: a
    parametrization (PEFT registers its adapters on parameters for each forward) or a hook (accelerate's offloading
    loads the weights in one)."""
    return "parametrizations" in owner._modules or bool(owner._forward_pre_hooks) or "forward" in owner.__dict__


def scaled_projections(x: torch.Tensor, owners: Sequence[nn.Module]) -> tuple[torch.Tensor, ...]:
    """Each owner's `b * (W (a * x))` for one input `x` (each owner one map): plain matmuls by the cached folded
    weights without gradients, one fused `scaled_linear` with them."""
    maps, folded = _forward_maps(owners)
    if folded:
        return tuple(F.linear(x, weight) for ((weight, _, _),) in maps)
    return scaled_linear(x, [owner_map for (owner_map,) in maps])


def expert_maps(
    experts: nn.Module, group_sizes: torch.Tensor
) -> tuple[list[ScaledMap], torch.Tensor | None, torch.Tensor]:
    """The experts' maps for this forward (see `_forward_maps`) and, for `scaled_linear`, which experts to fold and
    their group sizes: when folding on the fly, only the experts that receive tokens (`receiving_experts`)."""
    (maps,), folded = _forward_maps([experts])
    return (maps, None, group_sizes) if folded else (maps, *receiving_experts(group_sizes))


def receiving_experts(group_sizes: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The experts that receive tokens and their group sizes, when at most half do (small batches, many experts):
    folding costs weight-sized passes per expert whatever its token count, so the others are skipped. None (every
    expert) otherwise, on accelerators, where reading the sizes would be a device sync, and under torch.compile."""
    if group_sizes.device.type != "cpu" or torch.compiler.is_compiling():
        return None, group_sizes
    receiving = group_sizes.nonzero().squeeze(-1)
    if 2 * receiving.numel() > group_sizes.numel():
        return None, group_sizes
    return receiving, group_sizes[receiving]


def _parameters_key(owner: nn.Module) -> tuple:
    """What the cached folded weights of `owner` were computed from: every parameter below it (parametrizations and
    adapters keep theirs there) by storage and version, which an optimizer step or `load_state_dict` bumps (they
    write in place) and `to()` replaces."""
    parameters = [p for module in _modules_below(owner) for p in module._parameters.values() if p is not None]
    return (parameters[0].dtype, parameters[0].device, *((p._version, p.data_ptr()) for p in parameters))


def _modules_below(module: nn.Module) -> list[nn.Module]:
    """`module` and every module below it, walked by hand: `modules()`' bookkeeping costs more than the walk."""
    found, pending = [], [module]
    while pending:
        found.append(pending.pop())
        pending.extend(child for child in found[-1]._modules.values() if child is not None)
    return found


# --- The forward's `with` block ----------------------------------------------------------------------------------


@contextlib.contextmanager
def prepared_scales(model: nn.Module, kv_cache: Cache | None) -> Iterator[None]:
    """The scales of `model` readied for one forward, run inside this block.

    Without gradients: the folded weights cached by earlier forwards are checked against their parameters (stale
    ones are dropped and refolded where used), except when this forward extends the KV cache of the last one, whose
    keys and values those very weights computed: the decoding steps of one cache take them as they are (checking
    every map at every token is a measurable share of a decoding step; a parameter edited in place between two steps
    of one cache, other than by `load_state_dict`, is seen from the next prompt on). In a training forward: every
    magnitude-direction vector formed at once (`formed_scale_vectors`), each scale reading its own as `formed`."""
    if reuses_folded_weights():
        if not _extends_checked_kv_cache(model, kv_cache):
            _drop_stale_folded_weights(model)
        yield
        return
    formed = formed_scale_vectors(model)
    for scale, vector in formed.items():
        scale.__dict__["formed"] = vector
    try:
        yield
    finally:
        for scale in formed:
            scale.__dict__.pop("formed", None)


def _drop_stale_folded_weights(model: nn.Module) -> None:
    for module in _modules_below(model):
        cached = module.__dict__.get("_folded_weights")
        if cached is not None and cached[0] != _parameters_key(module):
            del module.__dict__["_folded_weights"]


def _extends_checked_kv_cache(model: nn.Module, kv_cache: Cache | None) -> bool:
    """Whether `kv_cache` is the KV cache of this model's last forward without gradients (and no state dict was
    loaded since); if not, it becomes that cache."""
    if kv_cache is None:
        return False
    checked = model.__dict__.get("_folded_weights_checked_for")
    if checked is not None and checked() is kv_cache:
        return True
    model.__dict__["_folded_weights_checked_for"] = weakref.ref(kv_cache)
    return False


def forget_checked_kv_cache(model: nn.Module, incompatible_keys=None) -> None:
    """A `load_state_dict` post-hook: the next forward checks the cached folded weights, whatever its KV cache."""
    model.__dict__.pop("_folded_weights_checked_for", None)


def formed_scale_vectors(model: nn.Module) -> dict[nn.Module, torch.Tensor]:
    """Every magnitude-direction vector of `model` (its scales with `scale_param == "magdir"`), formed at once and
    stacked by shape: a few recorded ops for the whole model instead of several per vector. Only for a forward with
    gradients whose layers read their parameters now: not under gradient checkpointing (the recomputed layers must
    record what the first pass did), torch.distributed (FSDP gathers each layer's parameters when it runs) or
    torch.compile (which fuses the small ops itself); empty there."""
    if torch.compiler.is_compiling() or not torch.is_grad_enabled() or _distributed():
        return {}
    by_shape = {}
    for module in model.modules():  # attributes read from `__dict__`: a missing one costs an exception otherwise
        if model.training and module.__dict__.get("gradient_checkpointing"):
            return {}
        if module.__dict__.get("scale_param") == "magdir":
            magnitude, direction = module.magnitude, module.direction
            by_shape.setdefault((direction.shape, direction.dtype), []).append((module, magnitude, direction))
    formed = {}
    for group in by_shape.values():
        scales, magnitudes, directions = zip(*group)
        vectors = scales[0].magnitude_direction(torch.stack(magnitudes), torch.stack(directions))
        formed.update(zip(scales, vectors.unbind()))
    return formed


# --- transformers' experts kernels on the folded expert weights --------------------------------------------------


class _FoldedExperts:
    """`ScaleVecExperts` as transformers' experts functions see it: they read `gate_up_proj` and `down_proj`
    directly, so these are the folded weights (everything else is the module's)."""

    def __init__(self, experts: nn.Module):
        self._experts = experts
        self.gate_up_proj, self.down_proj = experts.folded_weights()

    def __getattr__(self, name: str):
        return getattr(self._experts, name)


def _on_folded_weights(name: str) -> Callable:
    # looked up at every call: a function registered in place of transformers' own later (kernels, tests) is used
    def forward(experts, hidden_states, top_k_index, top_k_weights):
        return ALL_EXPERTS_FUNCTIONS[name](_FoldedExperts(experts), hidden_states, top_k_index, top_k_weights)

    return forward


class ScaleVecExpertsInterface(ExpertsInterface):
    """transformers' experts implementations on ScaleVec's folded expert weights. "eager" is ScaleVec's own forward
    (the scales folded inside one grouped GEMM per projection, the fastest measured), and the default."""

    _global_mapping = {name: _on_folded_weights(name) for name in ("grouped_mm", "batched_mm")}


SCALEVEC_EXPERTS_FUNCTIONS = ScaleVecExpertsInterface()
