import itertools

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from scalevec import ScaleVecForCausalLM, ScaleVecModel

from ._helpers import (
    STRATEGIES,
    TINY,
    gradients,
    logits,
    matrices_of,
    random_ids,
    randomize_scales,
    run_without_scalevec,
    tiny_config,
)


def build(seed: int = 0, **overrides) -> ScaleVecForCausalLM:
    torch.manual_seed(seed)
    return ScaleVecForCausalLM(tiny_config(**overrides)).eval()


@pytest.mark.parametrize("qk_norm, output_norm", list(itertools.product((False, True), repeat=2)))
@pytest.mark.parametrize("norm_scale, linear_scale, scale_param", STRATEGIES)
def test_every_strategy_trains_and_every_scale_gets_a_gradient(
    norm_scale, linear_scale, scale_param, qk_norm, output_norm
):
    model = build(
        norm_scale=norm_scale,
        linear_scale=linear_scale,
        scale_param=scale_param,
        qk_norm=qk_norm,
        output_norm=output_norm,
    ).train()
    randomize_scales(model)
    ids = random_ids(model.config)
    loss = model(ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    parameters = dict(model.named_parameters())
    names = [name for role in model.scale_vector_roles().values() for name in role]
    assert len(names) == len(set(names))
    assert len(names) > 0 or (norm_scale, linear_scale, qk_norm, output_norm) == ("none", "none", False, False)
    for name in names:
        assert parameters[name].grad is not None and parameters[name].grad.abs().sum() > 0, name


@pytest.mark.parametrize("preset", ["none", "standard", "unified"])
def test_presets_build_and_train(preset):
    model = build(scale_preset=preset).train()
    ids = random_ids(model.config)
    model(ids, labels=ids).loss.backward()
    assert all(p.grad is not None for p in model.parameters() if p.requires_grad)


@pytest.mark.parametrize("qk_norm, output_norm", [(False, False), (True, True)])
@pytest.mark.parametrize("norm_scale, linear_scale, scale_param", STRATEGIES)
def test_scales_at_one_change_nothing(norm_scale, linear_scale, scale_param, qk_norm, output_norm):
    reference = build(scale_preset="standard", qk_norm=qk_norm, output_norm=output_norm)
    model = build(
        seed=1,
        norm_scale=norm_scale,
        linear_scale=linear_scale,
        scale_param=scale_param,
        qk_norm=qk_norm,
        output_norm=output_norm,
    )
    missing, _ = model.load_state_dict(matrices_of(reference), strict=False)
    assert set(missing) <= {n for role in model.scale_vector_roles().values() for n in role}
    ids = random_ids(model.config)
    torch.testing.assert_close(logits(model, ids), logits(reference, ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "reference_cls, config_cls, qk_norm",
    [(LlamaForCausalLM, LlamaConfig, False), (Qwen3ForCausalLM, Qwen3Config, True)],
)
@pytest.mark.parametrize("tie", [False, True])
def test_standard_matches_stock_transformers(reference_cls, config_cls, qk_norm, tie):
    shared = {k: v for k, v in TINY.items()}
    torch.manual_seed(0)
    reference = reference_cls(config_cls(**shared, head_dim=8, tie_word_embeddings=tie, rms_norm_eps=1e-6)).eval()
    with torch.no_grad():  # stock norms start at 1: move them so the comparison sees them
        for name, parameter in reference.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
    model = ScaleVecForCausalLM(tiny_config(scale_preset="standard", qk_norm=qk_norm, tie_word_embeddings=tie))
    model.load_state_dict(reference.state_dict(), strict=True)
    ids = random_ids(model.config)
    torch.testing.assert_close(logits(model.eval(), ids), logits(reference, ids), atol=1e-5, rtol=0)


def unified_with_random_scales(**overrides):
    model = build(scale_preset="unified", qk_norm=True, output_norm=True, **overrides)
    randomize_scales(model)
    return model


def test_sdpa_equals_eager():
    model = unified_with_random_scales()
    ids = random_ids(model.config)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    model.set_attn_implementation("eager")
    eager = logits(model, ids, attention_mask=mask)
    model.set_attn_implementation("sdpa")
    sdpa = logits(model, ids, attention_mask=mask)
    real = mask.bool()  # fully masked (padding) queries have no defined output
    torch.testing.assert_close(sdpa[real], eager[real], atol=1e-5, rtol=0)


def test_hidden_states_and_attentions_are_recorded():
    model = unified_with_random_scales(attn_implementation="eager")
    out = model(random_ids(model.config), output_hidden_states=True, output_attentions=True)
    assert len(out.hidden_states) == model.config.num_hidden_layers + 1
    assert out.attentions[0].shape == (2, model.config.num_attention_heads, 9, 9)


def test_logits_to_keep_and_position_ids():
    model = unified_with_random_scales()
    ids = random_ids(model.config)
    full = logits(model, ids)
    torch.testing.assert_close(logits(model, ids, logits_to_keep=1), full[:, -1:], atol=1e-6, rtol=0)
    shifted = logits(model, ids, position_ids=torch.arange(5, 5 + ids.shape[1]).unsqueeze(0))
    assert not torch.allclose(shifted, full)


def test_generate_with_cache_equals_without_cache():
    model = unified_with_random_scales()
    ids = random_ids(model.config, length=5)
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    cached = model.generate(ids, use_cache=True, **kwargs)
    uncached = model.generate(ids, use_cache=False, **kwargs)
    assert torch.equal(cached, uncached)
    assert cached.shape == (2, 13)


def test_generate_with_left_padding_matches_unpadded():
    model = unified_with_random_scales()
    ids = random_ids(model.config, batch=1, length=4)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), ids], dim=1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones_like(ids)], dim=1)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    alone = model.generate(ids, **kwargs)[:, 4:]
    batched = model.generate(
        torch.cat([padded, random_ids(model.config, 1, 7, seed=3)]),
        attention_mask=torch.cat([mask, torch.ones(1, 7, dtype=torch.long)]),
        **kwargs,
    )
    assert torch.equal(batched[:1, 7:], alone)


