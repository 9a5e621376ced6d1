"""Folding and export compute exactly what the source computes, for every strategy and architecture variant, as
loaded by the stock class (or with trust_remote_code) in a fresh process where `scalevec` cannot be imported."""

import itertools
import json

import pytest
import torch
from safetensors import safe_open

from scalevec.convert import OutputOptions, export_checkpoint, scales

from ._helpers import (
    load_in_fresh_process,
    logits,
    random_ids,
    saved_scalevec,
    tiny_config,
    tiny_moe_config,
)

pytestmark = pytest.mark.slow  # every output loaded in one fresh process

STOCK_CLASSES = {
    "llama": "LlamaForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}
SCALE_ONLY_NAMES = ("in_scale", "out_scale", "magnitude", "direction")


def _case(preset, moe, qk_norm, output_norm, **extra):
    return dict(scale_preset=preset, moe=moe, qk_norm=qk_norm, output_norm=output_norm, **extra)


MATRIX = [_case(*values) for values in itertools.product(("none", "standard", "unified"), *[(False, True)] * 3)]
VARIANTS = [
    _case("unified", True, True, False, shared_expert_intermediate_size=8),
    _case("unified", True, True, False, mlp_only_layers=[0]),
    _case("unified", True, True, False, decoder_sparse_step=2, num_hidden_layers=3),
    _case("unified", True, True, False, norm_topk_prob=False),
    _case("unified", True, False, False, num_experts_per_tok=1),
    _case("unified", False, False, False, tie_word_embeddings=True),
    _case("unified", True, True, False, tie_word_embeddings=True),
    _case("none", False, True, False, tie_word_embeddings=True),
    _case("unified", False, False, True, norm_scale="shared", linear_scale="in"),
    _case("unified", True, False, False, norm_scale="branch", linear_scale="out", scale_param="direct"),
]
CASES = MATRIX + VARIANTS


def case_id(case: dict) -> str:
    return "-".join(f"{k}={v}" for k, v in case.items())


def config_of(case: dict):
    fields = {k: v for k, v in case.items() if k != "moe"}
    return tiny_moe_config(**fields) if case["moe"] else tiny_config(**fields)


def stock_target(config) -> str | None:
    """The one stock format that can express the folded model, if any."""
    all_moe = config.num_experts and all(config.is_moe_layer(i) for i in range(config.num_hidden_layers))
    if config.output_norm:
        return None
    if not config.num_experts:
        return "qwen3" if config.qk_norm else "llama"
    if config.shared_expert_intermediate_size:
        return None
    if config.qk_norm:
        return "qwen3_moe"
    return "mixtral" if all_moe and config.norm_topk_prob else None


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """Every case converted once (fold + its stock export), and every output loaded in one fresh process."""
    root = tmp_path_factory.mktemp("fold")
    outputs, expected, results = [], {}, {}
    for index, case in enumerate(CASES):
        config = config_of(case)
        model = saved_scalevec(root / f"{index}-src", config, seed=index)
        expected[index] = logits(model, random_ids(config))
        targets = ["scalevec"] + ([stock_target(config)] if stock_target(config) else [])
        for target in targets:
            destination = root / f"{index}-{target}"
            results[index, target] = export_checkpoint(root / f"{index}-src", destination, target, OutputOptions())
            outputs.append(destination)
    loaded = load_in_fresh_process(outputs, random_ids(tiny_config()), root / "fresh")
    return root, expected, results, loaded


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_fold_and_every_admissible_export_compute_the_same_logits(converted, case):
    root, expected, results, loaded = converted
    index = CASES.index(case)
    config = config_of(case)
    targets = [target for i, target in results if i == index]
    assert targets == ["scalevec"] + ([stock_target(config)] if stock_target(config) else [])
    for target in targets:
        output = loaded[str(root / f"{index}-{target}")]
        assert output["problems"] == {}, (target, output["problems"])
        torch.testing.assert_close(output["logits"], expected[index], atol=1e-4, rtol=0, msg=target)
        assert results[index, target].verification.max_abs <= 1e-4
        assert not [n for n in output["parameters"] if any(part in n for part in SCALE_ONLY_NAMES)], target
        if target == "scalevec":
            assert output["module"].startswith("transformers_modules"), output["module"]
        else:
            assert output["class"] == STOCK_CLASSES[target] and output["module"].startswith("transformers.models")


@pytest.mark.parametrize("case", CASES, ids=case_id)
def test_outputs_hold_no_unfolded_scale_and_the_fields_other_readers_need(converted, case):
    root, _, results, _ = converted
    index = CASES.index(case)
    for (i, target), result in results.items():
        if i != index:
            continue
        folder = root / f"{index}-{target}"
        with safe_open(folder / "model.safetensors", "pt") as f:
            keys = list(f.keys())
        assert not [k for k in keys if any(part in k for part in SCALE_ONLY_NAMES)], target
        assert ("lm_head.weight" in keys) != config_of(case).tie_word_embeddings
        saved = json.loads((folder / "config.json").read_text())
        if target == "scalevec":
            assert saved["folded"] and (saved["norm_scale"], saved["linear_scale"]) == ("shared", "none")
            assert saved["auto_map"]["AutoModelForCausalLM"] == "modeling_scalevec.ScaleVecForCausalLM"
            assert {"configuration_scalevec.py", "modeling_scalevec.py", "scaled_ops.py"} <= set(result.files)
            continue
        assert saved["architectures"] == [STOCK_CLASSES[target]] and saved["model_type"] == target
        assert saved["rope_theta"] == saved["rope_parameters"]["rope_theta"]
        assert not any(name.endswith(".py") for name in result.files)
        if target == "mixtral":
            assert saved["num_local_experts"] == 4 and any("block_sparse_moe.experts.3.w2" in k for k in keys)
        if target == "qwen3_moe":
            assert saved["num_experts"] == saved["num_local_experts"] == 4
            assert any(k.endswith("mlp.experts.3.down_proj.weight") for k in keys)


def test_qwen3_moe_export_warns_about_llama_cpp_without_top_k_renormalisation(converted):
    _, _, results, _ = converted
    index = CASES.index(VARIANTS[3])
    (warning,) = results[index, "qwen3_moe"].warnings
    assert "llama.cpp always renormalises the top-k weights, so its outputs will differ" in warning
    assert not results[index, "scalevec"].warnings


def test_a_standard_checkpoint_folds_to_its_own_weights(tmp_path):
    model = saved_scalevec(tmp_path / "src", tiny_config(scale_preset="standard", qk_norm=True))
    export_checkpoint(tmp_path / "src", tmp_path / "qwen3", "qwen3")
    with safe_open(tmp_path / "qwen3" / "model.safetensors", "pt") as f:
        for name, parameter in model.state_dict().items():
            torch.testing.assert_close(f.get_tensor(name), parameter, atol=0, rtol=0, msg=name)


def test_branch_scales_that_differ_fold_into_the_matrices_and_leave_unit_norms(tmp_path):
    model = saved_scalevec(tmp_path / "src", tiny_config(norm_scale="branch", linear_scale="none"))
    export_checkpoint(tmp_path / "src", tmp_path / "llama", "llama")
    with safe_open(tmp_path / "llama" / "model.safetensors", "pt") as f:
        torch.testing.assert_close(f.get_tensor("model.layers.0.input_layernorm.weight"), torch.ones(32))
        attention = model.model.layers[0].self_attn.k_proj
        folded = attention.weight * attention.in_scale.vector()
        torch.testing.assert_close(f.get_tensor("model.layers.0.self_attn.k_proj.weight"), folded.detach())


def _computed(matrix) -> torch.Tensor:
    return torch.cat([block.clone().reshape(-1) for block in matrix.blocks()]).reshape(matrix.shape)


def test_a_scaled_matrix_is_computed_block_by_block_exactly(monkeypatch):
    """Folded matrices are products computed while they are written, a few rows at a time; with blocks of two rows,
    stacked experts, row groups (gate, up), a second scaling and the split into experts give the eager result."""
    monkeypatch.setattr(scales, "BLOCK_ELEMENTS", 2 * 7)
    torch.manual_seed(0)
    weight, rows, columns = torch.randn(3, 2 * 5, 7), torch.rand(3, 2, 5), torch.rand(3, 2, 7)
    eager = (weight.unflatten(-2, (2, -1)) * rows[..., None] * columns[..., None, :]).reshape(weight.shape)
    matrix = scales.scale_matrix(weight, rows, columns, row_groups=2)
    assert tuple(matrix.shape) == tuple(weight.shape)
    torch.testing.assert_close(_computed(matrix), eager, rtol=0, atol=0)
    more = torch.rand(7)
    twice = scales.scale_matrix(matrix, None, more, row_groups=2)
    torch.testing.assert_close(_computed(twice), eager * more, rtol=1e-6, atol=0)
    torch.testing.assert_close(_computed(twice.unflatten(-2, (2, -1))[1, 0]), (eager * more)[1, :5])
    with pytest.raises(IndexError, match="integers into its stack dimensions"):
        matrix[0:1]
    with pytest.raises(IndexError, match="reaches into the matrices"):
        scales.scale_matrix(weight[0], None, more)[0]
