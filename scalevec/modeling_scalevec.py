"""ScaleVec: a Llama-style decoder (dense or mixture-of-experts) with every scale-vector strategy of
"Negligible in Size, Significant in Effect: On Scale Vectors in Large Language Models" (arXiv 2605.26895).

This file says what the model computes. `scaled_ops.py` beside it computes the same faster (the scales folded into
the weights inside fused matmuls, folded weights cached for inference); both ship to the Hub with
`configuration_scalevec.py` and import only `torch`, `transformers` and each other.
"""

import functools
import inspect
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from transformers import AutoModel
from transformers import initialization as init
from transformers.activations import ACT2FN
from transformers.cache_utils import Cache, DynamicCache
from transformers.generation import GenerationMixin
from transformers.integrations.moe import use_experts_implementation
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
from .scaled_ops import (
    SCALEVEC_EXPERTS_FUNCTIONS,
    ScaledMap,
    expert_maps,
    forget_checked_kv_cache,
    prepared_scales,
    scaled_linear,
    scaled_projections,
    sorted_group_sizes,
)

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

    formed: torch.Tensor | None = None  # the vector as `prepared_scales` formed it for the running forward, if it did

    def __init__(self, shape: Sequence[int], scale_param: str | None, role: str):
        super().__init__()
        self.role = role
        self.scale_param = scale_param
        if scale_param == "magdir":
            self.magnitude = nn.Parameter(torch.ones(*shape[:-1], 1))
            self.direction = nn.Parameter(torch.ones(*shape))
        elif scale_param == "direct":
            self.weight = nn.Parameter(torch.ones(*shape))

    @staticmethod
    def magnitude_direction(magnitude: torch.Tensor, direction: torch.Tensor) -> torch.Tensor:
        """`g * u / rms(u)` over the last dimension, the per-vector factor formed first (three small ops, not five)."""
        norm = torch.linalg.vector_norm(direction, dim=-1, keepdim=True)
        return direction * (magnitude * direction.shape[-1] ** 0.5 / norm)

    def vector(self) -> torch.Tensor | None:
        if self.scale_param == "magdir":
            return self.magnitude_direction(self.magnitude, self.direction) if self.formed is None else self.formed
        return self.weight if self.scale_param == "direct" else None


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

    def scaled_maps(self) -> list[ScaledMap]:
        return [(self.weight, *self.scales())]


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


def fold(weight: torch.Tensor, in_scale: torch.Tensor | None, out_scale: torch.Tensor | None) -> torch.Tensor:
    """`diag(b) W diag(a)`: the scales folded into the weight (..., out, in), scales (..., in) / (..., out)."""
    if out_scale is not None:
        weight = weight * out_scale.unsqueeze(-1)
    return weight if in_scale is None else weight * in_scale.unsqueeze(-2)


def project(x: torch.Tensor, *modules: nn.Module) -> tuple[torch.Tensor, ...]:
    """The outputs of several projections of one input, each `b * proj(a * x)`. When every module is a plain ScaleVec
    projection with scales, `scaled_projections` computes them (the scales folded into the weights inside one fused
    matmul); otherwise each module is called, so that any wrapper or hook is honoured."""
    if all(_is_plain(module) for module in modules) and any(_has_scales(module) for module in modules):
        return scaled_projections(x, modules)
    return tuple(_call_scaled(module, x) for module in modules)


