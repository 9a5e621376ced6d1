"""Checkpoint formats: ScaleVec itself and the stock architectures that a folded ScaleVec model can be.

Each format knows which ScaleVec configurations it can express, how its config translates to and from
`ScaleVecConfig`, and how its tensors are named on disk (as `save_pretrained` writes them) relative to the
ScaleVec names. Stock formats hold the folded form: their matrices and norm weights are the folded ScaleVec ones.
"""

from dataclasses import dataclass

import torch
import transformers
from transformers import LlamaConfig, MixtralConfig, PreTrainedConfig, Qwen3Config, Qwen3MoeConfig

from ..configuration_scalevec import ScaleVecConfig
from .checkpoint import Checkpoint
from .errors import CheckpointError, ConversionError
from .heads import Head, head_fields
from .units import add_prefix, layer_index, strip_prefix

Tensors = dict[str, torch.Tensor]

# Fields named alike in ScaleVecConfig and every stock config here.
COMMON_FIELDS = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "hidden_act",
    "max_position_embeddings",
    "initializer_range",
    "rms_norm_eps",
    "use_cache",
    "tie_word_embeddings",
    "rope_parameters",
    "attention_dropout",
    "pad_token_id",
    "bos_token_id",
    "eos_token_id",
)


@dataclass(frozen=True)
class ExpertKeys:
    """How a stock MoE layer names its router and per-expert matrices (layer-local, as `save_pretrained` writes)."""

    block: str
    gate: str
    up: str
    down: str

    def router(self) -> str:
        return f"{self.block}.gate.weight"

    def expert(self, index: int, projection: str) -> str:
        return f"{self.block}.experts.{index}.{projection}.weight"


class Format:
    """The ScaleVec format itself: ScaleVec names on disk, any configuration, every head."""

    name = "scalevec"
    model_type = "scalevec"
    experts: ExpertKeys | None = None

    def architecture(self, head: Head) -> str | None:
        """The class of a `head` model in this format (None: there is none)."""
        return f"ScaleVec{head.suffix}"

    def base_prefix(self, head: Head) -> str:
        """Where a `head` model of this format keeps its base model: the prefix of the base model's tensors."""
        return "model"

    def blockers(self, config: ScaleVecConfig) -> list[str]:
        """Why this format cannot express the folded `config` (empty: it can)."""
        return []

    def warnings(self, config: ScaleVecConfig) -> list[str]:
        return []

    def to_disk(self, unit: str, tensors: Tensors, config: ScaleVecConfig, head: Head) -> Tensors:
        """ScaleVec names -> this format's names, for the tensors of one unit of a `head` model."""
        return _renamed_base(self._split(unit, tensors, config), "model", self.base_prefix(head))

    def from_disk(self, unit: str, tensors: Tensors, config: ScaleVecConfig, head: Head) -> Tensors:
        return self._stack(unit, _renamed_base(tensors, self.base_prefix(head), "model"), config)

    def _has_experts(self, unit: str, config: ScaleVecConfig) -> bool:
        index = layer_index(unit)
        return self.experts is not None and index is not None and config.is_moe_layer(index)

    def _split(self, unit: str, tensors: Tensors, config: ScaleVecConfig) -> Tensors:
        if not self._has_experts(unit, config):
            return tensors
        return add_prefix(unit, _split_experts(strip_prefix(unit, tensors), self.experts, config))

    def _stack(self, unit: str, tensors: Tensors, config: ScaleVecConfig) -> Tensors:
        if not self._has_experts(unit, config):
            return tensors
        return add_prefix(unit, _stack_experts(strip_prefix(unit, tensors), self.experts, config))


