"""Fused CPU kernels for the scaled matmul, opt-in with `SCALEVEC_CPU_KERNELS=1`.

Folding the scales into a weight on the fly is memory-bound, and eager PyTorch combines two tensors per op: the fold
`diag(b) W diag(a)` costs four weight-sized memory streams, and the backward's refold, scale gradients and rescaled
weight gradient thirteen. These kernels make one pass each, two and four streams: `fold` writes the folded weight,
`fold_backward` reads W and the folded-weight gradient G once, writes the refolded weight, rescales G in place into
W's gradient and returns both scale gradients.

Built on first use with the system's C++ compiler and ninja (`torch.utils.cpp_extension.load_inline`, cached under
`TORCH_EXTENSIONS_DIR`), as DeepSpeed builds its CPU Adam; they run on PyTorch's own intra-op threads. Where they
cannot be built a warning says so and the eager path runs. `scaled_ops.py` calls them for fp32, contiguous CPU tensors
of maps with both scales; the weight viewed as (B, out, in), the scales as (B, in) and (B, out). Inside a training
step they pay off where the weights are large (MoE expert stacks) and not on small dense maps, whose cost there is
reading the weight cold, not the sweeps (benchmarks/RESULTS.md has the measurements).
"""

import functools
import warnings
from types import ModuleType

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <vector>

// Rows of (B, out, in) split over PyTorch's intra-op threads: at::parallel_for, compiled with -fopenmp so that it
// runs in parallel (the loader gives this module the libgomp.so.1 that torch has loaded: one OpenMP runtime).
constexpr int64_t kGrain = 16;

torch::Tensor fold(torch::Tensor weight, torch::Tensor in_scale, torch::Tensor out_scale) {
  const int64_t B = weight.size(0), O = weight.size(1), I = weight.size(2);
  auto folded = torch::empty_like(weight);
  const float *w = weight.data_ptr<float>(), *a = in_scale.data_ptr<float>(), *b = out_scale.data_ptr<float>();
  float *f = folded.data_ptr<float>();
  at::parallel_for(0, B * O, kGrain, [&](int64_t begin, int64_t end) {
    for (int64_t row = begin; row < end; ++row) {
      const float bi = b[row];
      const float *wr = w + row * I, *ak = a + (row / O) * I;
      float *fr = f + row * I;
      #pragma omp simd
      for (int64_t j = 0; j < I; ++j) fr[j] = bi * wr[j] * ak[j];
    }
  });
  return folded;
}

// G (the gradient of the folded weight) becomes diag(b) G diag(a) in place; returns the refolded weight and
// sum_i b_i G_ij W_ij (B, in), sum_j a_j G_ij W_ij (B, out). Column sums go through one row per thread.
std::vector<torch::Tensor> fold_backward(
    torch::Tensor weight, torch::Tensor grad, torch::Tensor in_scale, torch::Tensor out_scale) {
  const int64_t B = weight.size(0), O = weight.size(1), I = weight.size(2);
  auto folded = torch::empty_like(weight);
  auto grad_out = torch::empty({B, O}, weight.options());
  auto partial = torch::zeros({at::get_num_threads(), B, I}, weight.options());
  const float *w = weight.data_ptr<float>(), *a = in_scale.data_ptr<float>(), *b = out_scale.data_ptr<float>();
  float *g = grad.data_ptr<float>(), *f = folded.data_ptr<float>(), *go = grad_out.data_ptr<float>();
  float *p = partial.data_ptr<float>();
  at::parallel_for(0, B * O, kGrain, [&](int64_t begin, int64_t end) {
    const int64_t thread = at::get_thread_num();
    for (int64_t row = begin; row < end; ++row) {
      const int64_t k = row / O;
      const float bi = b[row];
      const float *wr = w + row * I, *ak = a + k * I;
      float *gr = g + row * I, *fr = f + row * I, *pr = p + (thread * B + k) * I;
      float row_sum = 0.f;
      #pragma omp simd reduction(+ : row_sum)
      for (int64_t j = 0; j < I; ++j) {
        const float product = gr[j] * wr[j];
        row_sum += ak[j] * product;
        pr[j] += bi * product;
        fr[j] = bi * wr[j] * ak[j];
        gr[j] = bi * gr[j] * ak[j];
      }
      go[row] = row_sum;
    }
  });
  return {folded, partial.sum(0), grad_out};
}
"""


@functools.cache
def load() -> ModuleType | None:
    """The compiled kernels, or None (with a warning) where they cannot be built."""
    try:
        from torch.utils.cpp_extension import load_inline

        return load_inline(
            name="scalevec_cpu_kernels",
            cpp_sources=_SOURCE,
            functions=["fold", "fold_backward"],
            extra_cflags=["-O3", "-fopenmp"],
            extra_ldflags=["-fopenmp"],
        )
    except Exception as error:  # no compiler, no write access to the cache: the eager path still works
        warnings.warn(f"ScaleVec's CPU kernels could not be built, using the eager path: {error}", stacklevel=2)
        return None
