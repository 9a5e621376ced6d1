"""The opt-in fused CPU kernels (SCALEVEC_CPU_KERNELS=1) against the eager passes they replace."""

import shutil
import warnings

import pytest
import torch

from scalevec import ScaleVecForCausalLM, cpu_kernels, scaled_ops
from scalevec.modeling_scalevec import fold

from ._helpers import gradients, random_ids, randomize_scales, tiny_config, tiny_moe_config

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("c++") is None, reason="the kernels are built with a C++ compiler"),
]  # the kernels' C++ build

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
    grad = torch.randn(weight_shape, generator=generator)
    return weight, in_scale, out_scale, grad


@pytest.fixture
def kernel_calls(monkeypatch) -> list[str]:
    """The names of the kernels called from here on, with the kernels asked for (SCALEVEC_CPU_KERNELS=1)."""
    kernels = cpu_kernels.load()
    assert kernels is not None
    monkeypatch.setenv("SCALEVEC_CPU_KERNELS", "1")
    calls = []
    for name in ("fold", "fold_backward"):
        kernel = getattr(kernels, name)
        monkeypatch.setattr(kernels, name, lambda *args, kernel=kernel, name=name: calls.append(name) or kernel(*args))
    return calls


def fold_and_backward(weight, in_scale, out_scale, grad):
    folded = scaled_ops.fold_scales(weight, in_scale, out_scale, torch.float32)
    refolded, grads = scaled_ops.fold_backward(grad.clone(), weight, in_scale, out_scale, torch.float32, refold=True)
    return folded, refolded, grads


def test_kernels_are_off_unless_asked(kernel_calls, monkeypatch):
    monkeypatch.delenv("SCALEVEC_CPU_KERNELS")
    fold_and_backward(*operands(*BOTH_SCALES[0]))
    assert kernel_calls == []


@pytest.mark.parametrize("weight_shape, in_shape, out_shape", BOTH_SCALES)
def test_fold_and_backward_equal_the_eager_passes(kernel_calls, monkeypatch, weight_shape, in_shape, out_shape):
    weight, in_scale, out_scale, grad = operands(weight_shape, in_shape, out_shape)
    monkeypatch.setenv("SCALEVEC_CPU_KERNELS", "0")
    eager_folded, _, eager_grads = fold_and_backward(weight, in_scale, out_scale, grad)
    monkeypatch.setenv("SCALEVEC_CPU_KERNELS", "1")
    folded, refolded, grads = fold_and_backward(weight, in_scale, out_scale, grad)
    assert kernel_calls == ["fold", "fold_backward"]
    torch.testing.assert_close(eager_folded, fold(weight, in_scale, out_scale))  # the model file's reference
    torch.testing.assert_close(folded, eager_folded)
    torch.testing.assert_close(refolded, eager_folded)
    for actual, expected in zip(grads, eager_grads):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("weight_shape, in_shape, out_shape", ONE_SCALE)
def test_maps_with_one_scale_take_the_eager_passes(kernel_calls, weight_shape, in_shape, out_shape):
    weight, in_scale, out_scale, grad = operands(weight_shape, in_shape, out_shape)
    folded, refolded, grads = fold_and_backward(weight, in_scale, out_scale, grad)
    assert kernel_calls == []
    torch.testing.assert_close(folded, fold(weight, in_scale, out_scale))
    torch.testing.assert_close(refolded, folded)
    assert (grads[1] is None, grads[2] is None) == (in_scale is None, out_scale is None)


@pytest.mark.parametrize("config", [tiny_config, tiny_moe_config], ids=["dense", "moe"])
def test_a_training_step_with_the_kernels_has_the_eager_gradients(config, kernel_calls, monkeypatch):
    torch.manual_seed(0)
    model = ScaleVecForCausalLM(config(scale_preset="unified")).train()
    randomize_scales(model)
    ids = random_ids(model.config)
    monkeypatch.setenv("SCALEVEC_CPU_KERNELS", "0")
    eager = gradients(model, ids)
    assert kernel_calls == []
    monkeypatch.setenv("SCALEVEC_CPU_KERNELS", "1")
    fused = gradients(model, ids)
    assert "fold" in kernel_calls and "fold_backward" in kernel_calls
    for name, grad in eager.items():
        torch.testing.assert_close(fused[name], grad, rtol=1e-5, atol=1e-6, msg=name)


def test_bf16_and_strided_weights_take_the_eager_passes(kernel_calls):
    weight, in_scale, out_scale, _ = operands((8, 4), (4,), (8,))
    scaled_ops.fold_scales(weight.bfloat16(), in_scale, out_scale, torch.bfloat16)
    scaled_ops.fold_scales(weight.t().contiguous().t(), in_scale, out_scale, torch.float32)
    assert kernel_calls == []


def test_a_failed_build_warns_and_falls_back(monkeypatch):
    import torch.utils.cpp_extension

    def no_compiler(**kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch.utils.cpp_extension, "load_inline", no_compiler)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cpu_kernels.load.__wrapped__() is None
    assert any("no C++ compiler" in str(w.message) for w in caught)
