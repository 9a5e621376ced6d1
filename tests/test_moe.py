import contextlib
import itertools
import json

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

from scalevec import ScaleVecConfig, ScaleVecForCausalLM, scaled_ops
from scalevec.train import ScaleVecTrainer, ScaleVecTrainingArguments

from ._helpers import (
    STRATEGIES,
    TINY,
    TINY_MOE,
    logits,
    matrices_of,
    random_ids,
    randomize_scales,
    run_without_scalevec,
    tiny_moe_config,
)


def build(seed: int = 0, **overrides) -> ScaleVecForCausalLM:
    torch.manual_seed(seed)
    return ScaleVecForCausalLM(tiny_moe_config(**overrides)).eval()


def _vec(scale, shape) -> torch.Tensor:
    return torch.ones(shape) if scale is None else scale.vector()


def naive_moe(block, x: torch.Tensor) -> torch.Tensor:
    """A per-token, per-expert loop written from the formulas, as the reference for the grouped dispatch."""
    router, experts = block.gate, block.experts
    num_experts, hidden, inter = experts.num_experts, x.shape[-1], experts.intermediate_size
    logits = ((x * _vec(router.in_scale, hidden)) @ router.weight.T) * _vec(router.out_scale, num_experts)
    probs = F.softmax(logits.float(), dim=-1)
    weights, index = probs.topk(router.top_k, dim=-1)
    if router.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    gate_up_in = _vec(experts.gate_up_in_scale, (num_experts, 2, hidden))
    gate_up_out = _vec(experts.gate_up_out_scale, (num_experts, 2, inter))
    down_in = _vec(experts.down_in_scale, (num_experts, inter))
    down_out = _vec(experts.down_out_scale, (num_experts, hidden))
    rows = []
    for t in range(x.shape[0]):
        row = torch.zeros(hidden)
        for j in range(router.top_k):
            e = index[t, j]
            w_gate, w_up = experts.gate_up_proj[e, :inter], experts.gate_up_proj[e, inter:]
            gate = (w_gate @ (x[t] * gate_up_in[e, 0])) * gate_up_out[e, 0]
            up = (w_up @ (x[t] * gate_up_in[e, 1])) * gate_up_out[e, 1]
            y = (experts.down_proj[e] @ (F.silu(gate) * up * down_in[e])) * down_out[e]
            row = row + weights[t, j] * y
        rows.append(row)
    out = torch.stack(rows)
    if block.shared_expert is not None:
        mlp = block.shared_expert
        gate = (mlp.gate_proj.weight @ (x * _vec(mlp.gate_proj.in_scale, hidden)).T).T
        gate = gate * _vec(mlp.gate_proj.out_scale, mlp.intermediate_size)
        up = (mlp.up_proj.weight @ (x * _vec(mlp.up_proj.in_scale, hidden)).T).T
        up = up * _vec(mlp.up_proj.out_scale, mlp.intermediate_size)
        h = F.silu(gate) * up * _vec(mlp.down_proj.in_scale, mlp.intermediate_size)
        shared = (h @ mlp.down_proj.weight.T) * _vec(mlp.down_proj.out_scale, hidden)
        shared_gate = (x * _vec(block.shared_expert_gate.in_scale, hidden)) @ block.shared_expert_gate.weight.T
        out = out + torch.sigmoid(shared_gate) * shared
    return out


def grads_of(block, fn, x):
    block.zero_grad()
    x = x.clone().requires_grad_(True)
    out = fn(x)
    out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape))
    return out.detach(), x.grad, {n: p.grad.clone() for n, p in block.named_parameters()}


def assert_matches_naive(block, x) -> dict[str, torch.Tensor]:
    """Output, input gradient and every parameter gradient of the block equal the naive loop's (1e-5)."""
    out, x_grad, grads = grads_of(block, block, x)
    ref_out, ref_x_grad, ref_grads = grads_of(block, lambda h: naive_moe(block, h), x)
    torch.testing.assert_close(out, ref_out, atol=1e-5, rtol=0)
    torch.testing.assert_close(x_grad, ref_x_grad, atol=1e-5, rtol=0)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-5, rtol=1e-5, msg=name)
    return grads


@pytest.mark.parametrize("top_k", [1, 2, 4])
@pytest.mark.parametrize("norm_topk_prob", [False, True])
@pytest.mark.parametrize("shared_expert", [0, 12])
@pytest.mark.parametrize("preset", ["standard", "unified"])
def test_grouped_dispatch_equals_a_per_token_loop(top_k, norm_topk_prob, shared_expert, preset):
    model = build(
        scale_preset=preset,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm_topk_prob,
        shared_expert_intermediate_size=shared_expert,
    )
    randomize_scales(model)
    block = model.model.layers[0].mlp
    assert_matches_naive(block, torch.randn(11, TINY["hidden_size"], generator=torch.Generator().manual_seed(1)))


