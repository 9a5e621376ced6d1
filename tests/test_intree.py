"""ScaleVec behaves like an in-tree transformers decoder (as `LlamaForCausalLM` / `Qwen3MoeForCausalLM` do on the
same calls): the legacy `past_key_values` name, router losses only where used and with every mask form, the dense
output contract, experts implementations, and the task heads, loaded with `trust_remote_code` where `scalevec`
cannot be imported."""

import warnings

import pytest
import torch
from transformers import (
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.integrations.moe import ExpertsInterface
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

from scalevec import ScaleVecConfig, ScaleVecForCausalLM, ScaleVecModel

from ._helpers import (
    STOCK_TINY,
    logits,
    random_ids,
    randomize_scales,
    run_without_scalevec,
    tiny_config,
    tiny_moe_config,
)


def model_of(moe: bool, **overrides) -> ScaleVecForCausalLM:
    torch.manual_seed(0)
    config = tiny_moe_config(**overrides) if moe else tiny_config(**overrides)
    model = ScaleVecForCausalLM(config).eval()
    randomize_scales(model)
    return model


@pytest.mark.parametrize("moe", [False, True])
def test_past_key_values_is_the_deprecated_name_of_cache(moe):
    model = model_of(moe)
    ids = random_ids(model.config)
    full = logits(model, ids)[:, -1]
    with torch.no_grad():
        prefix = model(ids[:, :-1], use_cache=True)
        with pytest.warns(FutureWarning, match="past_key_values"):
            step = model(ids[:, -1:], past_key_values=prefix.cache)
        with pytest.warns(FutureWarning, match="past_key_values"):
            hidden = model.model(ids[:, -1:], past_key_values=model(ids[:, :-1], use_cache=True).cache)
    torch.testing.assert_close(step.logits[:, -1], full, atol=1e-5, rtol=0)
    torch.testing.assert_close(model.lm_head(hidden.last_hidden_state[:, -1]), full, atol=1e-5, rtol=0)


def four_d(mask: torch.Tensor, additive: bool) -> torch.Tensor:
    """The causal 4-D mask of a 2-D padding mask, as transformers builds it: boolean, or additive float."""
    length = mask.shape[1]
    allowed = torch.ones(length, length, dtype=torch.bool).tril()[None, None] & mask.bool()[:, None, None, :]
    return allowed if not additive else torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo().min)


@pytest.mark.parametrize("additive", [False, True])
def test_moe_router_losses_take_4d_masks(additive):
    model = model_of(moe=True, router_z_loss_coef=0.01)
    ids = random_ids(model.config)
    mask = torch.ones_like(ids)
    mask[0, -3:] = 0  # right padding: a 4-D mask still lets those queries see earlier tokens
    labels = ids.masked_fill(mask == 0, -100)
    with torch.no_grad():
        flat = model(ids, attention_mask=mask, labels=labels)
        full = model(ids, attention_mask=four_d(mask, additive), labels=labels)
    real = mask.bool()
    torch.testing.assert_close(full.logits[real], flat.logits[real], atol=1e-5, rtol=0)
    torch.testing.assert_close(full.aux_loss, flat.aux_loss, atol=1e-6, rtol=0)
    torch.testing.assert_close(full.loss, flat.loss, atol=1e-6, rtol=0)


def test_moe_router_losses_follow_the_flag_else_the_config():
    model = model_of(moe=True)
    ids = random_ids(model.config)
    assert model.config.output_router_logits  # on by default, so that training balances the experts
    with torch.no_grad():
        inference, training = model(ids), model(ids, labels=ids)
        off = model(ids, labels=ids, output_router_logits=False)
    assert len(inference.router_logits) == len(training.router_logits) == model.config.num_hidden_layers
    torch.testing.assert_close(inference.aux_loss, training.aux_loss)
    assert off.aux_loss is None and off.router_logits is None
    torch.testing.assert_close(training.loss, off.loss + model.config.router_aux_loss_coef * training.aux_loss)

    model.config.output_router_logits = False
    with torch.no_grad():
        assert model(ids, labels=ids).aux_loss is None
        torch.testing.assert_close(model(ids, output_router_logits=True).aux_loss, training.aux_loss)


