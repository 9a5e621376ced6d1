"""torch.compile: decoder layers trace into one graph, the whole model compiles with `fullgraph=True` (forward and
backward, fp32 and bf16) with eager's gradients, `generate` auto-compiles with a static cache into one graph that no
decoding step recompiles, from ids or from embeddings (as Llama's), and `scalevec-train --torch-compile` runs dense
and MoE models."""

import math

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM

from scalevec import ScaleVecForCausalLM
from scalevec.train.cli import main

from ._helpers import TINY, logged_losses, random_ids, tiny_config, tiny_moe_config, train_argv

pytestmark = pytest.mark.slow  # inductor's C++ compiler

KINDS = ["dense", "moe"]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def tiny_model(kind: str) -> ScaleVecForCausalLM:
    torch.manual_seed(0)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**TINY))
    return ScaleVecForCausalLM(
        tiny_config() if kind == "dense" else tiny_moe_config(shared_expert_intermediate_size=8)
    )


def loss_and_grads(model: ScaleVecForCausalLM, call, ids: torch.Tensor) -> tuple[torch.Tensor, dict]:
    model.zero_grad()
    loss = call(ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decoder_layer_is_one_graph(kind, dtype):
    model = tiny_model(kind).to(dtype)
    layer = model.model.layers[0]
    hidden = torch.randn(2, 9, model.config.hidden_size, dtype=dtype)
    position_embeddings = model.model.rotary_emb(hidden, torch.arange(9)[None])
    explanation = torch._dynamo.explain(layer)(hidden, position_embeddings=position_embeddings)
    assert (explanation.graph_count, explanation.graph_break_count) == (1, 0), explanation.break_reasons
    assert explanation.op_count > 20  # the layer really was traced, not skipped


def test_moe_compiles_fullgraph_with_eager_gradients_fp32():
    """Inductor, fp32: the grouped GEMM runs as an opaque loop operator (torch's grouped GEMM traces bf16 only)."""
    model = tiny_model("moe")
    ids = random_ids(model.config, batch=3, length=11)
    eager_loss, eager_grads = loss_and_grads(model, model, ids)
    compiled_loss, compiled_grads = loss_and_grads(model, torch.compile(model, fullgraph=True), ids)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=0, atol=1e-5)
    assert eager_grads.keys() == compiled_grads.keys()
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=0, atol=1e-5, msg=name)
    assert all(grad.abs().max() > 0 for grad in eager_grads.values())


def test_moe_compiles_fullgraph_in_bf16():
    """bf16 traces torch's grouped GEMM itself; the backend is `aot_eager` (the fake kernels and the joint forward
    and backward graph are what failed; CPU inductor codegen for bf16 takes half a minute)."""
    model = tiny_model("moe").to(torch.bfloat16)
    ids = random_ids(model.config, batch=3, length=11)
    eager_loss, eager_grads = loss_and_grads(model, model, ids)
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    compiled_loss, compiled_grads = loss_and_grads(model, compiled, ids)
    assert counters["stats"]["unique_graphs"] == 1
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=0, atol=1e-2)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(compiled_grads[name], grad, rtol=2e-2, atol=2e-3, msg=name)


@pytest.mark.parametrize("kind", ["llama", *KINDS])
def test_generate_auto_compiles_with_a_static_cache_without_recompiling(kind):
    """The prefill runs eager and caches the folded weights; the compiled decoding steps must leave that cache alone
    (a guard on it would fail at the next step and recompile)."""
    model = tiny_model(kind).eval()
    assert model._can_compile_fullgraph
    ids = random_ids(model.config, batch=2, length=6)
    options = dict(max_new_tokens=5, do_sample=False, cache_implementation="static")
    expected = model.generate(ids, **options)
    config = CompileConfig(fullgraph=True, backend="aot_eager", mode=None)
    config._compile_all_devices = True  # auto-compile is for accelerators unless asked
    generated = model.generate(ids, compile_config=config, **options)
    with torch.no_grad():  # a prompt given as embeddings: an eager prefill, then the same compiled steps
        from_embeds = model.generate(inputs_embeds=model.get_input_embeddings()(ids), compile_config=config, **options)
    assert hasattr(model, "_compiled_call")
    assert counters["stats"]["unique_graphs"] == 1 and not counters["recompiles"]
    torch.testing.assert_close(generated, expected, rtol=0, atol=0)
    torch.testing.assert_close(from_embeds, expected[:, ids.shape[1] :], rtol=0, atol=0)


@pytest.mark.parametrize("size", ["tiny", "tiny-moe"])
def test_train_cli_with_torch_compile(size, tmp_path):
    flags = [
        "--model-size",
        size,
        "--torch-compile-backend",
        "aot_eager",
        "--eval-every",
        "0",
        "--scale-stats",
        "false",
    ]
    assert main(train_argv(tmp_path, *flags, steps=3)) == 0
    # one graph: the Trainer compiled the model, and nothing (router-logit recording included) breaks it
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    losses = logged_losses(tmp_path)
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
