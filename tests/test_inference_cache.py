"""Folded weights cached for inference: computed once when no gradient is recorded, never stale after an optimizer
step, `load_state_dict` or a dtype change, dropped when training resumes."""

import copy

import pytest
import torch

from scalevec import ScaleVecForCausalLM, scaled_ops

from ._helpers import logits, random_ids, randomize_scales, tiny_config, tiny_moe_config


def unified(moe: bool) -> ScaleVecForCausalLM:
    torch.manual_seed(0)
    config = tiny_moe_config(shared_expert_intermediate_size=8) if moe else tiny_config()
    model = ScaleVecForCausalLM(config).eval()
    randomize_scales(model)
    return model


@pytest.fixture
def folds(monkeypatch) -> list[tuple]:
    """The shape of every weight that a scale is folded into from here on, in a forward or cached for inference."""
    folded, fold_scales = [], scaled_ops.fold_scales

    def recorded(weight, in_scale, out_scale, dtype):
        if in_scale is not None or out_scale is not None:
            folded.append(tuple(weight.shape))
        return fold_scales(weight, in_scale, out_scale, dtype)

    monkeypatch.setattr(scaled_ops, "fold_scales", recorded)
    return folded


def with_grad_logits(model, ids) -> torch.Tensor:
    """The training path (folding on the fly), which records a gradient."""
    return model(ids).logits.detach()


@pytest.mark.parametrize("moe", [False, True])
def test_cached_inference_equals_the_training_path_and_generates_the_same_tokens(moe, folds):
    model = unified(moe)
    ids = random_ids(model.config)
    training = with_grad_logits(model, ids)
    torch.testing.assert_close(logits(model, ids), training, atol=1e-5, rtol=0)
    folds.clear()
    torch.testing.assert_close(logits(model, ids), training, atol=1e-5, rtol=0)
    assert folds == []  # every folded weight came from the cache

    prompt = ids[:, :4]
    cached = model.generate(prompt, max_new_tokens=8, do_sample=False)
    tokens, cache = prompt, None  # the same greedy decoding with every step on the training path
    for _ in range(8):
        step = model(tokens if cache is None else tokens[:, -1:], cache=cache, use_cache=True)
        cache = step.cache
        tokens = torch.cat([tokens, step.logits[:, -1:].argmax(-1)], dim=-1)
    assert torch.equal(cached, tokens)


@pytest.mark.parametrize("moe", [False, True])
def test_cache_follows_optimizer_steps_loaded_weights_and_dtype(moe):
    model = unified(moe)
    ids = random_ids(model.config)
    logits(model, ids)  # fills the cache

    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model(ids, labels=ids).loss.backward()
    optimizer.step()
    fresh = ScaleVecForCausalLM(model.config).eval()
    fresh.load_state_dict(model.state_dict())
    torch.testing.assert_close(logits(model, ids), logits(fresh, ids), atol=1e-5, rtol=0)

    other = unified(moe)
    with torch.no_grad():
        for parameter in other.parameters():
            parameter.mul_(1.1)
    model.load_state_dict(other.state_dict())
    torch.testing.assert_close(logits(model, ids), logits(other, ids), atol=1e-5, rtol=0)

    reference = copy.deepcopy(other).double()
    torch.testing.assert_close(logits(model.double(), ids), logits(reference, ids), atol=1e-10, rtol=0)


@pytest.mark.parametrize("moe", [False, True])
def test_decoding_steps_take_the_folded_weights_their_prefill_checked(moe):
    """The steps extending one KV cache take the folded weights its first forward checked (its keys and values were
    computed with them): a parameter edited in place in between is seen from the next prompt on. A loaded state dict
    or a training forward in between still gives the new weights."""
    model, edited = unified(moe), unified(moe)
    ids = random_ids(model.config)
    with torch.no_grad():
        edited.model.layers[-1].self_attn.o_proj.weight.mul_(3)
        cache = model(ids, use_cache=True).cache
        kv = copy.deepcopy(cache)
        before = unified(moe)(ids[:, -1:], cache=copy.deepcopy(cache), use_cache=True).logits
        model.model.layers[-1].self_attn.o_proj.weight.mul_(3)  # in place, between two steps of one cache
        step = model(ids[:, -1:], cache=cache, use_cache=True).logits  # as generate does: the same cache, extended
        torch.testing.assert_close(step, before, atol=1e-6, rtol=0)
        torch.testing.assert_close(logits(model, ids), logits(edited, ids), atol=1e-5, rtol=0)  # a new prompt
        assert (logits(edited, ids) - logits(unified(moe), ids)).abs().max() > 1e-3

        other = unified(moe)
        for parameter in other.parameters():
            parameter.mul_(1.1)
        cache = copy.deepcopy(kv)
        model(ids[:, -1:], cache=cache, use_cache=True)  # the folded weights are checked for this cache
        model.load_state_dict(other.state_dict())
        before = copy.deepcopy(cache)
        step = model(ids[:, -1:], cache=cache, use_cache=True).logits
        expected = other(ids[:, -1:], cache=before, use_cache=True).logits
    torch.testing.assert_close(step, expected, atol=1e-5, rtol=0)

    cache = copy.deepcopy(kv)
    with torch.no_grad():
        model(ids[:, -1:], cache=cache, use_cache=True)  # the folded weights are checked for this cache
    model(ids, labels=ids).loss.backward()  # a training forward drops every folded weight
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.add_(0.01)
        reference, extended = copy.deepcopy(model), copy.deepcopy(cache)
        step = model(ids[:, -1:], cache=cache, use_cache=True).logits
        expected = reference(ids[:, -1:], cache=extended, use_cache=True).logits
    torch.testing.assert_close(step, expected, atol=1e-5, rtol=0)


class Shift(torch.nn.Module):
    def __init__(self, shape):
        super().__init__()
        self.shift = torch.nn.Parameter(torch.zeros(shape))

    def forward(self, weight):
        return weight + self.shift


def test_cache_follows_a_parametrized_projection():
    """A parametrization keeps its parameters below the projection (`parametrizations.weight`): changing them in
    place must refold, as an adapter on the expert stacks must."""
    model = unified(moe=False)
    ids = random_ids(model.config)
    q_proj = model.model.layers[0].self_attn.q_proj
    torch.nn.utils.parametrize.register_parametrization(q_proj, "weight", Shift(q_proj.weight.shape))
    logits(model, ids)  # fills the cache
    with torch.no_grad():
        q_proj.parametrizations.weight[0].shift.fill_(0.05)
    torch.testing.assert_close(logits(model, ids), with_grad_logits(model, ids), atol=1e-5, rtol=0)
    assert (logits(model, ids) - logits(unified(moe=False), ids)).abs().max() > 1e-3


def test_training_drops_the_cache(folds):
    model = unified(moe=True)
    ids = random_ids(model.config)
    logits(model, ids)
    cached = list(folds)
    model.train()
    model(ids, labels=ids).loss.backward()
    folds.clear()
    logits(model.eval(), ids)
    assert folds == cached  # folded again, every weight