def test_gradient_checkpointing_gives_the_same_gradients():
    model = unified_with_random_scales().train()
    ids = random_ids(model.config)
    plain = gradients(model, ids)
    model.activation_checkpointing_enable()
    assert model.is_activation_checkpointing
    checkpointed = gradients(model, ids)
    for name in plain:
        torch.testing.assert_close(checkpointed[name], plain[name], atol=1e-6, rtol=1e-5)


def test_custom_backward_matches_autograd_of_the_plain_formula():
    """The fused scaled matmul's hand-written backward against autograd of `b * ((a * x) @ W.T)`: maps with both
    scales, a row scale only and a column scale only, in one call."""
    from scalevec.scaled_ops import scaled_linear

    torch.manual_seed(0)
    x = torch.randn(3, 5, 6, dtype=torch.float64, requires_grad=True)

    def leaf(*shape):
        return torch.randn(*shape, dtype=torch.float64, requires_grad=True)

    leaves = [x, leaf(4, 6), leaf(2, 6), leaf(3, 6), leaf(6), leaf(6), leaf(4), leaf(2)]

    def fused_of(x, w0, w1, w2, a0, a2, b0, b1):
        return torch.cat(scaled_linear(x, [(w0, a0, b0), (w1, None, b1), (w2, a2, None)]), -1)

    def plain_of(x, w0, w1, w2, a0, a2, b0, b1):
        return torch.cat([(x * a0) @ w0.T * b0, x @ w1.T * b1, (x * a2) @ w2.T], -1)

    assert torch.autograd.gradcheck(fused_of, leaves)
    fused, plain = fused_of(*leaves), plain_of(*leaves)
    grad = torch.randn_like(plain)
    expected = torch.autograd.grad(plain, leaves, grad)
    actual = torch.autograd.grad(fused, leaves, grad)
    for e, a in zip(expected, actual):
        torch.testing.assert_close(a, e)


