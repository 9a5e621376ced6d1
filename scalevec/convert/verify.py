"""Comparing what two checkpoints compute: both run in float32 on the same fixed random tokens.

Both models are loaded whole (this is the one step of a conversion that is not streamed): verifying a large
checkpoint needs memory for both models in float32. `--no-verify` skips it.
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from .checkpoint import Checkpoint
from .errors import ConversionError

FP32_ATOL = 1e-4
# Half-precision weights: each one is off by up to eps/2, so logits move by a few eps relative to their size.
HALF_PRECISION_ULPS = 8


@dataclass(frozen=True)
class Comparison:
    max_abs: float
    max_rel: float
    bound: float
    weight_dtype: torch.dtype

    @property
    def passed(self) -> bool:
        return self.max_abs <= self.bound

    def describe(self) -> str:
        verdict = "within" if self.passed else "EXCEEDS"
        return (
            f"max abs logit difference {self.max_abs:.3e} (relative {self.max_rel:.3e}), {verdict} the bound "
            f"{self.bound:.3e} for {str(self.weight_dtype).removeprefix('torch.')} weights"
        )


def load_model(path: str | Path) -> torch.nn.Module:
    """Any supported checkpoint (ScaleVec or stock), in float32, for inference."""
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()


def random_tokens(vocab_size: int, batch: int = 2, length: int = 16, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab_size, (batch, length), generator=generator)


def weight_dtype(checkpoint: Checkpoint) -> torch.dtype:
    """The least precise floating dtype among a checkpoint's tensors."""
    dtypes = {info.dtype for info in checkpoint.tensors.values() if isinstance(info.dtype, torch.dtype)}
    floats = [d for d in dtypes if d.is_floating_point] or [torch.float32]
    return max(floats, key=lambda d: torch.finfo(d).eps)


def logit_bound(dtype: torch.dtype, reference: torch.Tensor) -> float:
    if dtype in (torch.float32, torch.float64):
        return FP32_ATOL
    return FP32_ATOL + HALF_PRECISION_ULPS * torch.finfo(dtype).eps * reference.abs().max().item()


def compare_checkpoints(
    reference: str | Path, candidate: str | Path, atol: float | None = None, tokens: torch.Tensor | None = None
) -> Comparison:
    """How far `candidate`'s logits are from `reference`'s. The bound is `atol` if given, else 1e-4 for float32
    weights and `1e-4 + 8 eps(dtype) max|logits|` when either checkpoint stores half-precision weights."""
    checkpoints = Checkpoint(reference), Checkpoint(candidate)
    vocab_sizes = {checkpoint.config.get("vocab_size") for checkpoint in checkpoints}
    if len(vocab_sizes) != 1:
        raise ConversionError(f"{reference} and {candidate} have different vocabularies ({sorted(vocab_sizes)})")
    dtype = max((weight_dtype(checkpoint) for checkpoint in checkpoints), key=lambda d: torch.finfo(d).eps)
    if tokens is None:
        tokens = random_tokens(vocab_sizes.pop())
    reference_model = load_model(reference)
    with torch.no_grad():
        expected = reference_model(tokens).logits
        del reference_model
        actual = load_model(candidate)(tokens).logits
    difference = (actual - expected).abs().max().item()
    bound = logit_bound(dtype, expected) if atol is None else atol
    return Comparison(difference, difference / max(expected.abs().max().item(), 1e-30), bound, dtype)