def _has_scales(module: ScaleVecScaledMap) -> bool:
    return module.in_scale is not None or module.out_scale is not None


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
        (router_logits,) = scaled_projections(hidden_states, (self,))
        router_probs = F.softmax(router_logits, dtype=torch.float, dim=-1)
        top_k_weights, top_k_index = torch.topk(router_probs, self.top_k, dim=-1)
        if self.norm_topk_prob:
            top_k_weights = top_k_weights / top_k_weights.sum(dim=-1, keepdim=True)
        return router_logits, top_k_weights.to(router_logits.dtype), top_k_index


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

    def scaled_maps(self) -> list[ScaledMap]:
        """gate_up (E, 2, I, H) and down (E, H, I) with their column and row scales, for the experts this process
        holds: under expert parallelism every one of them is sharded by expert."""
        gate_up = (
            self.gate_up_proj.unflatten(1, (2, self.intermediate_size)),
            self.gate_up_in_scale,
            self.gate_up_out_scale,
        )
        down = (self.down_proj, self.down_in_scale, self.down_out_scale)
        return [tuple(map(_local_tensor, (weight, _vector(a), _vector(b)))) for weight, a, b in (gate_up, down)]

    def folded_weights(self) -> tuple[torch.Tensor, torch.Tensor]:
        """`gate_up_proj` and `down_proj` with every expert scale folded in (differentiably)."""
        gate_up, down = (fold(*scaled_map) for scaled_map in self.scaled_maps())
        return gate_up.flatten(1, 2), down

    def forward(self, hidden_states, top_k_index, top_k_weights):
        # every (token, choice) pair as a row, sorted by expert: one grouped matmul per projection
        flat_index = top_k_index.reshape(-1)
        order = flat_index.argsort(stable=True)
        group_sizes = sorted_group_sizes(flat_index[order], self.num_experts)
        (gate_up, down), experts, group_sizes = expert_maps(self, group_sizes)
        x = hidden_states[order // top_k_index.shape[-1]]
        # Expert parallelism gives the choices of other processes' experts ids past this one's (and weight 0): their
        # rows are in no group, and the grouped matmuls leave them uninitialised. Masked as transformers' experts do.
        off_rank = (flat_index[order] >= self.num_experts).unsqueeze(-1) if self._is_expert_parallel else None
        if off_rank is not None:
            x = x.masked_fill(off_rank, 0.0)  # its backward zeroes those rows' uninitialised input gradients
        (hidden,) = scaled_linear(x, [gate_up], group_sizes, experts)
        gate, up = hidden.chunk(2, dim=-1)
        (hidden,) = scaled_linear(self.act_fn(gate) * up, [down], group_sizes, experts)
        if off_rank is not None:
            hidden = hidden.masked_fill(off_rank, 0.0)  # weight 0 times an uninitialised NaN would be NaN
        hidden = hidden * top_k_weights.reshape(-1)[order, None]
        # Undo the sort and sum over the k choices: deterministic on every device, unlike `index_add_`.
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.numel(), device=order.device)
        return hidden[inverse].view(*top_k_index.shape, -1).sum(dim=1).to(hidden_states.dtype)


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
        self.config.auto_map = dict(AUTO_MAP)  # transformers adds the saved class to it: not to this constant
        return super().save_pretrained(*args, **kwargs)


def router_logits_of_experts_only(forward: Callable) -> Callable:
    """A dense model takes `output_router_logits` and returns no router outputs, as Llama does: `capture_outputs`
    records every key of `_can_record_outputs` (router logits included, for the MoE model) that is asked for, and
    would give a dense output an empty `router_logits`."""

    @functools.wraps(forward)
    def recorded(self, *args, **kwargs):
        if not self.config.num_experts:
            kwargs["output_router_logits"] = False  # over the argument, and over a flag set on the config
        return forward(self, *args, **kwargs)

    return recorded


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
        self.register_load_state_dict_post_hook(forget_checked_kv_cache)
        self.post_init()

    @legacy_cache_name
    @merge_with_config_defaults
    @router_logits_of_experts_only
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
        with prepared_scales(self, cache):
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
    _tp_plan = {"lm_head": "colwise_gather_output"}
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
            Return the router logits and the load-balancing loss, added to the loss with labels (a dense model
            returns neither, as Llama). Defaults to `config.output_router_logits` (off unless set, as Qwen3-MoE's).
        """
        if output_router_logits is None:
            output_router_logits = getattr(self.config, "output_router_logits", False)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            cache=cache,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_router_logits=output_router_logits,
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
        if not self.config.num_experts:
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

    def prepare_inputs_for_generation(self, input_ids, inputs_embeds=None, **kwargs) -> dict:
        # `generate` tells a model that decodes from `inputs_embeds` by this signature
        model_inputs = super().prepare_inputs_for_generation(input_ids, inputs_embeds=inputs_embeds, **kwargs)
        if self.config.num_experts:  # `generate` returns no router outputs: its steps skip the balancing loss
            model_inputs.setdefault("output_router_logits", False)
        return model_inputs


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
