"""Import of stock checkpoints into ScaleVec strategies (function unchanged), the round trip back to the stock
format, and the `verify` / `inspect` commands."""

import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from scalevec import ScaleVecForCausalLM
from scalevec.convert import (
    ConversionError,
    OutputOptions,
    Strategy,
    TargetError,
    compare_checkpoints,
    export_checkpoint,
    import_checkpoint,
)
from scalevec.convert.cli import main

from ._helpers import (
    logits,
    random_ids,
    saved_scalevec,
    saved_stock,
    tiny_config,
    tiny_moe_config,
)

STOCK_KINDS = ["llama", "qwen3", "mixtral", "qwen3_moe"]


@pytest.mark.parametrize("kind", STOCK_KINDS)
def test_stock_to_unified_and_back_gives_the_original_weights_and_logits(tmp_path, kind):
    stock = saved_stock(tmp_path / "stock", kind)
    ids = random_ids(stock.config)
    imported = import_checkpoint(tmp_path / "stock", tmp_path / "unified", Strategy("unified"))
    model = ScaleVecForCausalLM.from_pretrained(tmp_path / "unified").eval()
    config = model.config
    assert (config.norm_scale, config.linear_scale, config.scale_param, config.folded) == (
        "branch",
        "both",
        "magdir",
        False,
    )
    assert imported.verification.max_abs <= 1e-5
    torch.testing.assert_close(logits(model, ids), logits(stock, ids), atol=1e-5, rtol=0)
    # The stock norm weight became every consumer's branch scale; row and column scales start at one.
    layer = model.model.layers[0]
    gamma = stock.model.layers[0].input_layernorm.weight
    torch.testing.assert_close(layer.self_attn.v_proj.in_scale.vector(), gamma, atol=1e-6, rtol=0)
    torch.testing.assert_close(layer.self_attn.o_proj.out_scale.vector(), torch.ones(32), atol=0, rtol=0)

    export_checkpoint(tmp_path / "unified", tmp_path / "back", kind)
    original, back = (
        load_file(tmp_path / "stock" / "model.safetensors"),
        load_file(tmp_path / "back" / "model.safetensors"),
    )
    assert sorted(back) == sorted(original)
    for name, tensor in original.items():
        torch.testing.assert_close(back[name], tensor, atol=1e-6, rtol=0, msg=name)
    # config.json holds everything save_pretrained writes, with the same values, plus the legacy fields.
    written = json.loads((tmp_path / "stock" / "config.json").read_text())
    exported = json.loads((tmp_path / "back" / "config.json").read_text())
    if written["head_dim"] is None:  # Mixtral derives it; the export states it
        written["head_dim"] = written["hidden_size"] // written["num_attention_heads"]
    assert {key: exported.get(key) for key in written} == written
    assert exported["rope_theta"] == written["rope_parameters"]["rope_theta"]
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "back")
    assert type(reloaded) is type(stock)
    torch.testing.assert_close(logits(reloaded, ids), logits(stock, ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "strategy",
    [
        Strategy("standard"),
        Strategy("none"),
        Strategy("standard", scale_param="magdir", linear_scale="in"),
        Strategy("unified", norm_scale="none"),
    ],
    ids=lambda s: f"{s.preset}-{s.norm_scale}-{s.linear_scale}-{s.scale_param}",
)
@pytest.mark.parametrize("kind", ["qwen3", "qwen3_moe"])
def test_import_into_any_strategy_keeps_the_function(tmp_path, kind, strategy):
    stock = saved_stock(tmp_path / "stock", kind)
    import_checkpoint(tmp_path / "stock", tmp_path / "imported", strategy)
    model = ScaleVecForCausalLM.from_pretrained(tmp_path / "imported").eval()
    assert model.config.scale_preset == strategy.preset and model.config.qk_norm
    ids = random_ids(stock.config)
    torch.testing.assert_close(logits(model, ids), logits(stock, ids), atol=1e-5, rtol=0)


def test_import_without_a_final_norm_scale_is_refused_with_tied_embeddings(tmp_path):
    saved_stock(tmp_path / "stock", "llama", tie_word_embeddings=True)
    with pytest.raises(TargetError, match="tied embeddings"):
        import_checkpoint(tmp_path / "stock", tmp_path / "out", Strategy("none"))
    assert not (tmp_path / "out").exists()


def test_stock_features_scalevec_lacks_are_refused(tmp_path):
    saved_stock(tmp_path / "stock", "llama", attention_bias=True)
    with pytest.raises(ConversionError, match="attention_bias=True"):
        import_checkpoint(tmp_path / "stock", tmp_path / "out")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stock"]


def test_a_stock_checkpoint_exports_to_its_own_format_in_another_dtype_but_not_to_others(tmp_path):
    saved_stock(tmp_path / "mixtral", "mixtral")
    with pytest.raises(TargetError, match="qk_norm=False"):
        export_checkpoint(tmp_path / "mixtral", tmp_path / "qwen3_moe", "qwen3_moe")
    result = export_checkpoint(tmp_path / "mixtral", tmp_path / "bf16", "mixtral", OutputOptions(dtype="bfloat16"))
    assert result.verification.passed and result.verification.weight_dtype == torch.bfloat16
    converted = AutoModelForCausalLM.from_pretrained(tmp_path / "bf16", dtype="auto")
    assert type(converted).__name__ == "MixtralForCausalLM" and converted.dtype == torch.bfloat16


def test_verify_reports_and_fails_beyond_the_bound(tmp_path, capsys):
    saved_scalevec(tmp_path / "a", tiny_config(), seed=0)
    saved_scalevec(tmp_path / "b", tiny_config(), seed=1)
    export_checkpoint(tmp_path / "a", tmp_path / "a-llama", "llama", OutputOptions(verify=False))
    assert main(["verify", str(tmp_path / "a"), str(tmp_path / "a-llama")]) == 0
    assert "within the bound 1.000e-04" in capsys.readouterr().out
    assert main(["verify", str(tmp_path / "a"), str(tmp_path / "b")]) == 1
    assert "EXCEEDS" in capsys.readouterr().out
    far = compare_checkpoints(tmp_path / "a", tmp_path / "b")
    assert main(["verify", str(tmp_path / "a"), str(tmp_path / "b"), "--atol", str(far.max_abs * 2)]) == 0


def test_inspect_counts_scale_parameters_and_summarises_every_site(tmp_path, capsys):
    model = saved_scalevec(tmp_path / "moe", tiny_moe_config(qk_norm=True, output_norm=True))
    assert main(["inspect", str(tmp_path / "moe"), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    roles = model.scale_vector_roles()
    parameters = dict(model.named_parameters())
    for role, names in roles.items():
        assert summary["parameters"]["scale_vectors"][role] == sum(parameters[n].numel() for n in names)
    assert summary["strategy"]["norm_scale"] == "branch" and summary["moe_layers"] == 2
    sites = {site["site"]: site for site in summary["scale_sites"]}
    experts = sites["mlp.experts.gate_up_in_scale"]
    assert experts["vectors"] == 2 * 4 * 2 and experts["role"] == "input"
    assert sites["self_attn.q_norm"]["role"] == "output"
    q_norms = torch.cat([layer.self_attn.q_norm.vector().detach() for layer in model.model.layers])
    assert sites["self_attn.q_norm"]["max"] == pytest.approx(q_norms.max().item())
    assert main(["inspect", str(tmp_path / "moe")]) == 0
    assert "mlp.experts.down_out_scale" in capsys.readouterr().out


def test_every_command_explains_its_options(capsys):
    for command, option in [("fold", "--max-shard-size"), ("export", "--to"), ("import", "--preset")]:
        with pytest.raises(SystemExit) as exit_info:
            main([command, "--help"])
        assert exit_info.value.code == 0
        text = capsys.readouterr().out
        assert option in text and "--dtype" in text and "--no-verify" in text and "--overwrite" in text