def test_experts_that_receive_no_tokens():
    model = build(scale_preset="unified", num_experts_per_tok=2)
    randomize_scales(model)
    block = model.model.layers[0].mlp
    with torch.no_grad():
        block.gate.weight[2:] = -1.0  # positive inputs never pick experts 2 and 3
    x = torch.rand(7, TINY["hidden_size"]) + 0.1
    _, _, index = block.gate(x)
    assert set(index.unique().tolist()) == {0, 1}
    grads = assert_matches_naive(block, x)
    assert grads["experts.gate_up_proj"][2:].abs().sum() == 0


@contextlib.contextmanager
def saved_bytes(module: torch.nn.Module):
    """Bytes of every tensor autograd saves for backward, other than the module's parameters."""
    parameters = {p.untyped_storage().data_ptr() for p in module.parameters()}
    sizes = []

    def pack(tensor):
        storage = tensor.untyped_storage()
        sizes.append(0 if storage.data_ptr() in parameters else storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        yield sizes


def test_only_experts_that_receive_tokens_are_folded(monkeypatch):
    model = build(scale_preset="unified", num_experts_per_tok=1)
    randomize_scales(model)
    block = model.model.layers[0].mlp
    x = torch.randn(3, TINY["hidden_size"], generator=torch.Generator().manual_seed(2))
    receiving = block.gate(x)[2].unique().numel()
    assert receiving <= block.experts.num_experts // 2
    selected = []
    receiving_experts = scaled_ops.receiving_experts

    def recording(group_sizes):
        experts, sizes = receiving_experts(group_sizes)
        selected.append((experts.tolist(), sizes.tolist()))
        return experts, sizes

    monkeypatch.setattr(scaled_ops, "receiving_experts", recording)
    with saved_bytes(block) as compact_saved:
        out, x_grad, grads = grads_of(block, block, x)
    assert len(selected[0][0]) == receiving and 0 not in selected[0][1]
    idle = [e for e in range(block.experts.num_experts) if e not in selected[0][0]]
    assert grads["experts.gate_up_proj"][idle].abs().sum() == 0
    monkeypatch.setattr(scaled_ops, "receiving_experts", lambda group_sizes: (None, group_sizes))  # every expert
    with saved_bytes(block) as all_saved:
        all_out, all_x_grad, all_grads = grads_of(block, block, x)
    # the selection saves its index, not copies of the receiving experts' weights
    assert 0 < sum(compact_saved) <= sum(all_saved) + 64
    torch.testing.assert_close(out, all_out, atol=1e-6, rtol=0)
    torch.testing.assert_close(x_grad, all_x_grad, atol=1e-6, rtol=0)
    for name, grad in all_grads.items():
        torch.testing.assert_close(grads[name], grad, atol=1e-6, rtol=1e-6, msg=name)


def test_dispatch_is_deterministic():
    model = build(scale_preset="unified").train()
    ids = random_ids(model.config)
    first = torch.autograd.grad(model(ids, labels=ids).loss, list(model.parameters()))
    second = torch.autograd.grad(model(ids, labels=ids).loss, list(model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(first, second))


def stock_moe_weights(reference_cls, config_cls, **extra):
    torch.manual_seed(0)
    reference = reference_cls(config_cls(**{**TINY, **extra}, head_dim=8, output_router_logits=True)).eval()
    with torch.no_grad():
        for name, parameter in reference.named_parameters():
            if "norm" in name:
                parameter.uniform_(0.5, 1.5)
    return reference


def assert_same_as_stock(reference, model):
    assert model.config.rms_norm_eps == reference.config.rms_norm_eps
    assert model.config.rope_parameters["rope_theta"] == reference.config.rope_parameters["rope_theta"]
    model.load_state_dict(reference.state_dict(), strict=True)
    ids = random_ids(model.config)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    with torch.no_grad():
        ours, theirs = model(ids, attention_mask=mask, labels=ids), reference(ids, attention_mask=mask, labels=ids)
    real = mask.bool()
    torch.testing.assert_close(ours.logits[real], theirs.logits[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(ours.aux_loss, theirs.aux_loss, atol=1e-6, rtol=0)
    torch.testing.assert_close(ours.loss, theirs.loss, atol=1e-5, rtol=0)
    # without labels: router logits and the balancing loss as the config (on in both) says, or the flag
    assert model.config.output_router_logits and reference.config.output_router_logits
    with torch.no_grad():
        ours, theirs = model(ids, attention_mask=mask), reference(ids, attention_mask=mask)
        ours_off, theirs_off = (m(ids, output_router_logits=False) for m in (model, reference))
    torch.testing.assert_close(ours.aux_loss, theirs.aux_loss, atol=1e-6, rtol=0)
    assert len(ours.router_logits) == len(theirs.router_logits) > 0
    assert ours_off.aux_loss is theirs_off.aux_loss is None and ours_off.router_logits is theirs_off.router_logits


def test_standard_moe_matches_mixtral():
    reference = stock_moe_weights(
        MixtralForCausalLM,
        MixtralConfig,
        num_local_experts=4,
        num_experts_per_tok=2,
        intermediate_size=16,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
    )
    config = tiny_moe_config(scale_preset="standard", norm_topk_prob=True, rope_theta=1e6, output_router_logits=True)
    model = ScaleVecForCausalLM(config).eval()
    assert_same_as_stock(reference, model)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_standard_moe_with_qk_norm_matches_qwen3_moe(norm_topk_prob):
    reference = stock_moe_weights(
        Qwen3MoeForCausalLM,
        Qwen3MoeConfig,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=16,
        norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=2,
        mlp_only_layers=[],
    )
    model = ScaleVecForCausalLM(
        tiny_moe_config(
            scale_preset="standard",
            qk_norm=True,
            decoder_sparse_step=2,
            norm_topk_prob=norm_topk_prob,
            output_router_logits=True,
        )
    ).eval()
    assert not model.config.is_moe_layer(0) and model.config.is_moe_layer(1)
    assert_same_as_stock(reference, model)


@pytest.mark.parametrize("shared_expert", [0, 8])
@pytest.mark.parametrize("norm_scale, linear_scale, scale_param", STRATEGIES)
def test_every_strategy_with_experts_trains_and_every_scale_gets_a_gradient(
    norm_scale, linear_scale, scale_param, shared_expert
):
    model = build(
        norm_scale=norm_scale,
        linear_scale=linear_scale,
        scale_param=scale_param,
        qk_norm=True,
        output_norm=True,
        shared_expert_intermediate_size=shared_expert,
        num_experts_per_tok=4,
    ).train()
    randomize_scales(model)
    ids = random_ids(model.config)
    out = model(ids, labels=ids, output_router_logits=True)  # as ScaleVecTrainer trains a MoE model
    out.loss.backward()
    assert out.aux_loss is not None and torch.isfinite(out.loss)
    parameters = dict(model.named_parameters())
    for name in model.scale_vector_roles()["input"] + model.scale_vector_roles()["output"]:
        assert parameters[name].grad is not None and parameters[name].grad.abs().sum() > 0, name
    expert_scales = [n for n in model.scale_vector_roles()["input"] if ".experts." in n]
    assert all(parameters[n].shape[0] == 4 for n in expert_scales)
    assert bool(expert_scales) == (norm_scale == "branch" or linear_scale != "none")


@pytest.mark.parametrize("norm_scale, linear_scale, scale_param", STRATEGIES)
def test_moe_scales_at_one_change_nothing(norm_scale, linear_scale, scale_param):
    reference = build(scale_preset="standard", shared_expert_intermediate_size=8)
    model = build(
        seed=1,
        norm_scale=norm_scale,
        linear_scale=linear_scale,
        scale_param=scale_param,
        shared_expert_intermediate_size=8,
    )
    model.load_state_dict(matrices_of(reference), strict=False)
    ids = random_ids(model.config)
    torch.testing.assert_close(logits(model, ids), logits(reference, ids), atol=1e-5, rtol=0)


def test_aux_and_z_losses_enter_the_loss_with_their_coefficients():
    model = build(scale_preset="unified", router_aux_loss_coef=0.5, router_z_loss_coef=0.25)
    ids = random_ids(model.config)
    out = model(ids, labels=ids, output_router_logits=True)
    plain = model(ids, labels=ids)
    assert plain.aux_loss is None
    z = torch.stack(out.router_logits).logsumexp(-1).square().mean()
    torch.testing.assert_close(out.loss, plain.loss + 0.5 * out.aux_loss + 0.25 * z, atol=1e-6, rtol=0)
    assert len(out.router_logits) == model.config.num_hidden_layers
    assert out.router_logits[0].shape == (ids.numel(), model.config.num_experts)


def test_padding_is_masked_out_of_the_z_loss():
    model = build(scale_preset="unified", router_aux_loss_coef=0.0, router_z_loss_coef=1.0)
    ids = random_ids(model.config)
    mask = torch.ones_like(ids)
    mask[0, :4] = 0
    labels = ids.masked_fill(mask == 0, -100)
    out = model(ids, attention_mask=mask, labels=labels, output_router_logits=True)
    plain = model(ids, attention_mask=mask, labels=labels)
    z = torch.stack(out.router_logits).logsumexp(-1).square()[:, mask.reshape(-1).bool()].mean()
    torch.testing.assert_close(out.loss - plain.loss, z, atol=1e-5, rtol=0)


@pytest.mark.parametrize(
    "saved, balanced",
    [
        ({}, True),  # a new config: the flag off, as Qwen3-MoE's
        ({"output_router_logits": True}, True),  # a checkpoint saved with the flag on (ScaleVec's former default)
        ({"router_aux_loss_coef": 0.0}, False),  # TRL's rule: both coefficients 0 turn balancing off
    ],
)
@pytest.mark.slow  # the Trainer's data-loading worker processes
def test_scalevec_trainer_balances_the_experts_and_leaves_the_saved_flag_alone(saved, balanced, tmp_path):
    """`ScaleVecTrainer` (the trainer of `scalevec-train` and `scalevec-ablate`) trains a MoE model on the language
    loss plus `router_aux_loss_coef` times the balancing loss, asked of each forward: the config it saves keeps its
    flag, so that a new model's checkpoints run plain forwards."""
    build(**saved).save_pretrained(tmp_path / "model")
    model = ScaleVecForCausalLM.from_pretrained(tmp_path / "model")
    ids = random_ids(model.config)
    with torch.no_grad():
        plain = model(ids, labels=ids, output_router_logits=False).loss.item()
        aux_loss = model(ids, output_router_logits=True).aux_loss.item()
    args = ScaleVecTrainingArguments(
        tmp_path / "run",
        max_steps=1,
        logging_steps=1,
        per_device_train_batch_size=2,
        scale_stats=False,
        report_to="none",
        disable_tqdm=True,
    )
    trainer = ScaleVecTrainer(model=model, args=args, train_dataset=[dict(input_ids=row, labels=row) for row in ids])
    trainer.train()
    (loss,) = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]  # before the update
    expected = plain + model.config.router_aux_loss_coef * aux_loss if balanced else plain
    assert loss == pytest.approx(expected, abs=1e-6) and (abs(loss - plain) > 1e-4) == balanced
    trainer.save_model(tmp_path / "trained")
    flag = json.loads((tmp_path / "trained" / "config.json").read_text())["output_router_logits"]
    assert flag is saved.get("output_router_logits", False)


@pytest.mark.parametrize("layers", [dict(mlp_only_layers=[0]), dict(decoder_sparse_step=2), dict()])
def test_mixed_dense_and_moe_layers(layers):
    model = build(scale_preset="unified", num_hidden_layers=4, **layers)
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    expected = ["ScaleVecSparseMoeBlock" if model.config.is_moe_layer(i) else "ScaleVecMLP" for i in range(4)]
    assert kinds == expected and "ScaleVecMLP" in kinds if layers else kinds == ["ScaleVecSparseMoeBlock"] * 4
    out = model(random_ids(model.config), output_router_logits=True)
    assert len(out.router_logits) == kinds.count("ScaleVecSparseMoeBlock")


def test_generate_with_cache_equals_without_cache():
    model = build(scale_preset="unified", shared_expert_intermediate_size=8)
    randomize_scales(model)
    ids = random_ids(model.config, length=5)
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, attention_mask=mask)
    assert torch.equal(model.generate(ids, use_cache=True, **kwargs), model.generate(ids, use_cache=False, **kwargs))


@pytest.mark.slow
def test_save_reload_and_remote_code_give_equal_logits(tmp_path):
    model = build(scale_preset="unified", qk_norm=True, shared_expert_intermediate_size=8, mlp_only_layers=[0])
    randomize_scales(model)
    model.save_pretrained(tmp_path / "model")
    ids = random_ids(model.config)
    expected = logits(model, ids)
    reloaded = ScaleVecForCausalLM.from_pretrained(tmp_path / "model")
    torch.testing.assert_close(logits(reloaded, ids), expected, atol=0, rtol=0)
    save_file({"ids": ids}, tmp_path / "ids.safetensors")
    run_without_scalevec(
        """
        import sys, torch
        from safetensors.torch import load_file, save_file
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True).eval()
        with torch.no_grad():
            save_file({"logits": model(load_file(sys.argv[2])["ids"]).logits}, sys.argv[3])
        """,
        str(tmp_path / "model"),
        str(tmp_path / "ids.safetensors"),
        str(tmp_path / "out.safetensors"),
    )
    torch.testing.assert_close(load_file(tmp_path / "out.safetensors")["logits"], expected, atol=0, rtol=0)


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"num_experts_per_tok": 5}, r"`num_experts_per_tok` \(5\) cannot exceed `num_experts` \(4\)"),
        ({"moe_intermediate_size": 0}, r"`moe_intermediate_size` must be a positive integer"),
        ({"num_experts": -1}, r"`num_experts` must be 0 \(dense\) or positive"),
        ({"decoder_sparse_step": 0}, r"`decoder_sparse_step` must be a positive integer"),
        ({"mlp_only_layers": [2]}, r"`mlp_only_layers` holds \[2\], outside the layer indices 0..1"),
        ({"mlp_only_layers": [0, 1]}, r"select no MoE layer"),
        ({"decoder_sparse_step": 3}, r"select no MoE layer"),
        ({"shared_expert_intermediate_size": -4}, r"`shared_expert_intermediate_size` must be 0"),
    ],
)
def test_bad_moe_fields_raise(overrides, message):
    with pytest.raises(ValueError, match=message):
        ScaleVecConfig(**{**TINY_MOE, **overrides})