@pytest.mark.parametrize("moe", [False, True])
def test_vectors_formed_at_the_start_of_a_training_forward_change_no_gradient(moe, monkeypatch):
    """A training forward forms every magnitude-direction vector at its start, stacked by shape; the layers use
    those, and logits and gradients equal forming each vector where it is used."""
    from scalevec import scaled_ops
    from scalevec.modeling_scalevec import ScaleVecScale

    model = unified_with_random_scales(**(dict(num_experts=4, num_experts_per_tok=2) if moe else {})).train()
    ids = random_ids(model.config)
    magdir = [m for m in model.modules() if isinstance(m, ScaleVecScale) and m.scale_param == "magdir"]
    seen = []
    hook = model.model.layers[0].register_forward_pre_hook(lambda *_: seen.append([s.formed for s in magdir]))
    formed = gradients(model, ids)
    hook.remove()
    (vectors,) = seen
    for scale, vector in zip(magdir, vectors):
        expected = scale.direction / scale.direction.pow(2).mean(-1, keepdim=True).sqrt() * scale.magnitude
        torch.testing.assert_close(vector, expected)
    assert all(scale.formed is None for scale in magdir)  # only for the forward that formed them
    monkeypatch.setattr(scaled_ops, "formed_scale_vectors", lambda model: {})
    one_by_one = gradients(model, ids)
    for name in formed:
        torch.testing.assert_close(formed[name], one_by_one[name], atol=1e-6, rtol=1e-5)


def test_save_and_reload_give_equal_logits(tmp_path):
    model = unified_with_random_scales()
    model.save_pretrained(tmp_path)
    ids = random_ids(model.config)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert isinstance(reloaded, ScaleVecForCausalLM)
    torch.testing.assert_close(logits(reloaded, ids), logits(model, ids), atol=0, rtol=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "config.json",
        "configuration_scalevec.py",
        "generation_config.json",
        "model.safetensors",
        "modeling_scalevec.py",
        "scaled_ops.py",
    ]


@pytest.mark.parametrize("tie", [False, True])
@pytest.mark.slow
def test_remote_code_loads_where_scalevec_is_not_installed(tmp_path, tie):
    model = unified_with_random_scales(tie_word_embeddings=tie)
    model.save_pretrained(tmp_path / "model")
    ids = random_ids(model.config)
    save_file({"ids": ids, "logits": logits(model, ids)}, tmp_path / "expected.safetensors")
    run_without_scalevec(
        """
        import sys, torch
        from safetensors.torch import load_file, save_file
        from transformers import AutoModel, AutoModelForCausalLM
        folder, out = sys.argv[1], sys.argv[2]
        ids = load_file(sys.argv[3])["ids"]
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        base = AutoModel.from_pretrained(folder, trust_remote_code=True)
        assert type(base).__name__ == "ScaleVecModel"
        with torch.no_grad():
            save_file({"logits": model(ids).logits}, out)
        """,
        str(tmp_path / "model"),
        str(tmp_path / "actual.safetensors"),
        str(tmp_path / "expected.safetensors"),
    )
    actual = load_file(tmp_path / "actual.safetensors")["logits"]
    torch.testing.assert_close(actual, load_file(tmp_path / "expected.safetensors")["logits"], atol=0, rtol=0)


@pytest.mark.slow
def test_remote_code_without_trust_is_refused_when_package_missing(tmp_path):
    build().save_pretrained(tmp_path)
    out = run_without_scalevec(
        """
        import sys
        from transformers import AutoModelForCausalLM
        try:
            AutoModelForCausalLM.from_pretrained(sys.argv[1])
        except ValueError as error:
            print("refused:", "trust_remote_code" in str(error))
        """,
        str(tmp_path),
    )
    assert "refused: True" in out


def test_roles_put_output_norms_and_qk_norms_in_output():
    model = build(scale_preset="unified", qk_norm=True, output_norm=True)
    roles = model.scale_vector_roles()
    output_markers = ("q_norm", "k_norm", "attention_output_layernorm", "mlp_output_layernorm")
    assert roles["output"] and all(any(m in n for m in output_markers) for n in roles["output"])
    assert not any(any(m in n for m in output_markers) for n in roles["input"])
    parameters = dict(model.named_parameters())
    one_dim_or_magnitude = {n for n, p in parameters.items() if p.ndim == 1}
    assert set(roles["input"]) | set(roles["output"]) == one_dim_or_magnitude
    assert model.num_scale_parameters() == sum(parameters[n].numel() for r in roles.values() for n in r)
    assert ScaleVecModel(model.config).scale_vector_roles()["input"][0].startswith("layers.0.")


