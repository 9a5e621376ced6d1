"""ScaleVec: a Llama-style decoder (dense or mixture-of-experts) with every scale-vector strategy of
"Negligible in Size, Significant in Effect: On Scale Vectors in Large Language Models" (arXiv 2605.26895).

Ships to the Hub beside `configuration_scalevec.py`: imports only `torch`, `transformers` and that file.
"""

import contextlib
import contextvars
import functools
import inspect
import os
import weakref
from collections.abc import Callable, Iterator, Sequence
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, ExpertsInterface, use_experts_implementation
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import (
    GenericForQuestionAnswering,
    GenericForSequenceClassification,
    GenericForTokenClassification,
    GradientCheckpointingLayer,
)
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
    MoeCausalLMOutputWithPast,
    MoeModelOutputWithPast,
)
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS, dynamic_rope_update
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, auto_docstring, can_return_tuple
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import OutputRecorder, capture_outputs

from .configuration_scalevec import ScaleVecConfig

# --- Compatibility: transformers 5.19 to 5.23 call the cache `past_key_values` everywhere (5.24 renamed it) -----
OUTPUT_CACHE_FIELD = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"
MASK_CACHE_ARGUMENT = "cache" if "cache" in inspect.signature(create_causal_mask).parameters else "past_key_values"


def legacy_cache_name(forward: Callable) -> Callable:
    """Accept `past_key_values=` for `cache=`: as its deprecated name where transformers renamed it (with
    transformers' warning), silently where it is still the current name."""
    if OUTPUT_CACHE_FIELD == "cache":
        return deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")(forward)

    @functools.wraps(forward)
    def renamed(*args, past_key_values: Cache | None = None, **kwargs):
        if past_key_values is not None:
            kwargs["cache"] = past_key_values
        return forward(*args, **kwargs)

    return renamed


# --- End of compatibility ----------------------------------------------------------------------------------------

try:
    from torch.distributed.tensor import DTensor, Shard
except ImportError:  # a torch built without distributed support
    DTensor = Shard = None

# `save_pretrained` records only the saved class's Auto class; users load the base model and the other heads too.
AUTO_MAP = {
    "AutoConfig": "configuration_scalevec.ScaleVecConfig",
    "AutoModel": "modeling_scalevec.ScaleVecModel",
    "AutoModelForCausalLM": "modeling_scalevec.ScaleVecForCausalLM",
    "AutoModelForSequenceClassification": "modeling_scalevec.ScaleVecForSequenceClassification",
    "AutoModelForTokenClassification": "modeling_scalevec.ScaleVecForTokenClassification",
    "AutoModelForQuestionAnswering": "modeling_scalevec.ScaleVecForQuestionAnswering",
}


class ScaleVecScale(nn.Module):
    """A learnable scale vector of a given role ("input": foldable into a linear map; "output": not).

    Stored as itself (`weight`) or as magnitude x direction (`magnitude * direction / rms(direction)`), both
    initialised so that the vector is all ones. `scale_param=None` holds no parameter: the scale is fixed at 1.
    """

    def __init__(self, shape: Sequence[int], scale_param: str | None, role: str):
        super().__init__()
        self.role = role
        self.scale_param = scale_param
        if scale_param == "magdir":
            self.magnitude = nn.Parameter(torch.ones(*shape[:-1], 1))
            self.direction = nn.Parameter(torch.ones(*shape))
        elif scale_param == "direct":
            self.weight = nn.Parameter(torch.ones(*shape))

    def vector(self) -> torch.Tensor | None:
        if self.scale_param == "magdir":
            formed = None if torch.compiler.is_compiling() else _FORMED_SCALE_VECTORS.get()  # dynamo cannot read it
            vector = formed.get(self) if formed is not None else None
            return _magnitude_direction(self.magnitude, self.direction) if vector is None else vector
        return self.weight if self.scale_param == "direct" else None


