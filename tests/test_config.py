import json

import pytest
from transformers import LlamaConfig, Qwen3MoeConfig

from scalevec import ScaleVecConfig
from scalevec.configuration_scalevec import MOE_DEFAULTS, SCALE_PRESETS

from ._helpers import TINY, tiny_config, tiny_moe_config


@pytest.mark.parametrize("preset", list(SCALE_PRESETS))
def test_preset_sets_the_three_fields(preset):
    config = tiny_config(scale_preset=preset)
    assert {f: getattr(config, f) for f in SCALE_PRESETS[preset]} == SCALE_PRESETS[preset]


def test_explicit_fields_override_the_preset():
    config = tiny_config(scale_preset="standard", linear_scale="both")
    assert (config.norm_scale, config.linear_scale, config.scale_param) == ("shared", "both", "direct")


def test_config_round_trips_through_json(tmp_path):
    config = tiny_config(scale_preset="standard", norm_scale="branch", qk_norm=True, rope_theta=5e5)
    config.save_pretrained(tmp_path)
    loaded = ScaleVecConfig.from_pretrained(tmp_path)
    for field in ("scale_preset", "norm_scale", "linear_scale", "scale_param", "qk_norm", "head_dim"):
        assert getattr(loaded, field) == getattr(config, field)
    assert loaded.rope_parameters["rope_theta"] == 5e5


def test_only_a_moe_config_has_moe_fields_as_llama_and_qwen3_moe(tmp_path):
    """Libraries tell a MoE model by its config's fields (TRL: `hasattr(config, "output_router_logits")`)."""
    qwen3_moe_fields = [field for field in MOE_DEFAULTS if hasattr(Qwen3MoeConfig(), field)]
    assert {"output_router_logits", "router_aux_loss_coef", "num_experts_per_tok"} <= set(qwen3_moe_fields)
    for field in qwen3_moe_fields:
        assert not hasattr(tiny_config(), field) and not hasattr(LlamaConfig(), field), field
        assert hasattr(tiny_moe_config(), field), field
    assert not any(hasattr(tiny_config(), field) for field in MOE_DEFAULTS)
    # off, as Qwen3-MoE's: plain forwards; ScaleVecTrainer asks for the balancing loss when it trains
    assert tiny_moe_config().output_router_logits is Qwen3MoeConfig().output_router_logits is False
    assert tiny_config(num_local_experts=4, moe_intermediate_size=8).num_experts == 4

    # a dense checkpoint saved before carries the MoE fields with their defaults: they are dropped on load
    tiny_config().save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert not set(MOE_DEFAULTS) & set(saved)
    older = saved | {"output_router_logits": False, "num_experts_per_tok": 2}
    (tmp_path / "config.json").write_text(json.dumps(older))
    assert not hasattr(ScaleVecConfig.from_pretrained(tmp_path), "output_router_logits")


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"scale_preset": "best"}, r"`scale_preset` must be one of 'none', 'standard', 'unified'; got 'best'"),
        ({"norm_scale": "all"}, r"`norm_scale` must be one of 'none', 'shared', 'branch'; got 'all'"),
        ({"linear_scale": "around"}, r"`linear_scale` must be one of 'none', 'in', 'out', 'both'"),
        ({"scale_param": "polar"}, r"`scale_param` must be one of 'direct', 'magdir'"),
        ({"hidden_size": 30}, r"`hidden_size` \(30\) is not a multiple of `num_attention_heads` \(4\)"),
        ({"num_key_value_heads": 3}, r"`num_attention_heads` \(4\) must be a multiple of `num_key_value_heads` \(3\)"),
        ({"head_dim": 7}, r"`head_dim` must be even"),
        ({"head_dim": 0}, r"`head_dim` must be a positive integer"),
        ({"num_hidden_layers": 0}, r"`num_hidden_layers` must be a positive integer"),
        ({"hidden_act": "swishy"}, r"`hidden_act` must be an activation"),
        ({"folded": True}, r"`folded=True` describes the inference form"),
        ({"rope_theta": 1e4, "rope_parameters": {"rope_type": "default", "rope_theta": 5e5}}, r"contradicts"),
    ],
)
def test_bad_values_raise_value_errors_naming_the_field(overrides, message):
    with pytest.raises(ValueError, match=message):
        ScaleVecConfig(**{**TINY, **overrides})


def test_head_dim_may_differ_from_hidden_over_heads():
    config = tiny_config(hidden_size=30, head_dim=8)
    assert config.head_dim * config.num_attention_heads != config.hidden_size


def test_folded_inference_form_is_accepted():
    config = tiny_config(scale_preset="standard", folded=True, output_norm=True)
    assert config.folded and config.linear_scale == "none"
