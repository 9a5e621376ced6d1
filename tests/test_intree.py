"""ScaleVec behaves like an in-tree transformers decoder (as `LlamaForCausalLM` / `Qwen3MoeForCausalLM` do on the
same calls): the legacy `past_key_values` name, plain MoE forwards unless router outputs are asked for, router losses
with every mask form, router flags taken and ignored by dense models on every head, `generate` from `inputs_embeds`,
experts implementations, and the task heads, loaded with `trust_remote_code` where `scalevec` cannot be imported."""

import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers
from transformers import (
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    LlamaConfig,
    LlamaForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)
from transformers.integrations.moe import ExpertsInterface
from transformers.modeling_outputs import (
    BaseModelOutputWithPast,
    CausalLMOutputWithPast,
    MoeCausalLMOutputWithPast,
    MoeModelOutputWithPast,
)

import scalevec
from scalevec import ScaleVecConfig, ScaleVecForCausalLM, ScaleVecModel

from ._helpers import (
    STOCK_TINY,
    TINY,
    logits,
    random_ids,
    randomize_scales,
    run_without_scalevec,
    tiny_config,
    tiny_moe_config,
)

HEADS = {
    "AutoModelForSequenceClassification": AutoModelForSequenceClassification,
    "AutoModelForTokenClassification": AutoModelForTokenClassification,
    "AutoModelForQuestionAnswering": AutoModelForQuestionAnswering,
}


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
    model = model_of(moe=True, router_z_loss_coef=0.01, output_router_logits=True)
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


def qwen3_moe(**overrides) -> Qwen3MoeForCausalLM:
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**STOCK_TINY["qwen3_moe"], **overrides)).eval()


def test_moe_forwards_are_plain_unless_asked_as_qwen3_moe():
    """`output_router_logits` is off by default: `model(ids)[0]` and tuples start with the logits and the loss is
    the language-modelling loss; the flag, else the config, adds the router logits and the balancing loss."""
    models = {"qwen3_moe": qwen3_moe(), "scalevec": model_of(moe=True)}
    ids = random_ids(models["scalevec"].config)
    layouts = {}
    for name, model in models.items():
        assert model.config.output_router_logits is False, name
        with torch.no_grad():
            plain, asked = model(ids, labels=ids), model(ids, labels=ids, output_router_logits=True)
            first, as_tuple = model(ids)[0], model(ids, return_dict=False)
        assert plain.aux_loss is None and plain.router_logits is None, name
        lm_loss = F.cross_entropy(plain.logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
        torch.testing.assert_close(plain.loss, lm_loss, atol=1e-6, rtol=0)
        assert torch.equal(first, plain.logits) and torch.equal(as_tuple[0], plain.logits), name
        assert len(asked.router_logits) == model.config.num_hidden_layers, name
        balanced = plain.loss + model.config.router_aux_loss_coef * asked.aux_loss
        torch.testing.assert_close(asked.loss, balanced, atol=1e-6, rtol=0)
        model.config.output_router_logits = True  # as in a checkpoint saved with the flag on
        with torch.no_grad():
            torch.testing.assert_close(model(ids)[0], asked.aux_loss)  # the balancing loss comes first, as asked
            assert model(ids, output_router_logits=False).aux_loss is None
        layouts[name] = [type(part).__name__ for part in as_tuple]
    assert layouts["scalevec"] == layouts["qwen3_moe"] == ["Tensor", "DynamicCache"]


def test_moe_generate_skips_the_router_losses(monkeypatch):
    from scalevec import modeling_scalevec

    model = model_of(moe=True, output_router_logits=True)  # as in a checkpoint saved with the flag on
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


@pytest.mark.parametrize("head", ["Model", "ForCausalLM", *(name.removeprefix("AutoModel") for name in HEADS)])
def test_dense_models_take_the_router_flag_and_return_no_router_outputs_as_llama(head):
    """transformers' output-capturing test passes `output_router_logits=True` to every class whose
    `_can_record_outputs` lists router logits (ScaleVec's do, for its MoE models): Llama ignores an output flag it
    has nothing for, and a dense ScaleVec does too, on every head, from the argument or from the config."""
    fields = dict(TINY, num_labels=3, pad_token_id=0)
    ids = random_ids(ScaleVecConfig(**fields), length=7).clamp(min=1)
    flags = dict(output_hidden_states=True, output_attentions=True)
    layouts = {}
    for name, library, config_class in (("Llama", transformers, LlamaConfig), ("ScaleVec", scalevec, ScaleVecConfig)):
        torch.manual_seed(0)
        model = getattr(library, name + head)(config_class(**fields, attn_implementation="eager")).eval()
        with torch.no_grad():
            plain, asked = model(ids, **flags), model(ids, output_router_logits=True, **flags)
            model.config.output_router_logits = True
            from_config = model(ids, return_dict=False, **flags)
        assert type(asked) is type(plain) and list(asked.keys()) == list(plain.keys()), name
        assert not hasattr(asked, "router_logits") and not hasattr(asked, "aux_loss"), name
        torch.testing.assert_close(asked[0], plain[0], atol=0, rtol=0)
        assert len(from_config) == len(plain.to_tuple()), name
        layouts[name] = type(plain).__name__, list(plain.keys())
    assert layouts["ScaleVec"] == layouts["Llama"]
    with pytest.raises(ValueError, match="output_router_logits=True.*num_experts=0"):
        tiny_config(output_router_logits=True)  # a dense config asked to balance experts it lacks


def test_dense_and_moe_output_types_are_llamas_and_qwen3_moes():
    dense, moe = model_of(moe=False), model_of(moe=True)
    ids = random_ids(dense.config)
    assert type(dense(ids, labels=ids)) is CausalLMOutputWithPast and type(dense.model(ids)) is BaseModelOutputWithPast
    assert type(moe(ids)) is MoeCausalLMOutputWithPast and type(moe.model(ids)) is MoeModelOutputWithPast


GENERATORS = {
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**TINY)),
    "dense": lambda: model_of(moe=False),
    "qwen3_moe": qwen3_moe,
    "moe": lambda: model_of(moe=True),
}