class StockFormat(Format):
    config_class: type[PreTrainedConfig]

    def architecture(self, head: Head) -> str | None:
        return head.stock_classes.get(self.model_type)

    def base_prefix(self, head: Head) -> str:
        # Not always `model`: LlamaForQuestionAnswering, for one, keeps its base model as `transformer`.
        return getattr(transformers, self.architecture(head)).base_model_prefix

    def stock_config(self, config: ScaleVecConfig) -> PreTrainedConfig:
        """The stock config of the folded `config`."""
        fields = {field: getattr(config, field) for field in COMMON_FIELDS}
        return self.config_class(**fields, **head_fields(config), **self._fields(config))

    def legacy_fields(self, stock: PreTrainedConfig) -> dict:
        """Top-level fields that readers older than transformers v5 (and vLLM, llama.cpp's converter) look for."""
        rope = dict(stock.rope_parameters)
        rope_theta = rope.pop("rope_theta")
        return {"rope_theta": rope_theta, "rope_scaling": None if rope.get("rope_type") == "default" else rope}

    def scalevec_config(self, stock: PreTrainedConfig) -> ScaleVecConfig:
        """The folded ScaleVec config of a stock config (refusing what ScaleVec cannot express)."""
        unsupported = _unsupported_stock_features(stock)
        if unsupported:
            raise ConversionError(f"ScaleVec cannot express this {self.name} checkpoint: {'; '.join(unsupported)}")
        fields = {field: getattr(stock, field) for field in COMMON_FIELDS} | head_fields(stock)
        return ScaleVecConfig(**fields, **self._scalevec_fields(stock), scale_preset="standard", folded=True)

    def _fields(self, config: ScaleVecConfig) -> dict:
        return {"intermediate_size": config.intermediate_size}

    def _scalevec_fields(self, stock: PreTrainedConfig) -> dict:
        return {"intermediate_size": stock.intermediate_size}


def _dense_blockers(config: ScaleVecConfig) -> list[str]:
    reasons = []
    if config.num_experts:
        reasons.append(f"mixture-of-experts layers (num_experts={config.num_experts}); use mixtral or qwen3_moe")
    if config.output_norm:
        reasons.append("output_norm=True (output norms after each branch)")
    return reasons


class LlamaFormat(StockFormat):
    name = model_type = "llama"
    config_class = LlamaConfig

    def blockers(self, config):
        qk = ["qk_norm=True (per-head q/k norms; use qwen3)"] if config.qk_norm else []
        return _dense_blockers(config) + qk


class Qwen3Format(StockFormat):
    name = model_type = "qwen3"
    config_class = Qwen3Config

    def blockers(self, config):
        qk = [] if config.qk_norm else ["qk_norm=False (Qwen3 always normalises q and k per head; use llama)"]
        return _dense_blockers(config) + qk

    def _scalevec_fields(self, stock):
        return {"intermediate_size": stock.intermediate_size, "qk_norm": True}


def _moe_blockers(config: ScaleVecConfig) -> list[str]:
    reasons = [] if config.num_experts else ["no experts (num_experts=0: a dense model); use llama or qwen3"]
    if config.num_experts and config.shared_expert_intermediate_size:
        reasons.append(
            f"a shared expert (shared_expert_intermediate_size={config.shared_expert_intermediate_size}), "
            "which neither Mixtral nor Qwen3-MoE has"
        )
    if config.output_norm:
        reasons.append("output_norm=True (output norms after each branch)")
    return reasons


class MixtralFormat(StockFormat):
    name = model_type = "mixtral"
    config_class = MixtralConfig
    experts = ExpertKeys("block_sparse_moe", gate="w1", up="w3", down="w2")

    def blockers(self, config):
        reasons = _moe_blockers(config)
        if config.num_experts and not all(config.is_moe_layer(i) for i in range(config.num_hidden_layers)):
            reasons.append(
                "dense layers among the MoE layers (mlp_only_layers / decoder_sparse_step); Mixtral has experts "
                "in every layer (use qwen3_moe)"
            )
        if config.num_experts and not config.norm_topk_prob:
            reasons.append("norm_topk_prob=False; Mixtral always renormalises the top-k weights (use qwen3_moe)")
        if config.qk_norm:
            reasons.append("qk_norm=True (per-head q/k norms; use qwen3_moe)")
        return reasons

    def _fields(self, config):
        return {
            "intermediate_size": config.moe_intermediate_size,
            "num_local_experts": config.num_experts,
            "num_experts_per_tok": config.num_experts_per_tok,
            "router_aux_loss_coef": config.router_aux_loss_coef,
            "output_router_logits": config.output_router_logits,
        }

    def _scalevec_fields(self, stock):
        return {
            "intermediate_size": stock.intermediate_size,
            "moe_intermediate_size": stock.intermediate_size,
            "num_experts": stock.num_local_experts,
            "num_experts_per_tok": stock.num_experts_per_tok,
            "norm_topk_prob": True,
            "router_aux_loss_coef": stock.router_aux_loss_coef,
            "output_router_logits": stock.output_router_logits,
        }


