"""ScaleVec model configuration.

Standard decoder fields are named as in `LlamaConfig` / `Qwen3MoeConfig`; the scale-vector strategy is set by
`scale_preset` and the three fields it expands to (`norm_scale`, `linear_scale`, `scale_param`).
"""

import re

import transformers

# Checked before anything else of transformers is imported: an older release would fail on a moved name instead.
MINIMUM_TRANSFORMERS = (5, 19)
_installed = tuple(int(part) for part in re.match(r"\d+(?:\.\d+)*", transformers.__version__).group().split("."))
if _installed < MINIMUM_TRANSFORMERS:
    _minimum = ".".join(map(str, MINIMUM_TRANSFORMERS))
    raise ImportError(
        f"ScaleVec's model code needs transformers >= {_minimum}; this environment has transformers "
        f"{transformers.__version__}. Upgrade it: pip install -U 'transformers>={_minimum}'"
    )

from huggingface_hub.dataclasses import strict  # noqa: E402
from transformers.activations import ACT2FN  # noqa: E402
from transformers.configuration_utils import PreTrainedConfig  # noqa: E402
from transformers.modeling_rope_utils import RopeParameters  # noqa: E402

NORM_SCALES = ("none", "shared", "branch")
LINEAR_SCALES = ("none", "in", "out", "both")
SCALE_PARAMS = ("direct", "magdir")
# The strategy fields that a preset sets, with their allowed values; callers iterate this rather than spell them.
SCALE_FIELDS = {"norm_scale": NORM_SCALES, "linear_scale": LINEAR_SCALES, "scale_param": SCALE_PARAMS}
SCALE_PRESETS = {
    "none": {"norm_scale": "none", "linear_scale": "none", "scale_param": "direct"},
    "standard": {"norm_scale": "shared", "linear_scale": "none", "scale_param": "direct"},
    "unified": {"norm_scale": "branch", "linear_scale": "both", "scale_param": "magdir"},
}
# The mixture-of-experts fields and their defaults. Only a MoE config (`num_experts` > 0) has them: a dense config
# looks like a dense in-tree one (Llama's) to libraries that tell MoE models by `hasattr(config, ...)`.
MOE_DEFAULTS = {
    "num_experts_per_tok": 2,
    "moe_intermediate_size": None,  # intermediate_size
    "norm_topk_prob": True,
    "shared_expert_intermediate_size": 0,
    "decoder_sparse_step": 1,
    "mlp_only_layers": (),
    "router_aux_loss_coef": 0.001,
    "router_z_loss_coef": 0.0,
    "output_router_logits": False,  # as Qwen3-MoE: plain forwards; ScaleVecTrainer asks for it in training
}


def _check_choice(field: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"`{field}` must be one of {', '.join(map(repr, allowed))}; got {value!r}.")


def _check_positive(**fields: int) -> None:
    for field, value in fields.items():
        if value is None or value <= 0:
            raise ValueError(f"`{field}` must be a positive integer; got {value!r}.")