@pytest.mark.parametrize("kind", GENERATORS)
def test_generate_from_inputs_embeds_gives_what_input_ids_give(kind):
    """As transformers' `test_generate_from_inputs_embeds` and `test_generate_continue_from_inputs_embeds`: the
    tokens generated from a prompt's embeddings are those generated from its ids, greedy and sampled (same seed),
    with the dynamic and the static cache, and continuing from embeddings with the cache of an earlier call; given
    both, the embeddings are what the model reads."""
    torch.manual_seed(0)
    model = GENERATORS[kind]().eval()
    prompt = random_ids(model.config, length=5)
    with torch.no_grad():
        embeds = model.get_input_embeddings()(prompt)
    for options in (dict(do_sample=False), dict(do_sample=False, cache_implementation="static"), dict(do_sample=True)):
        torch.manual_seed(1)
        from_ids = model.generate(prompt, max_new_tokens=4, **options)
        torch.manual_seed(1)
        from_embeds = model.generate(inputs_embeds=embeds, max_new_tokens=4, **options)
        assert torch.equal(from_embeds, from_ids[:, prompt.shape[1] :]), options
    from_both = model.generate(prompt, inputs_embeds=embeds, max_new_tokens=4, do_sample=False)
    other = model.generate(prompt, inputs_embeds=torch.randn_like(embeds), max_new_tokens=4, do_sample=False)
    assert torch.equal(from_both, model.generate(prompt, max_new_tokens=4, do_sample=False))
    assert not torch.equal(other, from_both)

    greedy = dict(do_sample=False, return_dict_in_generate=True)
    whole = model.generate(inputs_embeds=embeds, max_new_tokens=4, **greedy).sequences
    first = model.generate(inputs_embeds=embeds, max_new_tokens=3, **greedy)
    with torch.no_grad():
        continued = torch.cat([embeds, model.get_input_embeddings()(first.sequences)], dim=1)
    last = model.generate(inputs_embeds=continued, cache=first.cache, max_new_tokens=1, **greedy).sequences
    assert torch.equal(torch.cat([first.sequences, last], dim=1), whole)


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


def head_inputs(name: str, ids: torch.Tensor) -> dict:
    if name == "AutoModelForSequenceClassification":
        return dict(labels=torch.tensor([0, 2]))
    if name == "AutoModelForTokenClassification":
        return dict(labels=ids % 3)
    return dict(start_positions=torch.tensor([1, 2]), end_positions=torch.tensor([3, 4]))


@pytest.mark.parametrize("moe", [False, True])
@pytest.mark.slow
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
