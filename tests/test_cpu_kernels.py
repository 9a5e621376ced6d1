"""The opt-in fused CPU kernels (SCALEVEC_CPU_KERNELS=1) against the eager passes they replace."""

import shutil
import warnings

import pytest
import torch

from scalevec import ScaleVecForCausalLM, cpu_kernels
from scalevec import modeling_scalevec as modeling

from ._helpers import gradients, random_ids, randomize_scales, tiny_config, tiny_moe_config

pytestmark = pytest.mark.skipif(shutil.which("c++") is None, reason="the kernels are built with a C++ compiler")

# (weight shape, in_scale shape, out_scale shape): a dense map and a gate_up expert stack (E, 2, I, H) with both
# scales, which the kernels take; a down stack with a row scale only and a map with a column scale only, which they
# leave to the eager passes
BOTH_SCALES = [((24, 40), (40,), (24,)), ((3, 2, 8, 16), (3, 2, 16), (3, 2, 8))]
ONE_SCALE = [((3, 16, 8), None, (3, 16)), ((24, 40), (40,), None)]


def operands(weight_shape, in_shape, out_shape, seed=0):
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn(weight_shape, generator=generator)
    in_scale = None if in_shape is None else 0.5 + torch.rand(in_shape, generator=generator)
    out_scale = None if out_shape is None else 0.5 + torch.rand(out_shape, generator=generator)
    return weight, in_scale, out_scale


@pytest.fixture
def kernels_on(monkeypatch):
    monkeypatch.setenv("SCALEVEC_CPU_KERNELS", "1")
    assert cpu_kernels.load() is not None


def test_kernels_are_off_unless_asked(monkeypatch):
    monkeypatch.delenv("SCALEVEC_CPU_KERNELS", raising=False)
    assert modeling._cpu_kernels(torch.ones(2, 2)) is None


@pytest.mark.parametrize("weight_shape, in_shape, out_shape", BOTH_SCALES)
def test_fold_and_backward_equal_the_eager_passes(kernels_on, weight_shape, in_shape, out_shape):
    weight, in_scale, out_scale = operands(weight_shape, in_shape, out_shape)
    grad = torch.randn(weight_shape, generator=torch.Generator().manual_seed(1))
    eager_folded = modeling._folded(weight, in_scale, out_scale)
    eager_grads = modeling._scale_grads(grad.clone(), weight, in_scale, out_scale)
    assert modeling._cpu_kernels(weight, in_scale, out_scale) is not None
    torch.testing.assert_close(modeling._effective_weight(weight, in_scale, out_scale, torch.float32), eager_folded)
    folded, grads = modeling._refold_and_scale_grads(
        grad.clone(), weight, in_scale, out_scale, torch.float32, refold=True
    )
    torch.testing.assert_close(folded, eager_folded)
    for actual, expected in zip(grads, eager_grads):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weight_shape, in_shape, out_shape", ONE_SCALE)
def test_maps_with_one_scale_take_the_eager_passes(kernels_on, monkeypatch, weight_shape, in_shape, out_shape):
    weight, in_scale, out_scale = operands(weight_shape, in_shape, out_shape)
    grad = torch.randn(weight_shape, generator=torch.Generator().manual_seed(1))
    asked = []
    monkeypatch.setattr(modeling, "_cpu_kernels", lambda *tensors: asked.append(tensors))
    folded, grads = modeling._refold_and_scale_grads(
        grad.clone(), weight, in_scale, out_scale, torch.float32, refold=True
    )
    assert not asked
    torch.testing.assert_close(folded, modeling._folded(weight, in_scale, out_scale))
    for actual, expected in zip(grads, modeling._scale_grads(grad.clone(), weight, in_scale, out_scale)):
        assert (actual is None) == (expected is None)
        if expected is not None:
            torch.testing.assert_close(actual, expected)


@pytest.mark.parametrize("config", [tiny_config, tiny_moe_config], ids=["dense", "moe"])
def test_a_training_step_with_the_kernels_has_the_eager_gradients(config, monkeypatch):
    torch.manual_seed(0)
    model = ScaleVecForCausalLM(config(scale_preset="unified")).train()
    randomize_scales(model)
    ids = random_ids(model.config)
    monkeypatch.delenv("SCALEVEC_CPU_KERNELS", raising=False)
    eager = gradients(model, ids)
    monkeypatch.setenv("SCALEVEC_CPU_KERNELS", "1")
    calls, real = [], modeling._cpu_kernels

    def counted(*tensors):
        calls.append(real(*tensors))
        return calls[-1]

    monkeypatch.setattr(modeling, "_cpu_kernels", counted)
    fused = gradients(model, ids)
    assert calls and all(kernels is not None for kernels in calls)
    for name, grad in eager.items():
        torch.testing.assert_close(fused[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_bf16_runs_the_eager_path(kernels_on):
    weight, in_scale, out_scale = operands((8, 4), (4,), (8,))
    assert modeling._cpu_kernels(weight.bfloat16(), in_scale, out_scale) is None
    assert modeling._cpu_kernels(weight.t(), in_scale, out_scale) is None  # not contiguous


def test_a_failed_build_warns_and_falls_back(monkeypatch):
    import torch.utils.cpp_extension

    def no_compiler(**kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch.utils.cpp_extension, "load_inline", no_compiler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cpu_kernels.load.__wrapped__() is None
    assert any("no C++ compiler" in str(w.message) for w in caught)