def test_moe_generate_skips_the_router_losses(monkeypatch):
    from scalevec import modeling_scalevec

    model = model_of(moe=True)
    assert model.config.output_router_logits
    computed = []
    balancing_loss = modeling_scalevec.load_balancing_loss_func
    monkeypatch.setattr(
        modeling_scalevec, "load_balancing_loss_func", lambda *args: computed.append(1) or balancing_loss(*args)
    )
    prompt = random_ids(model.config, length=5)
    tokens = model.generate(prompt, max_new_tokens=4, do_sample=False)
    assert computed == []
    model.generate(prompt, max_new_tokens=4, do_sample=False, output_router_logits=True)
    assert len(computed) == 4  # asked for: one per forward
    assert torch.equal(model.generate(prompt, max_new_tokens=4, do_sample=False), tokens)


def test_moe_generate_with_a_static_cache_equals_the_dynamic_cache():
    model = model_of(moe=True)
    prompt = random_ids(model.config, length=5)
    options = dict(max_new_tokens=6, do_sample=False)
    dynamic = model.generate(prompt, **options)
    static = model.generate(prompt, cache_implementation="static", **options)
    assert torch.equal(static, dynamic)


def test_dense_outputs_are_dense_and_router_flags_are_refused():
    model = model_of(moe=False)
    ids = random_ids(model.config)
    output = model(ids, labels=ids)
    assert type(output) is CausalLMOutputWithPast and type(model.model(ids)) is BaseModelOutputWithPast
    assert not hasattr(output, "router_logits") and not hasattr(output, "aux_loss")
    for forward in (model, model.model):
        with pytest.raises(ValueError, match="output_router_logits.*mixture-of-experts"):
            forward(ids, output_router_logits=True)
    with pytest.raises(ValueError, match="output_router_logits=True.*num_experts=0"):
        tiny_config(output_router_logits=True)
    moe = model_of(moe=True)
    assert type(moe(ids)).__name__ == "MoeCausalLMOutputWithPast"
    assert type(moe.model(ids)).__name__ == "MoeModelOutputWithPast"


def test_experts_implementations_fold_the_scales_alike(tmp_path):
    model = model_of(moe=True, shared_expert_intermediate_size=8, output_norm=True)
    model.train()
    ids = random_ids(model.config)
    assert model.config._experts_implementation == "eager"  # ScaleVec's own forward stays the default

    def loss_and_gradients():
        model.zero_grad()
        loss = model(ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    reference_loss, reference_grads = loss_and_gradients()
    for implementation in ("grouped_mm", "batched_mm"):
        model.set_experts_implementation(implementation)
        assert model.config._experts_implementation == implementation
        loss, grads = loss_and_gradients()
        torch.testing.assert_close(loss, reference_loss, atol=1e-5, rtol=0)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, reference_grads[name], atol=1e-5, rtol=1e-4, msg=name)
    with pytest.raises(ValueError, match="experts_implementation"):
        model.set_experts_implementation("sonicmoe")

    model.save_pretrained(tmp_path)
    loaded = ScaleVecForCausalLM.from_pretrained(tmp_path, experts_implementation="batched_mm").eval()
    assert loaded.config._experts_implementation == "batched_mm"
    torch.testing.assert_close(logits(loaded, ids), logits(model.eval(), ids), atol=1e-5, rtol=0)