@strict
class ScaleVecConfig(PreTrainedConfig):
    r"""
    Configuration of a ScaleVec decoder (dense or mixture-of-experts).

    Scale-vector fields:
        scale_preset (`str`, defaults to `"unified"`): `"none"`, `"standard"` or `"unified"`; fills the three fields
            below where they are not given explicitly (explicit fields override the preset).
        norm_scale (`str`): `"none"` (no learnable scale at input norms), `"shared"` (one scale per norm) or
            `"branch"` (one column scale per consumer of each input norm: q, k, v / gate, up / router, experts).
        linear_scale (`str`): `"none"`, `"in"`, `"out"` or `"both"`: column and/or row scales around the linear maps
            inside blocks, so that `o_proj` and `down_proj` are preconditioned too.
        scale_param (`str`): `"direct"` or `"magdir"` (every scale is `g * u / rms(u)`).
        output_norm (`bool`): normalise the attention and MLP outputs before the residual add, with output-role scales.
        qk_norm (`bool`): per-head RMSNorm on queries and keys, with output-role scales (as Qwen3).
        folded (`bool`): the checkpoint's input-role scales were folded into its matrices (inference form).

    Mixture-of-experts fields (`num_experts=0` is a dense model, whose config has none of the others):
    `num_experts`, `num_experts_per_tok`, `moe_intermediate_size`, `norm_topk_prob`,
    `shared_expert_intermediate_size` (0: none), `decoder_sparse_step`, `mlp_only_layers`, `router_aux_loss_coef`,
    `router_z_loss_coef`, `output_router_logits` (off by default, as Qwen3-MoE's: forwards return the router logits and
    the load-balancing loss only when asked; `ScaleVecTrainer` asks for them in every MoE training forward).
    """

    model_type = "scalevec"
    keys_to_ignore_at_inference = ["cache", "past_key_values", "aux_loss", "router_logits"]
    attribute_map = {"num_local_experts": "num_experts"}
    # Llama's / Qwen3-MoE's plans: every projection is an `nn.Linear`, its scales cut as its weight is sharded.
    base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.q_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.k_norm": "replicated_with_grad_allreduce",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }
    # Qwen3-MoE's expert-parallel plan, with each expert's scales sharded as its weights are
    base_model_ep_plan = {
        "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
        "layers.*.mlp.experts.down_proj": "grouped_gemm",
        "layers.*.mlp.experts.gate_up_in_scale": "grouped_gemm",
        "layers.*.mlp.experts.gate_up_out_scale": "grouped_gemm",
        "layers.*.mlp.experts.down_in_scale": "grouped_gemm",
        "layers.*.mlp.experts.down_out_scale": "grouped_gemm",
        "layers.*.mlp.experts": "ep_dispatch_experts",
    }
    base_model_pp_plan = {
        "embed_tokens": (["input_ids"], ["inputs_embeds"]),
        "layers": (["hidden_states", "attention_mask"], ["hidden_states"]),
        "norm": (["hidden_states"], ["hidden_states"]),
    }

    vocab_size: int = 32000
    hidden_size: int = 768
    intermediate_size: int = 2048
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    max_position_embeddings: int = 2048
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    tie_word_embeddings: bool = False
    rope_parameters: RopeParameters | dict | None = None
    attention_dropout: float | int = 0.0
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    num_experts: int = 0

    scale_preset: str = "unified"
    norm_scale: str | None = None
    linear_scale: str | None = None
    scale_param: str | None = None
    output_norm: bool = False
    qk_norm: bool = False
    folded: bool = False

    def __post_init__(self, **kwargs):
        self._resolve_scale_fields()
        self._resolve_attention_fields()
        self._resolve_moe_fields(kwargs)
        rope_theta = kwargs.get("rope_theta")
        if rope_theta is not None and (self.rope_parameters or {}).get("rope_theta", rope_theta) != rope_theta:
            raise ValueError(
                f"`rope_theta={rope_theta}` contradicts `rope_parameters['rope_theta']="
                f"{self.rope_parameters['rope_theta']}`; give one of them."
            )
        super().__post_init__(**kwargs)

    def _resolve_scale_fields(self) -> None:
        _check_choice("scale_preset", self.scale_preset, tuple(SCALE_PRESETS))
        for field, value in SCALE_PRESETS[self.scale_preset].items():
            if getattr(self, field) is None:
                setattr(self, field, value)
        for field, allowed in SCALE_FIELDS.items():
            _check_choice(field, getattr(self, field), allowed)
        if self.folded and (
            self.norm_scale == "branch" or self.linear_scale != "none" or self.scale_param != "direct"
        ):
            raise ValueError(
                "`folded=True` describes the inference form, which holds no branch or linear scales: it needs "
                "`norm_scale` in ('none', 'shared'), `linear_scale='none'` and `scale_param='direct'`; got "
                f"norm_scale={self.norm_scale!r}, linear_scale={self.linear_scale!r}, "
                f"scale_param={self.scale_param!r}."
            )

    def _resolve_attention_fields(self) -> None:
        _check_positive(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers,
            num_attention_heads=self.num_attention_heads,
            max_position_embeddings=self.max_position_embeddings,
        )
        if self.hidden_act not in ACT2FN:
            raise ValueError(f"`hidden_act` must be an activation known to transformers; got {self.hidden_act!r}.")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        _check_positive(num_key_value_heads=self.num_key_value_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"`num_attention_heads` ({self.num_attention_heads}) must be a multiple of `num_key_value_heads` "
                f"({self.num_key_value_heads})."
            )
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(
                    f"`hidden_size` ({self.hidden_size}) is not a multiple of `num_attention_heads` "
                    f"({self.num_attention_heads}); set `head_dim` explicitly."
                )
            self.head_dim = self.hidden_size // self.num_attention_heads
        _check_positive(head_dim=self.head_dim)
        if self.head_dim % 2:
            raise ValueError(f"`head_dim` must be even for rotary embeddings; got {self.head_dim}.")

    def _resolve_moe_fields(self, kwargs: dict) -> None:
        """Take the MoE fields out of `kwargs`: set on a MoE config, dropped from a dense one (older dense
        checkpoints saved them with their defaults)."""
        if "num_local_experts" in kwargs:  # Mixtral's name, an alias
            self.num_experts = kwargs.pop("num_local_experts")
        given = {field: kwargs.pop(field) for field in MOE_DEFAULTS if field in kwargs}
        if self.num_experts < 0:
            raise ValueError(f"`num_experts` must be 0 (dense) or positive; got {self.num_experts}.")
        if not self.num_experts:
            if given.get("output_router_logits"):
                raise ValueError("`output_router_logits=True` needs experts; this config is dense (`num_experts=0`).")
            return
        for field, default in MOE_DEFAULTS.items():
            setattr(self, field, default if given.get(field) is None else given[field])
        self.mlp_only_layers = list(self.mlp_only_layers)
        if self.moe_intermediate_size is None:
            self.moe_intermediate_size = self.intermediate_size
        _check_positive(
            num_experts_per_tok=self.num_experts_per_tok,
            moe_intermediate_size=self.moe_intermediate_size,
            decoder_sparse_step=self.decoder_sparse_step,
        )
        if self.num_experts_per_tok > self.num_experts:
            raise ValueError(
                f"`num_experts_per_tok` ({self.num_experts_per_tok}) cannot exceed `num_experts` ({self.num_experts})."
            )
        if self.shared_expert_intermediate_size < 0:
            raise ValueError(
                f"`shared_expert_intermediate_size` must be 0 (no shared expert) or positive; "
                f"got {self.shared_expert_intermediate_size}."
            )
        bad_layers = [i for i in self.mlp_only_layers if not 0 <= i < self.num_hidden_layers]
        if bad_layers:
            raise ValueError(
                f"`mlp_only_layers` holds {bad_layers}, outside the layer indices 0..{self.num_hidden_layers - 1}."
            )
        if not any(self.is_moe_layer(i) for i in range(self.num_hidden_layers)):
            raise ValueError("`num_experts` > 0 but `mlp_only_layers` / `decoder_sparse_step` select no MoE layer.")

    def is_moe_layer(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` has a mixture-of-experts MLP (the Qwen3-MoE rule)."""
        return (
            self.num_experts > 0
            and layer_idx not in self.mlp_only_layers
            and (layer_idx + 1) % self.decoder_sparse_step == 0
        )


__all__ = ["ScaleVecConfig"]