class Qwen3MoeFormat(StockFormat):
    name = model_type = "qwen3_moe"
    config_class = Qwen3MoeConfig
    experts = ExpertKeys("mlp", gate="gate_proj", up="up_proj", down="down_proj")
    _MOE_FIELDS = (
        "moe_intermediate_size",
        "num_experts_per_tok",
        "norm_topk_prob",
        "decoder_sparse_step",
        "mlp_only_layers",
        "router_aux_loss_coef",
        "output_router_logits",
    )

    def blockers(self, config):
        qk = [] if config.qk_norm else ["qk_norm=False (Qwen3-MoE always normalises q and k per head; use mixtral)"]
        return _moe_blockers(config) + qk

    def warnings(self, config):
        if config.norm_topk_prob:
            return []
        return [
            "norm_topk_prob=False: transformers and vLLM match this model, but llama.cpp always renormalises the "
            "top-k weights, so its outputs will differ from theirs"
        ]

    def legacy_fields(self, stock):
        return {**super().legacy_fields(stock), "num_experts": stock.num_local_experts}

    def _fields(self, config):
        fields = {field: getattr(config, field) for field in self._MOE_FIELDS}
        return {**fields, "intermediate_size": config.intermediate_size, "num_experts": config.num_experts}

    def _scalevec_fields(self, stock):
        fields = {field: getattr(stock, field) for field in self._MOE_FIELDS}
        experts = {"num_experts": stock.num_local_experts, "qk_norm": True}
        return {**fields, **experts, "intermediate_size": stock.intermediate_size}


def _unsupported_stock_features(stock: PreTrainedConfig) -> list[str]:
    reasons = [
        f"{flag}=True (ScaleVec has no biases)"
        for flag in ("attention_bias", "mlp_bias")
        if getattr(stock, flag, False)
    ]
    sliding = getattr(stock, "use_sliding_window", getattr(stock, "sliding_window", None) is not None)
    if sliding:
        reasons.append(f"sliding-window attention (sliding_window={stock.sliding_window})")
    return reasons


def _renamed_base(tensors: Tensors, old: str, new: str) -> Tensors:
    """`tensors` with the base model's prefix `old` renamed to `new` (a head's own tensors keep their names)."""
    if old == new:
        return tensors
    return {new + key.removeprefix(old) if key.startswith(f"{old}.") else key: t for key, t in tensors.items()}


def _split_experts(tensors: Tensors, keys: ExpertKeys, config: ScaleVecConfig) -> Tensors:
    out = {key: value for key, value in tensors.items() if not key.startswith("mlp.gate.") and ".experts." not in key}
    out[keys.router()] = tensors["mlp.gate.weight"]
    # unflatten and integer indices: what a tensor and a ScaledMatrix (a product not yet computed) both support
    gate_up = tensors["mlp.experts.gate_up_proj"].unflatten(-2, (2, -1))
    down = tensors["mlp.experts.down_proj"]
    for e in range(config.num_experts):
        out[keys.expert(e, keys.gate)] = gate_up[e, 0]
        out[keys.expert(e, keys.up)] = gate_up[e, 1]
        out[keys.expert(e, keys.down)] = down[e]
    return out


def _stack_experts(tensors: Tensors, keys: ExpertKeys, config: ScaleVecConfig) -> Tensors:
    remaining = dict(tensors)
    experts = range(config.num_experts)
    gate_up = [
        torch.cat([remaining.pop(keys.expert(e, keys.gate)), remaining.pop(keys.expert(e, keys.up))]) for e in experts
    ]
    down = [remaining.pop(keys.expert(e, keys.down)) for e in experts]
    remaining["mlp.gate.weight"] = remaining.pop(keys.router())
    remaining["mlp.experts.gate_up_proj"] = torch.stack(gate_up)
    remaining["mlp.experts.down_proj"] = torch.stack(down)
    return remaining


def scalevec_view(checkpoint: Checkpoint, fmt: Format) -> ScaleVecConfig:
    """The ScaleVec config of a checkpoint of any supported format (stock ones in their folded form)."""
    try:
        if isinstance(fmt, StockFormat):
            return fmt.scalevec_config(fmt.config_class.from_dict(checkpoint.config))
        return ScaleVecConfig.from_dict(checkpoint.config)
    except (ValueError, TypeError) as error:  # the strict config's validation errors are ValueErrors
        raise CheckpointError(
            f"{checkpoint.path / 'config.json'} is not a valid {fmt.name} config: {error}"
        ) from error


FORMATS: dict[str, Format] = {
    f.name: f for f in (Format(), LlamaFormat(), Qwen3Format(), MixtralFormat(), Qwen3MoeFormat())
}
TARGETS = tuple(FORMATS)


def format_of(model_type: str) -> Format:
    for fmt in FORMATS.values():
        if fmt.model_type == model_type:
            return fmt
    raise ConversionError(
        f"unsupported model_type {model_type!r}; supported: {', '.join(f.model_type for f in FORMATS.values())}"
    )