@pytest.mark.parametrize("implementation", ["grouped_mm", "batched_mm"])
def test_an_experts_function_registered_later_is_called_as_by_qwen3_moe(implementation, monkeypatch):
    """Kernels and transformers' own tests register their function under a name after the model code is imported:
    the experts look it up at every call."""
    torch.manual_seed(0)
    models = {
        "qwen3_moe": Qwen3MoeForCausalLM(Qwen3MoeConfig(**STOCK_TINY["qwen3_moe"])).eval(),
        "scalevec": model_of(moe=True),
    }
    ids = random_ids(models["scalevec"].config)
    expected = {}
    for name, model in models.items():
        model.set_experts_implementation(implementation)
        expected[name] = logits(model, ids)
    calls, registered = [], ExpertsInterface._global_mapping[implementation]

    def replacement(experts, *args):
        calls.append(experts.num_experts)
        return registered(experts, *args)

    monkeypatch.setitem(ExpertsInterface._global_mapping, implementation, replacement)
    for name, model in models.items():
        calls.clear()
        torch.testing.assert_close(logits(model, ids), expected[name], atol=1e-6, rtol=0)
        assert calls == [4] * model.config.num_hidden_layers, name


HEADS = {
    "AutoModelForSequenceClassification": AutoModelForSequenceClassification,
    "AutoModelForTokenClassification": AutoModelForTokenClassification,
    "AutoModelForQuestionAnswering": AutoModelForQuestionAnswering,
}


def head_inputs(name: str, ids: torch.Tensor) -> dict:
    if name == "AutoModelForSequenceClassification":
        return dict(labels=torch.tensor([0, 2]))
    if name == "AutoModelForTokenClassification":
        return dict(labels=ids % 3)
    return dict(start_positions=torch.tensor([1, 2]), end_positions=torch.tensor([3, 4]))


@pytest.mark.parametrize("moe", [False, True])
def test_task_heads_train_and_load_with_remote_code_where_scalevec_is_absent(moe, tmp_path):
    config = (tiny_moe_config if moe else tiny_config)(num_labels=3, pad_token_id=0)
    ids = random_ids(config, length=7).clamp(min=1)
    expected = {}
    for name, auto_class in HEADS.items():
        torch.manual_seed(0)
        head = auto_class.from_config(config)
        assert type(head).__name__ == name.replace("AutoModel", "ScaleVec") and isinstance(head.model, ScaleVecModel)
        optimizer = torch.optim.AdamW(head.parameters(), lr=1e-2)
        first = head(ids, **head_inputs(name, ids)).loss
        first.backward()
        optimizer.step()
        assert torch.isfinite(first) and head(ids, **head_inputs(name, ids)).loss < first
        head.eval().save_pretrained(tmp_path / name)
        with torch.no_grad():
            expected[name] = head(ids)[0]
    torch.save(ids, tmp_path / "ids.pt")
    script = """
        import sys, torch, transformers
        folder = sys.argv[1]
        ids = torch.load(folder + "/ids.pt", weights_only=True)
        for name in sys.argv[2:]:
            model = getattr(transformers, name).from_pretrained(folder + "/" + name, trust_remote_code=True).eval()
            assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
            with torch.no_grad():
                torch.save(model(ids)[0], folder + "/" + name + ".pt")
    """
    run_without_scalevec(script, str(tmp_path), *HEADS, env={"HF_HOME": str(tmp_path / "hf_home")})
    for name, output in expected.items():
        torch.testing.assert_close(torch.load(tmp_path / f"{name}.pt", weights_only=True), output, atol=1e-5, rtol=0)


def test_heads_are_in_the_saved_auto_map(tmp_path):
    ScaleVecForCausalLM(tiny_config()).save_pretrained(tmp_path)
    auto_map = ScaleVecConfig.from_pretrained(tmp_path).auto_map
    assert set(HEADS) | {"AutoConfig", "AutoModel", "AutoModelForCausalLM"} == set(auto_map)


def test_no_warning_on_the_current_names():
    model = model_of(moe=True)
    ids = random_ids(model.config)
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        model(ids[:, :-1], use_cache=True)