def _same_matrices(linear_scale: str, source: torch.nn.Module) -> torch.nn.Module:
    model = ScaleVecForCausalLM(tiny_config(linear_scale=linear_scale, scale_param="direct")).eval()
    model.load_state_dict(matrices_of(source), strict=False)
    return model


def test_a_redundant_pair_of_scales_is_stored_once_and_loses_nothing():
    """up's rows and down's columns multiply the same features, as do v's rows and o's columns (attention mixes
    v's features linearly). With rows and columns (`linear_scale="both"`) each pair keeps one vector, and that one
    computes what the dropped one did: down's columns move to up's rows, v's rows to o's columns (per query head)."""
    torch.manual_seed(0)
    columns_only = ScaleVecForCausalLM(tiny_config(linear_scale="in", scale_param="direct")).eval()
    rows_only, both = _same_matrices("out", columns_only), _same_matrices("both", columns_only)
    ids = random_ids(both.config)
    groups = both.config.num_attention_heads // both.config.num_key_value_heads
    layers = list(zip(both.model.layers, columns_only.model.layers, rows_only.model.layers))
    with torch.no_grad():
        for mine, columns, _ in layers:
            assert mine.mlp.down_proj.in_scale is None and mine.self_attn.v_proj.out_scale is None
            mine.mlp.up_proj.out_scale.weight.copy_(columns.mlp.down_proj.in_scale.weight.uniform_(0.5, 1.5))
    torch.testing.assert_close(logits(both, ids), logits(columns_only, ids), atol=1e-5, rtol=0)
    with torch.no_grad():
        for mine, _, rows in layers:
            mine.mlp.up_proj.out_scale.weight.fill_(1.0)
            v_rows = rows.self_attn.v_proj.out_scale.weight.uniform_(0.5, 1.5)
            per_query_head = v_rows.view(-1, both.config.head_dim).repeat_interleave(groups, dim=0)
            mine.self_attn.o_proj.in_scale.weight.copy_(per_query_head.reshape(-1))
    torch.testing.assert_close(logits(both, ids), logits(rows_only, ids), atol=1e-5, rtol=0)


def test_unified_overhead_at_012b_is_under_a_tenth_of_a_percent():
    sizes = dict(
        vocab_size=32000,
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
    )
    with torch.device("meta"):
        standard = ScaleVecForCausalLM(tiny_config(**sizes, scale_preset="standard"))
        unified = ScaleVecForCausalLM(tiny_config(**sizes, scale_preset="unified"))
    total = sum(p.numel() for p in standard.parameters())
    extra = sum(p.numel() for p in unified.parameters()) - total
    hidden, inter, kv = 768, 2048, 256
    branch = 5 * hidden  # q k v gate up
    rows = hidden + kv + hidden + inter + inter + hidden  # q k o gate up down; o's columns cover v's rows
    columns = hidden  # o; up's rows cover down's columns
    per_layer = branch + rows + columns + 12 - 2 * hidden  # + a magnitude per vector - the standard norms
    assert extra == 12 * per_layer + 1  # + the final norm's magnitude
    assert 0.1e9 < total < 0.15e9
    assert extra / total < 1e-3


@pytest.mark.parametrize("moe", [False, True])
def test_bf16_autocast_and_bf16_weights_train(moe):
    extra = dict(num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=8) if moe else {}
    model = unified_with_random_scales(**extra)
    if moe:  # a trained router is decisive; at init its near-ties would flip experts under bf16 rounding
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.gate.weight.mul_(50)
    ids = random_ids(model.config)
    reference = logits(model, ids)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, labels=ids)
    out.loss.backward()
    assert out.logits.dtype == torch.bfloat16
    torch.testing.assert_close(out.logits.float(), reference, atol=0.05 * reference.abs().max().item(), rtol=0)
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())

    half = ScaleVecForCausalLM(model.config).to(torch.bfloat16)
    half.load_state_dict(model.state_dict())
    out = half(ids, labels=ids)
    out.loss.backward()
    torch.testing.assert_close(out.logits.float(), reference, atol=0.05 * reference.abs().max().item(), rtol=0)
    assert all(p.grad is not None and p.grad.dtype == torch.bfloat16 for p in half.parameters())