def _magnitude_direction(magnitude: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
    """`g * u / rms(u)` over the last dimension, the per-vector factor formed first (three small ops, not five)."""
    norm = torch.linalg.vector_norm(direction, dim=-1, keepdim=True)
    return direction * (magnitude * direction.shape[-1] ** 0.5 / norm)


# The magnitude-direction vectors of a training forward, formed at its start (see `_formed_scale_vectors`)
_FORMED_SCALE_VECTORS = contextvars.ContextVar("scalevec_formed_scale_vectors", default=None)


def _formed_scale_vectors(model: "ScaleVecModel") -> dict[ScaleVecScale, torch.Tensor] | None:
    """Every magnitude-direction vector of `model`, formed at once and stacked by shape: a few recorded ops for the
    whole model instead of a dozen per vector (1.5 -> 0.6 ms per step for the 49 vectors of a 4-layer model,
    forward and backward). Only for a forward with gradients whose layers read their parameters now: not under
    gradient checkpointing (the recomputed layers must record what the first pass did), torch.distributed (FSDP
    gathers each layer's parameters when it runs) or torch.compile (which fuses the small ops itself)."""
    checkpointing = model.training and any(layer.gradient_checkpointing for layer in model.layers)
    if not torch.is_grad_enabled() or checkpointing or _distributed() or torch.compiler.is_compiling():
        return None
    by_shape = {}
    for scale in model.modules():
        if isinstance(scale, ScaleVecScale) and scale.scale_param == "magdir":
            magnitude, direction = scale.magnitude, scale.direction
            by_shape.setdefault((direction.shape, direction.dtype), []).append((scale, magnitude, direction))
    formed = {}
    for group in by_shape.values():
        scales, magnitudes, directions = zip(*group)
        formed.update(zip(scales, _magnitude_direction(torch.stack(magnitudes), torch.stack(directions)).unbind()))
    return formed


class ScaleVecRMSNorm(ScaleVecScale):
    def __init__(self, hidden_size: int, config: ScaleVecConfig, role: str, scaled: bool = True):
        super().__init__((hidden_size,), config.scale_param if scaled else None, role)
        self.variance_epsilon = config.rms_norm_eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        scale = self.vector()
        return hidden_states.to(input_dtype) if scale is None else scale * hidden_states.to(input_dtype)


# --- Kernels: scaled matmuls with the scales folded into the weights, grouped GEMMs for experts --------------------


def _group_sizes(sorted_groups: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Rows per group of a sorted group index. `searchsorted`, not `bincount`: the output shape does not depend on
    the data (torch.compile traces it), there is no host sync, and it is deterministic on GPUs, unlike `histc`."""
    groups = torch.arange(num_groups, device=sorted_groups.device, dtype=sorted_groups.dtype)
    ends = torch.searchsorted(sorted_groups, groups, right=True)
    return ends.diff(prepend=ends.new_zeros(1))


def _grouped_offsets(group_sizes: torch.Tensor) -> torch.Tensor:
    return group_sizes.cumsum(0).to(torch.int32)


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
    offs = _grouped_offsets(group_sizes)
    return F.grouped_mm(a, b, offs=offs) if _use_grouped_mm(a, b) else torch.ops.scalevec.grouped_mm_loop(a, b, offs)


def _grouped_linear(x: torch.Tensor, weight: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """Rows of `x` sorted by group; group `g` is multiplied by `weight[g].T` (weight: (G, out, in))."""
    return _grouped_mm(x, weight.transpose(-2, -1), group_sizes)


def _grouped_weight_grad(grad: torch.Tensor, x: torch.Tensor, group_sizes: torch.Tensor) -> torch.Tensor:
    """Per group `grad_g.T @ x_g`, shape (G, out, in)."""
    return _grouped_mm(grad.T, x, group_sizes)


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    device_type = x.device.type
    return torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype


def _cpu_kernels(*tensors: torch.Tensor | None) -> ModuleType | None:
    """ScaleVec's fused CPU kernels (`scalevec/cpu_kernels.py`, opt-in with SCALEVEC_CPU_KERNELS=1) when they
    apply to `tensors`: plain contiguous fp32 CPU tensors, outside torch.compile. None where ScaleVec itself is not
    installed (remote code) or the kernels cannot be built."""
    if os.environ.get("SCALEVEC_CPU_KERNELS") != "1" or torch.compiler.is_compiling():
        return None
    plain = (torch.Tensor, nn.Parameter)
    present = [t for t in tensors if t is not None]
    if not all(type(t) in plain and t.device.type == "cpu" and t.dtype == torch.float32 for t in present):
        return None
    if not all(t.is_contiguous() for t in present):
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


def _effective_weight(weight, in_scale, out_scale, dtype: torch.dtype) -> torch.Tensor:
    """`diag(b) W diag(a)` in `dtype`, shape (..., out, in): one pass per scale, the second in place (one pass in
    all with the CPU kernels)."""
    if in_scale is None and out_scale is None:
        return weight.to(dtype)
    both = in_scale is not None and out_scale is not None
    kernels = _cpu_kernels(weight, in_scale, out_scale) if both and dtype == weight.dtype else None
    if kernels is not None:
        return kernels.fold(*_kernel_operands(weight, in_scale, out_scale)).view(weight.shape)
    first = in_scale.unsqueeze(-2) if out_scale is None else out_scale.unsqueeze(-1)
    folded = torch.mul(weight, first, out=weight.new_empty(weight.shape, dtype=dtype))
    return folded if in_scale is None or out_scale is None else folded.mul_(in_scale.unsqueeze(-2))


def _column_sums(matrix: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """`sum_i w_i M_ij` over the rows of `M` (..., out, in): a vector-matrix product, no temporary."""
    if weights is None:
        return matrix.sum(-2)
    return weights @ matrix if matrix.dim() == 2 else (weights.unsqueeze(-2) @ matrix).squeeze(-2)


def _row_sums(matrix: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    """`sum_j w_j M_ij` over the columns of `M` (..., out, in). Batched, as a row vector times the transpose: as a
    batched matrix-vector product, BLAS is ~9x slower on expert stacks."""
    if weights is None:
        return matrix.sum(-1)
    return matrix @ weights if matrix.dim() == 2 else (weights.unsqueeze(-2) @ matrix.mT).squeeze(-2)


def _scale_grads(grad_eff, weight, in_scale, out_scale):
    """Gradients of W, a and b from the gradient G of the folded weight `diag(b) W diag(a)` (shape (..., out, in)):
    `diag(b) G diag(a)` (G rescaled in place) and the column / row sums of `G * W` weighted by the other scale."""
    if in_scale is None and out_scale is None:
        return grad_eff, None, None
    product = grad_eff * weight
    grad_in = grad_out = None
    if in_scale is not None:
        grad_in = _column_sums(product, out_scale)
        grad_eff.mul_(in_scale.unsqueeze(-2))
    if out_scale is not None:
        grad_out = _row_sums(product, in_scale)
        grad_eff.mul_(out_scale.unsqueeze(-1))
    return grad_eff, grad_in, grad_out


def _refold_and_scale_grads(grad_eff, weight, in_scale, out_scale, dtype: torch.dtype, refold: bool):
    """The backward's folded weight (in `dtype`; None unless `refold`) and the gradients of W, a and b from that of
    the folded weight: `_effective_weight` and `_scale_grads`, or, for a map with both scales, one read of W and G
    by the CPU kernels (with one scale the eager passes are few, and the kernels measured no faster)."""
    both = in_scale is not None and out_scale is not None
    kernels = _cpu_kernels(grad_eff, weight, in_scale, out_scale) if both and dtype == weight.dtype else None
    if kernels is None:
        folded = _effective_weight(weight, in_scale, out_scale, dtype) if refold else None
        return folded, _scale_grads(grad_eff, weight, in_scale, out_scale)
    stack, stacked_in, stacked_out = _kernel_operands(weight, in_scale, out_scale)
    folded, grad_in, grad_out = kernels.fold_backward(stack, grad_eff.view(stack.shape), stacked_in, stacked_out)
    return folded.view(weight.shape), (grad_eff, grad_in.view(in_scale.shape), grad_out.view(out_scale.shape))


class _ScaledLinearFunction(torch.autograd.Function):
    """`y_i = x @ (diag(b_i) W_i diag(a_i)).T` for several maps of one input, optionally grouped by expert.

    The scales are folded into each weight on the fly: `out x in` work that does not grow with the token count and
    no extra saved activation. The folded weights are recomputed in backward rather than saved, so the scales cost
    no memory beyond their own size. Each map keeps its own output (as separate projections do), so backward never
    concatenates gradients.
    """

    @staticmethod
    def forward(ctx, x, group_sizes, experts, num_branches, *tensors):
        dtype = _compute_dtype(x)
        ctx.input_dtype, ctx.num_branches = x.dtype, num_branches
        x = x.to(dtype)
        ctx.save_for_backward(x, group_sizes, experts, *tensors)
        outputs = []
        for weight, in_scale, out_scale in _branches(tensors, num_branches, experts):
            folded = _effective_weight(weight, in_scale, out_scale, dtype)
            outputs.append(
                F.linear(x, folded) if group_sizes is None else _grouped_linear(x, folded.flatten(1, -2), group_sizes)
            )
        return tuple(outputs)

    @staticmethod
    def backward(ctx, *grads):
        x, group_sizes, experts, *tensors = ctx.saved_tensors
        flat_x = x.reshape(-1, x.shape[-1])
        grad_x, weight_grads = None, []
        for grad, (weight, in_scale, out_scale) in zip(grads, _branches(tensors, ctx.num_branches, experts)):
            flat_grad = grad.reshape(-1, grad.shape[-1]).to(x.dtype)
            if any(ctx.needs_input_grad[4:]):
                if group_sizes is None:
                    grad_folded = flat_grad.T @ flat_x
                else:
                    grad_folded = _grouped_weight_grad(flat_grad.contiguous(), flat_x, group_sizes).view(weight.shape)
                grad_folded = grad_folded.to(weight.dtype)
                folded, grads_of_branch = _refold_and_scale_grads(
                    grad_folded, weight, in_scale, out_scale, x.dtype, refold=ctx.needs_input_grad[0]
                )
                weight_grads.append(grads_of_branch)
            else:
                folded = _effective_weight(weight, in_scale, out_scale, x.dtype) if ctx.needs_input_grad[0] else None
                weight_grads.append((None, None, None))
            if ctx.needs_input_grad[0]:
                if group_sizes is None:
                    branch_grad_x = flat_grad @ folded
                else:
                    branch_grad_x = _grouped_linear(flat_grad.contiguous(), folded.flatten(1, -2).mT, group_sizes)
                grad_x = branch_grad_x if grad_x is None else grad_x.add_(branch_grad_x)
        grad_x = None if grad_x is None else grad_x.view(x.shape).to(ctx.input_dtype)
        grads_in_order = (g for grad_of in zip(*weight_grads) for g in grad_of)
        return grad_x, None, None, None, *(_scattered(g, experts, t) for g, t in zip(grads_in_order, tensors))


def _branches(tensors: Sequence[torch.Tensor | None], n: int, experts: torch.Tensor | None) -> list[tuple]:
    """(weight, in_scale, out_scale) per branch; of only the given experts' rows if `experts` is set."""
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
    weights: Sequence[torch.Tensor],
    in_scales: Sequence[torch.Tensor | None],
    out_scales: Sequence[torch.Tensor | None],
    group_sizes: torch.Tensor | None = None,
    experts: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """Several scaled linear maps of the same input in one autograd node; one output per map. Grouped by expert
    (`group_sizes`), optionally over only the `experts` given (weights and scales indexed by them on the fly, so
    nothing beyond the parameters is saved for backward)."""
    return _ScaledLinearFunction.apply(x, group_sizes, experts, len(weights), *weights, *in_scales, *out_scales)


# --- Projections: nn.Linear layers and the scale vectors around them -----------------------------------------------


def _vector(scale: ScaleVecScale | None) -> torch.Tensor | None:
    return None if scale is None else scale.vector()


def _linear_scales(
    in_features: int, out_features: int, config: ScaleVecConfig, reads_norm: bool, scaled_elsewhere: str
) -> tuple[ScaleVecScale | None, ScaleVecScale | None]:
    """The column and row scales around a block's linear map. A map that reads a normalised input gets its branch
    scale from `norm_scale="branch"`; any other map gets a column scale from `linear_scale`; every map gets a row
    scale from `linear_scale`, except where a neighbouring map's scale already multiplies the same features
    (`scaled_elsewhere`: "in" or "out"): two such vectors are one parameter stored twice."""
    in_scaled = config.norm_scale == "branch" if reads_norm else config.linear_scale in ("in", "both")
    in_scaled = in_scaled and scaled_elsewhere != "in"
    # A single output row (the shared-expert gate) has no direction for a row scale to precondition.
    out_scaled = config.linear_scale in ("out", "both") and out_features > 1 and scaled_elsewhere != "out"
    in_scale = ScaleVecScale((in_features,), config.scale_param, "input") if in_scaled else None
    out_scale = ScaleVecScale((out_features,), config.scale_param, "input") if out_scaled else None
    return in_scale, out_scale


class ScaleVecScaledMap:
    """A module with a `weight` and the column / row scale vectors (`in_scale`, `out_scale`) around it."""

    def scales(self) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        return _vector(self.in_scale), _vector(self.out_scale)


class ScaleVecLinear(ScaleVecScaledMap, nn.Linear):
    """A block's linear map `W`, a plain `nn.Linear` (its forward is `nn.Linear.forward`), with the scale vectors
    around it: the block computes `y = b * (W (a * x))` through `project`. Keeping the scales outside the module's
    forward is what lets libraries that wrap or replace `nn.Linear` layers (PEFT, torchao, quanto, tensor-parallel
    plans) work unchanged: a LoRA delta lands inside the scales, next to `W`, so merging it into `W` is exact."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        config: ScaleVecConfig,
        reads_norm: bool,
        scaled_elsewhere: str = "",
    ):
        super().__init__(in_features, out_features, bias=False)
        self.in_scale, self.out_scale = _linear_scales(in_features, out_features, config, reads_norm, scaled_elsewhere)


def _unwrapped(module: nn.Module) -> nn.Module:
    # PEFT's tuner layers (LoRA and the rest) keep the wrapped layer as their base layer
    return module.get_base_layer() if hasattr(module, "get_base_layer") else module


def _is_plain(module: nn.Module) -> bool:
    """A ScaleVec projection that nothing wraps, hooks or quantizes (parametrizations, which swap the class for a
    subclass and compute `weight`, are honoured by reading `weight`)."""
    return (
        isinstance(module, ScaleVecLinear)
        and type(module.weight) in (torch.Tensor, nn.Parameter)
        and not (module._forward_hooks or module._forward_pre_hooks or "forward" in vars(module))
    )


def _local_tensor(tensor: torch.Tensor | None) -> torch.Tensor | None:
    return tensor.to_local() if DTensor is not None and isinstance(tensor, DTensor) else tensor


def _local_scales(weight: torch.Tensor, in_scale, out_scale) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Under a tensor-parallel plan, a column-wise projection (weight sharded by rows) sees the whole input and
    yields its shard of the output, a row-wise one the reverse: the scale on the sharded side is cut as the weight
    is. Scales are replicated, so a magnitude-direction vector is formed whole before it is cut."""
    if DTensor is None or not isinstance(weight, DTensor):
        return in_scale, out_scale
    (placement,) = weight.placements  # transformers' tensor parallelism shards over a 1-D mesh
    if not isinstance(placement, Shard):
        return in_scale, out_scale
    rank, size = weight.device_mesh.get_local_rank(), weight.device_mesh.size()
    if placement.dim == 0 and out_scale is not None:
        out_scale = out_scale.chunk(size)[rank]
    if placement.dim == 1 and in_scale is not None:
        in_scale = in_scale.chunk(size)[rank]
    return in_scale, out_scale


def _call_scaled(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`b * module(a * x)`, whatever a library made of `module` (a replacement holds no scales: see
    `ScaleVecProjections`)."""
    base = _unwrapped(module)
    if not isinstance(base, ScaleVecLinear):
        return module(x)
    in_scale, out_scale = _local_scales(base.weight, *base.scales())
    y = module(x if in_scale is None else x * in_scale.to(x.dtype))
    return y if out_scale is None else y * out_scale.to(y.dtype)


def _folded(weight: torch.Tensor, in_scale: torch.Tensor | None, out_scale: torch.Tensor | None) -> torch.Tensor:
    """`diag(b) W diag(a)` by differentiable ops, for weights (..., out, in) and scales (..., in) / (..., out)."""
    if out_scale is not None:
        weight = weight * out_scale.unsqueeze(-1)
    return weight if in_scale is None else weight * in_scale.unsqueeze(-2)


def _reuses_folded_weights() -> bool:
    """When no gradient is recorded. Not under torch.distributed: sharded parameters (FSDP) are gathered into fresh
    storage for every forward, which a cached fold could outlive."""
    return not (torch.is_grad_enabled() or torch.compiler.is_compiling() or _distributed())


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


# True while a forward extends a KV cache whose first forward checked the folds: the keys and values in that cache
# were computed with those weights, so the decoding steps that follow take them as they are. Checking every map's
# parameters at every token costs 4 % of a 0.12B decoding step (cold objects between weight-sized reads).
_EXTENDING_CHECKED_KV_CACHE = contextvars.ContextVar("scalevec_extending_checked_kv_cache", default=False)


@contextlib.contextmanager
def _set(variable: contextvars.ContextVar, value: object) -> Iterator[None]:
    """`variable` set to `value` inside the block; left alone for a falsy value (the default, and all that
    torch.compile ever sees)."""
    token = variable.set(value) if value else None
    try:
        yield
    finally:
        if token is not None:
            variable.reset(token)


def _extends_checked_kv_cache(model: nn.Module, cache: Cache | None) -> bool:
    """Whether `cache` is the KV cache of this model's last forward without gradients (and no state dict was loaded
    since); if not, it becomes that cache. A forward with gradients drops the folds, so training in between
    refolds."""
    if cache is None or torch.is_grad_enabled() or torch.compiler.is_compiling():
        return False
    checked = model.__dict__.get("_folds_checked_for")
    if checked is not None and checked() is cache:
        return True
    model.__dict__["_folds_checked_for"] = weakref.ref(cache)
    return False


def _forget_checked_kv_cache(model: nn.Module, incompatible_keys) -> None:
    model.__dict__.pop("_folds_checked_for", None)


def _folded_for_inference(owner: nn.Module, fold: Callable[[], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, ...]:
    """`fold()`, computed once and reused while no parameter of `owner` changes: an optimizer step or
    `load_state_dict` writes in place (a new tensor version), `to()` makes new tensors. Decoding then costs what the
    folded model costs instead of refolding every weight for every token; the steps extending one KV cache do not
    check again (`_EXTENDING_CHECKED_KV_CACHE`)."""
    cached = owner.__dict__.get("_inference_weights")
    if cached is not None and _EXTENDING_CHECKED_KV_CACHE.get():
        return cached[1]
    parameters = _parameters_below(owner)
    key = (parameters[0].dtype, parameters[0].device, *((p._version, p.data_ptr()) for p in parameters))
    if cached is None or cached[0] != key:
        cached = owner.__dict__["_inference_weights"] = (key, fold())
    return cached[1]


def _parameters_below(module: nn.Module) -> list[nn.Parameter]:
    """Every parameter of `module` and its submodules (parametrizations and adapters keep theirs there), without the
    bookkeeping of `parameters()`: the cache key is paid per map per decoded token (2.6 against 4.2 us)."""
    parameters, modules = [], [module]
    while modules:
        current = modules.pop()
        parameters.extend(p for p in current._parameters.values() if p is not None)
        modules.extend(child for child in current._modules.values() if child is not None)
    return parameters


def _drop_inference_weights(owner: nn.Module) -> None:
    # training needs the memory more than a later evaluation needs the time
    owner.__dict__.pop("_inference_weights", None)


def project(x: torch.Tensor, *modules: nn.Module) -> tuple[torch.Tensor, ...]:
    """The outputs of several projections of one input, each with its scales. When every module is a plain
    ScaleVec projection with scales, they run as one fused matmul with the scales folded into the weights on the
    fly (see `_ScaledLinearFunction`); otherwise each module is called, so any wrapper or hook is honoured."""
    if all(_is_plain(module) for module in modules) and any(_has_scales(module) for module in modules):
        return _scaled_outputs(x, modules)
    return tuple(_call_scaled(module, x) for module in modules)


def _scaled_outputs(x: torch.Tensor, maps: Sequence[ScaleVecScaledMap]) -> tuple[torch.Tensor, ...]:
    """Each map's output with its scales folded into its weight: cached when no gradient is recorded, otherwise
    on the fly inside one fused matmul."""
    if _reuses_folded_weights():
        return tuple(F.linear(x, _inference_weight(owner)) for owner in maps)
    for owner in maps:
        _drop_inference_weights(owner)
    in_scales, out_scales = zip(*(owner.scales() for owner in maps))
    return scaled_linear(x, [owner.weight for owner in maps], in_scales, out_scales)


def _has_scales(module: ScaleVecScaledMap) -> bool:
    return module.in_scale is not None or module.out_scale is not None


def _inference_weight(owner: ScaleVecScaledMap) -> torch.Tensor:
    return _folded_for_inference(owner, lambda: (_folded(owner.weight, *owner.scales()),))[0]


class ScaleVecProjections(nn.Module):
    """A module holding ScaleVec projections. Libraries that replace `nn.Linear` layers with their own (quanto,
    serving engines) keep the weight and drop the scale vectors around it, which would change the model silently:
    such a replacement is refused, and wrappers that keep the projection as their base layer (PEFT) are welcome."""

    def __setattr__(self, name: str, value: object) -> None:
        current = _unwrapped(self._modules[name]) if name in self.__dict__.get("_modules", {}) else None
        scaled = isinstance(current, ScaleVecLinear) and _has_scales(current)
        if scaled and not isinstance(_unwrapped(value), ScaleVecLinear):
            raise ValueError(
                f"Replacing the ScaleVec projection `{name}` with {type(value).__name__} would drop its scale "
                "vectors and change the model. Fold the scales into the weights first (`scalevec-convert fold`, "
                "or load the folded checkpoint), then quantize or convert the folded model."
            )
        super().__setattr__(name, value)


# --- The decoder, in modeling_llama.py's order: rotary, MLP, MoE, attention, layer, model, heads -------------------


class ScaleVecRotaryEmbedding(nn.Module):
    def __init__(self, config: ScaleVecConfig):
        super().__init__()
        self.max_seq_len_cached = config.max_position_embeddings
        self.original_max_seq_len = config.max_position_embeddings
        self.config = config
        self.rope_type = config.rope_parameters["rope_type"]
        rope_init_fn: Callable = self.compute_default_rope_parameters
        if self.rope_type != "default":
            rope_init_fn = ROPE_INIT_FUNCTIONS[self.rope_type]
        inv_freq, self.attention_scaling = rope_init_fn(config)
        self.inv_freq = nn.Buffer(inv_freq, persistent=False)
        self.original_inv_freq = nn.Buffer(inv_freq.clone(), persistent=False)

    @staticmethod
    def compute_default_rope_parameters(config: ScaleVecConfig, **kwargs) -> tuple[torch.Tensor, float]:
        base, dim = config.rope_parameters["rope_theta"], config.head_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv_freq, 1.0

    @dynamic_rope_update
    def forward(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
    cos, sin = cos.unsqueeze(unsqueeze_dim), sin.unsqueeze(unsqueeze_dim)
    return (q * cos) + (rotate_half(q) * sin), (k * cos) + (rotate_half(k) * sin)


class ScaleVecMLP(ScaleVecProjections):
    def __init__(self, config: ScaleVecConfig, intermediate_size: int):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_proj = ScaleVecLinear(config.hidden_size, intermediate_size, config, reads_norm=True)
        self.up_proj = ScaleVecLinear(config.hidden_size, intermediate_size, config, reads_norm=True)
        # down reads silu(gate) * up, whose features up's row scales already multiply
        covered = "in" if config.linear_scale == "both" else ""
        self.down_proj = ScaleVecLinear(
            intermediate_size, config.hidden_size, config, reads_norm=False, scaled_elsewhere=covered
        )
        self.act_fn = ACT2FN[config.hidden_act]

    def forward(self, x):
        gate, up = project(x, self.gate_proj, self.up_proj)
        return project(self.act_fn(gate) * up, self.down_proj)[0]


class ScaleVecTopKRouter(ScaleVecScaledMap, nn.Module):
    """Softmax router in fp32, top-k, optional renormalisation: the Qwen3-MoE / Mixtral semantics. Like theirs, a
    module with a `weight` rather than an `nn.Linear`, so that libraries adapting linear layers leave it alone."""

    def __init__(self, config: ScaleVecConfig):
        super().__init__()
        self.top_k = config.num_experts_per_tok
        self.norm_topk_prob = config.norm_topk_prob
        self.weight = nn.Parameter(torch.empty(config.num_experts, config.hidden_size))
        self.in_scale, self.out_scale = _linear_scales(
            config.hidden_size, config.num_experts, config, reads_norm=True, scaled_elsewhere=""
        )

    def forward(self, hidden_states):
        (router_logits,) = _scaled_outputs(hidden_states, (self,))
        router_probs = F.softmax(router_logits, dtype=torch.float, dim=-1)
        top_k_weights, top_k_index = torch.topk(router_probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_k_weights = top_k_weights / top_k_weights.sum(dim=-1, keepdim=True)
        return router_logits, top_k_weights.to(router_logits.dtype), top_k_index


class _FoldedExperts:
    """`ScaleVecExperts` as transformers' experts functions see it: they read `gate_up_proj` and `down_proj`
    directly, so these are the folded weights (everything else is the module's)."""

    def __init__(self, experts: "ScaleVecExperts"):
        self._experts = experts
        self.gate_up_proj, self.down_proj = experts.folded_weights()

    def __getattr__(self, name: str):
        return getattr(self._experts, name)


def _on_folded_weights(experts_forward: Callable) -> Callable:
    def forward(experts, hidden_states, top_k_index, top_k_weights):
        return experts_forward(_FoldedExperts(experts), hidden_states, top_k_index, top_k_weights)

    return forward


class ScaleVecExpertsInterface(ExpertsInterface):
    """transformers' experts implementations on ScaleVec's folded expert weights. "eager" is ScaleVec's own forward
    (the scales folded inside one grouped GEMM per projection, the fastest measured), and the default."""

    _global_mapping = {name: _on_folded_weights(ALL_EXPERTS_FUNCTIONS[name]) for name in ("grouped_mm", "batched_mm")}


SCALEVEC_EXPERTS_FUNCTIONS = ScaleVecExpertsInterface()


@use_experts_implementation(experts_interface=SCALEVEC_EXPERTS_FUNCTIONS)
class ScaleVecExperts(nn.Module):
    """SwiGLU experts as stacked 3-D weights (gate rows first in `gate_up_proj`), with per-expert scales:
    branch scales on gate and up (E, 2, H), row scales (E, 2, I) and (E, H), column scales on down (E, I) unless
    the up rows already scale those features."""

    def __init__(self, config: ScaleVecConfig):
        super().__init__()
        num_experts, hidden, inter = config.num_experts, config.hidden_size, config.moe_intermediate_size
        self.num_experts, self.intermediate_size = num_experts, inter
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))
        self.act_fn = ACT2FN[config.hidden_act]
        rows, cols = config.linear_scale in ("out", "both"), config.linear_scale in ("in", "both")

        def scale(shape: tuple[int, ...], present: bool) -> ScaleVecScale | None:
            return ScaleVecScale(shape, config.scale_param, "input") if present else None

        self.gate_up_in_scale = scale((num_experts, 2, hidden), config.norm_scale == "branch")
        self.gate_up_out_scale = scale((num_experts, 2, inter), rows)
        self.down_in_scale = scale((num_experts, inter), cols and not rows)  # as in ScaleVecMLP
        self.down_out_scale = scale((num_experts, hidden), rows)

    def parts(self) -> tuple[tuple[torch.Tensor | None, ...], tuple[torch.Tensor | None, ...]]:
        """(gate_up (E, 2, I, H), its column and row scales), (down (E, H, I), its column and row scales), for the
        experts this process holds: under expert parallelism every one of them is sharded by expert."""
        gate_up = (
            self.gate_up_proj.unflatten(1, (2, self.intermediate_size)),
            self.gate_up_in_scale,
            self.gate_up_out_scale,
        )
        down = (self.down_proj, self.down_in_scale, self.down_out_scale)
        return tuple(tuple(map(_local_tensor, (weight, _vector(a), _vector(b)))) for weight, a, b in (gate_up, down))

    def folded_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`gate_up_proj` and `down_proj` with every expert scale folded in (differentiably)."""
        gate_up, down = (_folded(*part) for part in self.parts())
        return gate_up.flatten(1, 2), down

    def forward(self, hidden_states, top_k_index, top_k_weights):
        flat_index = top_k_index.reshape(-1)
        order = flat_index.argsort(stable=True)
        token_index = order // top_k_index.shape[-1]
        group_sizes = _group_sizes(flat_index[order], self.num_experts)
        if _reuses_folded_weights():
            gate_up, down = _folded_for_inference(self, self.folded_weights)
            gate_up_parts, down_parts, experts = (gate_up, None, None), (down, None, None), None
        else:
            _drop_inference_weights(self)
            gate_up_parts, down_parts = self.parts()
            experts, group_sizes = _receiving_experts(group_sizes)
        weight, in_scale, out_scale = gate_up_parts
        x = hidden_states[token_index]
        (hidden,) = scaled_linear(x, (weight,), (in_scale,), (out_scale,), group_sizes, experts)
        gate, up = hidden.chunk(2, dim=-1)
        weight, in_scale, out_scale = down_parts
        (hidden,) = scaled_linear(self.act_fn(gate) * up, (weight,), (in_scale,), (out_scale,), group_sizes, experts)
        hidden = hidden * top_k_weights.reshape(-1)[order, None]
        # Undo the sort and sum over the k choices: deterministic on every device, unlike `index_add_`.
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return hidden[inverse].view(*top_k_index.shape, -1).sum(dim=1).to(hidden_states.dtype)


def _receiving_experts(group_sizes: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor]:
    """The experts that receive tokens and their group sizes, when at most half do (small batches, many experts):
    folding costs weight-sized passes per expert whatever its token count, so the others are skipped. None (every
    expert) otherwise, on accelerators, where reading the sizes would be a device sync, and under torch.compile."""
    if group_sizes.device.type != "cpu" or torch.compiler.is_compiling():
        return None, group_sizes
    receiving = group_sizes.nonzero().squeeze(-1)
    if 2 * receiving.numel() > group_sizes.numel():
        return None, group_sizes
    return receiving, group_sizes[receiving]


class ScaleVecSparseMoeBlock(ScaleVecProjections):
    def __init__(self, config: ScaleVecConfig):
        super().__init__()
        self.gate = ScaleVecTopKRouter(config)
        self.experts = ScaleVecExperts(config)
        self.shared_expert = self.shared_expert_gate = None
        if config.shared_expert_intermediate_size:
            self.shared_expert = ScaleVecMLP(config, config.shared_expert_intermediate_size)
            self.shared_expert_gate = ScaleVecLinear(config.hidden_size, 1, config, reads_norm=True)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        hidden_states_flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        _, top_k_weights, top_k_index = self.gate(hidden_states_flat)
        output = self.experts(hidden_states_flat, top_k_index, top_k_weights)
        if self.shared_expert is not None:
            shared_gate = torch.sigmoid(project(hidden_states_flat, self.shared_expert_gate)[0])
            output = output + shared_gate * self.shared_expert(hidden_states_flat)
        return output.reshape(hidden_states.shape)


def repeat_kv(hidden_states: torch.Tensor, n_rep: int) -> torch.Tensor:
    batch, num_key_value_heads, slen, head_dim = hidden_states.shape
    if n_rep == 1:
        return hidden_states
    hidden_states = hidden_states[:, :, None, :, :].expand(batch, num_key_value_heads, n_rep, slen, head_dim)
    return hidden_states.reshape(batch, num_key_value_heads * n_rep, slen, head_dim)


def eager_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float,
    dropout: float = 0.0,
    **kwargs: Unpack[TransformersKwargs],
):
    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    attn_weights = torch.matmul(query, key_states.transpose(2, 3)) * scaling
    if attention_mask is not None:
        attn_weights = attn_weights + attention_mask
    attn_weights = F.softmax(attn_weights, dim=-1, dtype=torch.float32).to(query.dtype)
    attn_weights = F.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states).transpose(1, 2).contiguous()
    return attn_output, attn_weights


class ScaleVecAttention(ScaleVecProjections):
    """GQA with RoPE; q, k and v run as one matmul whatever their scales. Optional per-head QK-norm (Qwen3)."""

    def __init__(self, config: ScaleVecConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        q_size, kv_size = config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim
        self.q_proj = ScaleVecLinear(config.hidden_size, q_size, config, reads_norm=True)
        self.k_proj = ScaleVecLinear(config.hidden_size, kv_size, config, reads_norm=True)
        # attention mixes v's features linearly, and o's column scales (per query head: finer under GQA) cover them
        covered = "out" if config.linear_scale == "both" else ""
        self.v_proj = ScaleVecLinear(config.hidden_size, kv_size, config, reads_norm=True, scaled_elsewhere=covered)
        self.o_proj = ScaleVecLinear(q_size, config.hidden_size, config, reads_norm=False)
        qk_norm = ScaleVecRMSNorm if config.qk_norm else nn.Identity
        self.q_norm = qk_norm(self.head_dim, config, role="output")
        self.k_norm = qk_norm(self.head_dim, config, role="output")

    @legacy_cache_name
    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query_states, key_states, value_states = project(hidden_states, self.q_proj, self.k_proj, self.v_proj)
        query_states = self.q_norm(query_states.view(hidden_shape)).transpose(1, 2)
        key_states = self.k_norm(key_states.view(hidden_shape)).transpose(1, 2)
        value_states = value_states.view(hidden_shape).transpose(1, 2)

        cos, sin = position_embeddings
        query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin)
        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)

        attention_interface: Callable = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        (attn_output,) = project(attn_output.reshape(*input_shape, -1).contiguous(), self.o_proj)
        return attn_output, attn_weights


class ScaleVecDecoderLayer(GradientCheckpointingLayer):
    def __init__(self, config: ScaleVecConfig, layer_idx: int):
        super().__init__()
        self.self_attn = ScaleVecAttention(config, layer_idx)
        if config.is_moe_layer(layer_idx):
            self.mlp = ScaleVecSparseMoeBlock(config)
        else:
            self.mlp = ScaleVecMLP(config, config.intermediate_size)
        shared = config.norm_scale == "shared"
        self.input_layernorm = ScaleVecRMSNorm(config.hidden_size, config, role="input", scaled=shared)
        self.post_attention_layernorm = ScaleVecRMSNorm(config.hidden_size, config, role="input", scaled=shared)
        output_norm = ScaleVecRMSNorm if config.output_norm else nn.Identity
        self.attention_output_layernorm = output_norm(config.hidden_size, config, role="output")
        self.mlp_output_layernorm = output_norm(config.hidden_size, config, role="output")

    @legacy_cache_name
    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        use_cache: bool | None = False,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> torch.Tensor:
        # Self Attention
        residual = hidden_states
        hidden_states = self.input_layernorm(hidden_states)
        hidden_states, _ = self.self_attn(
            hidden_states=hidden_states,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            use_cache=use_cache,
            position_embeddings=position_embeddings,
            **kwargs,
        )
        hidden_states = residual + self.attention_output_layernorm(hidden_states)

        # Fully Connected
        residual = hidden_states
        hidden_states = self.post_attention_layernorm(hidden_states)
        hidden_states = self.mlp(hidden_states)
        return residual + self.mlp_output_layernorm(hidden_states)


@auto_docstring
class ScaleVecPreTrainedModel(PreTrainedModel):
    config: ScaleVecConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["ScaleVecDecoderLayer"]
    _can_compile_fullgraph = True
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    _can_record_outputs = {
        "router_logits": OutputRecorder(ScaleVecTopKRouter, index=0),
        "hidden_states": ScaleVecDecoderLayer,
        "attentions": ScaleVecAttention,
    }

    def _init_weights(self, module):
        super()._init_weights(module)
        std = self.config.initializer_range
        if isinstance(module, ScaleVecScale):
            for parameter in module.parameters(recurse=False):
                init.ones_(parameter)
        elif isinstance(module, ScaleVecTopKRouter):
            init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, ScaleVecExperts):
            init.normal_(module.gate_up_proj, mean=0.0, std=std)
            init.normal_(module.down_proj, mean=0.0, std=std)

    def get_correct_experts_implementation(self, requested_experts: str | None) -> str:
        # ScaleVec's own experts forward ("eager") is the default, not transformers' grouped_mm
        allowed = ("eager", *SCALEVEC_EXPERTS_FUNCTIONS)
        if requested_experts not in (None, *allowed):
            raise ValueError(f"`experts_implementation` must be one of {allowed}; got {requested_experts!r}")
        return super().get_correct_experts_implementation(requested_experts or "eager")

    def scale_vector_roles(self) -> dict[str, list[str]]:
        """Names of every scale-vector parameter by role: "input" (foldable into a neighbouring linear map,
        decayed by default) and "output" (output norms and QK-norms: not foldable, not decayed by default)."""
        roles = {"input": [], "output": []}
        for module_name, module in self.named_modules():
            if isinstance(module, ScaleVecScale):
                prefix = f"{module_name}." if module_name else ""
                roles[module.role].extend(prefix + name for name, _ in module.named_parameters(recurse=False))
        return roles

    def num_scale_parameters(self) -> int:
        parameters = dict(self.named_parameters())
        return sum(parameters[name].numel() for names in self.scale_vector_roles().values() for name in names)

    def save_pretrained(self, *args, **kwargs):
        self.config.auto_map = AUTO_MAP
        return super().save_pretrained(*args, **kwargs)


@auto_docstring
class ScaleVecModel(ScaleVecPreTrainedModel):
    def __init__(self, config: ScaleVecConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.vocab_size = config.vocab_size
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, self.padding_idx)
        self.layers = nn.ModuleList(
            [ScaleVecDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        self.norm = ScaleVecRMSNorm(config.hidden_size, config, role="input", scaled=config.norm_scale != "none")
        self.rotary_emb = ScaleVecRotaryEmbedding(config=config)
        self.gradient_checkpointing = False
        self.register_load_state_dict_post_hook(_forget_checked_kv_cache)
        self.post_init()

    @legacy_cache_name
    @merge_with_config_defaults
    @capture_outputs
    @auto_docstring
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast | MoeModelOutputWithPast:
        r"""
        cache (`Cache`, *optional*):
            The keys and values of the tokens seen so far (called `past_key_values` before transformers 5.24).
        """
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)
        if position_ids is None:
            past_seen_tokens = cache.get_seq_length() if cache is not None else 0
            position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
            position_ids = position_ids.unsqueeze(0)

        causal_mask = create_causal_mask(
            config=self.config,
            inputs_embeds=inputs_embeds,
            attention_mask=attention_mask,
            position_ids=position_ids,
            **{MASK_CACHE_ARGUMENT: cache},
        )
        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        extending = _extends_checked_kv_cache(self, cache)
        with _set(_EXTENDING_CHECKED_KV_CACHE, extending), _set(_FORMED_SCALE_VECTORS, _formed_scale_vectors(self)):
            for decoder_layer in self.layers[: self.config.num_hidden_layers]:
                hidden_states = decoder_layer(
                    hidden_states,
                    attention_mask=causal_mask,
                    position_ids=position_ids,
                    cache=cache,
                    use_cache=use_cache,
                    position_embeddings=position_embeddings,
                    **kwargs,
                )
            hidden_states = self.norm(hidden_states)
        output_type = MoeModelOutputWithPast if self.config.num_experts else BaseModelOutputWithPast
        return output_type(last_hidden_state=hidden_states, **{OUTPUT_CACHE_FIELD: cache})


def real_token_mask(attention_mask: torch.Tensor | None, shape: tuple[int, int]) -> torch.Tensor | None:
    """Which of this call's `(batch, length)` tokens are not padding, from any mask the library passes: 2-D over all
    tokens seen (the last `length` are this call's, as in cached decoding), or 4-D `(batch, heads, queries, keys)`,
    boolean or additive, in which a padding token's own key is masked (the queries being the last keys)."""
    if attention_mask is None:
        return None
    batch, length = shape
    if attention_mask.dim() == 2:
        return attention_mask[:, -length:].bool()
    if attention_mask.dtype != torch.bool:
        attention_mask = attention_mask > torch.finfo(attention_mask.dtype).min / 2
    allowed = attention_mask[:, 0, -length:]
    queries = torch.arange(length, device=allowed.device)
    return allowed[:, queries, queries + allowed.shape[-1] - length].expand(batch, length)


def router_z_loss_func(router_logits: tuple[torch.Tensor, ...], attention_mask: torch.Tensor | None) -> torch.Tensor:
    """ST-MoE router z-loss: mean over tokens (padding excluded) and MoE layers of `logsumexp(logits)^2`."""
    logits = torch.stack(router_logits).float()
    z = torch.logsumexp(logits, dim=-1).square()
    if attention_mask is None:
        return z.mean()
    mask = attention_mask.reshape(1, -1).to(z)
    return (z * mask).sum() / (mask.sum() * z.shape[0])


@auto_docstring
class ScaleVecForCausalLM(ScaleVecPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _pp_plan = {"lm_head": (["hidden_states"], ["logits"])}
    _fsdp_plan = {"lm_head": "keep_full_weight"}

    def __init__(self, config: ScaleVecConfig):
        super().__init__(config)
        self.model = ScaleVecModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @legacy_cache_name
    @can_return_tuple
    @auto_docstring
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_router_logits: bool | None = None,
        logits_to_keep: int | torch.Tensor = 0,
        **kwargs: Unpack[TransformersKwargs],
    ) -> CausalLMOutputWithPast | MoeCausalLMOutputWithPast:
        r"""
        cache (`Cache`, *optional*):
            The keys and values of the tokens seen so far (called `past_key_values` before transformers 5.24).
        output_router_logits (`bool`, *optional*):
            Return the router logits and the load-balancing loss (MoE only). Default: when training with labels.
        """
        moe = self.config.num_experts > 0
        if output_router_logits and not moe:
            raise ValueError("`output_router_logits` needs a mixture-of-experts model (`num_experts` > 0)")
        if output_router_logits is None:  # the router losses cost work: only where training uses them
            output_router_logits = moe and self.config.output_router_logits and labels is not None
        router_kwargs = {"output_router_logits": output_router_logits} if moe else {}
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            **router_kwargs,
            **kwargs,
        )
        kept = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        hidden_states = outputs.last_hidden_state[:, kept, :]
        logits = self.lm_head(hidden_states)

        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        fields = {"logits": logits, "hidden_states": outputs.hidden_states}
        fields[OUTPUT_CACHE_FIELD] = getattr(outputs, OUTPUT_CACHE_FIELD)
        if not moe:
            return CausalLMOutputWithPast(loss=loss, attentions=outputs.attentions, **fields)

        aux_loss = None
        if output_router_logits:
            mask = real_token_mask(attention_mask, outputs.last_hidden_state.shape[:2])
            aux_loss = load_balancing_loss_func(
                outputs.router_logits, self.config.num_experts, self.config.num_experts_per_tok, mask
            )
            if labels is not None:
                loss = loss + self.config.router_aux_loss_coef * aux_loss.to(loss.device)
                if self.config.router_z_loss_coef:
                    z_loss = router_z_loss_func(outputs.router_logits, mask)
                    loss = loss + self.config.router_z_loss_coef * z_loss.to(loss.device)
        return MoeCausalLMOutputWithPast(
            loss=loss, aux_loss=aux_loss, attentions=outputs.attentions, router_logits=outputs.router_logits, **fields
        )


class ScaleVecTaskHead:
    """Base of the task heads: transformers' generic heads build their base model with `AutoModel.from_config`,
    which knows ScaleVec only once it is registered for this config's class (a remote-code load imports this file
    beside its own copy of the configuration module, and registers only the head)."""

    def __init__(self, config: ScaleVecConfig):
        AutoModel.register(type(config), ScaleVecModel, exist_ok=True)
        super().__init__(config)


class ScaleVecForSequenceClassification(
    ScaleVecTaskHead, GenericForSequenceClassification, ScaleVecPreTrainedModel
): ...


class ScaleVecForTokenClassification(ScaleVecTaskHead, GenericForTokenClassification, ScaleVecPreTrainedModel): ...


class ScaleVecForQuestionAnswering(ScaleVecTaskHead, GenericForQuestionAnswering, ScaleVecPreTrainedModel): ...


__all__ = [
    "ScaleVecForCausalLM",
    "ScaleVecForQuestionAnswering",
    "ScaleVecForSequenceClassification",
    "ScaleVecForTokenClassification",
    "ScaleVecModel",
    "ScaleVecPreTrainedModel",
]
