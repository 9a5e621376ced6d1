"""Comparing what two checkpoints compute: both run in float32 on the same fixed random tokens, each through its own
transformers class (the stock one for a stock format), streamed: the model is built on the meta device and each
unit's weights (the embeddings, a decoder layer, the head) are read from the files just before the unit runs and
dropped after it, so verifying needs memory for one unit, not for the model.
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from ..configuration_scalevec import ScaleVecConfig
from .checkpoint import Checkpoint
from .errors import CheckpointError, ConversionError
from .formats import Format, format_of, scalevec_view
from .layout import EMBEDDINGS, LM_HEAD
from .units import EMBED, HEAD, group_by_unit, layer_unit

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


def streamed_logits(path: str | Path, tokens: torch.Tensor) -> torch.Tensor:
    """The float32 logits of the checkpoint at `path` for `tokens`, holding one unit's weights at a time."""
    checkpoint = Checkpoint(path)
    fmt = format_of(checkpoint.model_type)
    view = scalevec_view(checkpoint, fmt)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(path), attn_implementation="eager")
    model = model.float().eval()
    base = model.model
    base.rotary_emb = type(base.rotary_emb)(config=model.config)  # computed buffers, not stored weights
    modules = {
        EMBED: [base.embed_tokens],
        **{layer_unit(i): [layer] for i, layer in enumerate(base.layers)},
        HEAD: [base.norm, model.lm_head],
    }
    keys = group_by_unit(checkpoint.tensors, view.num_hidden_layers)
    loader = _UnitLoader(
        checkpoint, fmt, view, keys, modules, {module: name for name, module in model.named_modules()}
    )
    handles = []
    for unit, unit_modules in modules.items():
        handles.append(unit_modules[0].register_forward_pre_hook(lambda _m, _a, unit=unit: loader.load(unit)))
        handles.append(unit_modules[-1].register_forward_hook(lambda _m, _a, _o, unit=unit: loader.drop(unit)))
    try:
        with torch.no_grad():
            return model(tokens, use_cache=False).logits
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class _UnitLoader:
    checkpoint: Checkpoint
    fmt: Format
    config: ScaleVecConfig
    keys: dict[str, list[str]]  # the checkpoint's tensor names by unit
    modules: dict[str, list[torch.nn.Module]]
    names: dict[torch.nn.Module, str]

    def load(self, unit: str) -> None:
        # As `from_pretrained`: a head stored beside tied embeddings is used (transformers then unties them).
        tied = unit == HEAD and LM_HEAD not in self.checkpoint.tensors
        keys = self.keys.get(unit, []) + [EMBEDDINGS] * tied
        tensors = self.fmt.from_disk(unit, self.checkpoint.read(keys), self.config)
        if tied:  # the LM head is the embedding matrix
            tensors[LM_HEAD] = tensors.pop(EMBEDDINGS)
        for module in self.modules[unit]:
            prefix = self.names[module] + "."
            own = {key.removeprefix(prefix): t.float() for key, t in tensors.items() if key.startswith(prefix)}
            try:
                module.load_state_dict(own, assign=True)
            except RuntimeError as error:
                raise CheckpointError(f"{self.checkpoint.path}: {unit} does not match its config: {error}") from error

    def drop(self, unit: str) -> None:
        for module in self.modules[unit]:
            module.to_empty(device="meta")


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
    expected = streamed_logits(reference, tokens)
    actual = streamed_logits(candidate, tokens)
    difference = (actual - expected).abs().max().item()
    bound = logit_bound(dtype, expected) if atol is None else atol
    return Comparison(difference, difference / max(expected.abs().max().item(), 1e-30), bound, dtype)