def test_roles_cover_expert_scales_as_input():
    model = build(scale_preset="unified", shared_expert_intermediate_size=8)
    roles = model.scale_vector_roles()
    names = set(roles["input"])
    layer = "model.layers.0.mlp."
    for site in (
        "experts.gate_up_in_scale",
        "experts.gate_up_out_scale",
        "experts.down_out_scale",
        "gate.in_scale",
        "gate.out_scale",
        "shared_expert.up_proj.out_scale",
        "shared_expert.down_proj.out_scale",
        "shared_expert_gate.in_scale",
    ):
        assert {f"{layer}{site}.magnitude", f"{layer}{site}.direction"} <= names, site
    # the experts' up rows scale what down's columns would: one vector, not two (see test_modeling)
    assert not any("down_in_scale" in n or "down_proj.in_scale" in n for n in names)
    assert not any(".mlp." in n for n in roles["output"])
    every_name = list(itertools.chain(*roles.values()))
    assert len(every_name) == len(set(every_name))


@pytest.mark.parametrize("preset", ["standard", "unified"])
def test_choices_of_another_processs_experts_add_nothing_under_expert_parallelism(preset, monkeypatch):
    """Expert parallelism (transformers' `MoEParamShard`) sets `num_experts` to this process's share and
    `_is_expert_parallel`, and gives the choices of other processes' experts ids past that share with weight 0.
    The grouped matmuls leave those rows uninitialised, here NaN: neither the output nor a gradient may see them,
    as in transformers' own experts."""
    monkeypatch.setattr(scaled_ops, "_use_grouped_mm", lambda *operands: False)  # the loop, whose output we poison
    allocate = scaled_ops._grouped_mm_shape
    monkeypatch.setattr(scaled_ops, "_grouped_mm_shape", lambda *operands: allocate(*operands).fill_(float("nan")))
    torch.manual_seed(0)
    model = ScaleVecForCausalLM(tiny_moe_config(scale_preset=preset, num_experts=2)).train()
    randomize_scales(model)
    experts = model.model.layers[0].mlp.experts
    hidden = torch.randn(6, experts.gate_up_proj.shape[-1], requires_grad=True)
    index = torch.tensor([[0, 2], [2, 1], [1, 0], [2, 3], [0, 1], [3, 2]])  # 2 and 3: another process's experts
    weights = torch.rand(6, 2).masked_fill(index >= 2, 0.0)
    experts._is_expert_parallel = True
    out = experts(hidden, index, weights)
    out.sum().backward()
    assert torch.isfinite(out).all() and torch.isfinite(hidden.grad).all()
    assert all(torch.isfinite(p.grad).all() for p in experts.parameters() if p.grad is not None)
    local = index.clamp(max=1)  # the same choices on this process's experts, with the others' weights still 0
    experts._is_expert_parallel = False
    monkeypatch.undo()
    torch.testing.assert_close(out, experts(hidden, local, weights), rtol=1e-6, atol=1e-6)
