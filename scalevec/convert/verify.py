"""Comparing what two checkpoints compute: both run in float32 on the same fixed random tokens, each through its own
transformers class with the checkpoint's head (the stock one for a stock format), streamed: the model is built on
the meta device and each unit's weights (the embeddings, a decoder layer, the head) are read from the files just
before the unit runs and dropped after it, so verifying needs memory for one unit, not for the model.
"""

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig

from ..configuration_scalevec import ScaleVecConfig
from .checkpoint import Checkpoint
from .errors import CheckpointError, ConversionError
from .formats import Format, format_of, scalevec_view
from .heads import CAUSAL_LM, SEQUENCE_CLASSIFICATION, Head, head_of
from .layout import EMBEDDINGS, FINAL_NORM, LM_HEAD
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
    """The float32 logits of the checkpoint at `path` for `tokens` (a question-answering head's start and end
    logits, side by side), holding one unit's weights at a time."""
    checkpoint = Checkpoint(path)
    fmt = format_of(checkpoint.model_type)
    head = head_of(checkpoint.config, checkpoint.path / "config.json")
    view = scalevec_view(checkpoint, fmt)
    with torch.device("meta"):
        model = head.auto_class.from_config(AutoConfig.from_pretrained(path), attn_implementation="eager")
    model = model.float().eval()
    base = getattr(model, model.base_model_prefix)
    base.rotary_emb = type(base.rotary_emb)(config=model.config)  # computed buffers, not stored weights
    # Each unit's modules in the order they run, by their ScaleVec names (the names `from_disk` gives tensors).
    modules = {
        EMBED: {"model.embed_tokens": base.embed_tokens},
        **{layer_unit(i): {f"model.layers.{i}": layer} for i, layer in enumerate(base.layers)},
        HEAD: {FINAL_NORM: base.norm, head.layer: getattr(model, head.layer)},
    }
    keys = group_by_unit(checkpoint.tensors, view.num_hidden_layers, fmt.base_prefix(head))
    loader = _UnitLoader(checkpoint, fmt, head, view, keys, modules)
    handles = []
    for unit, unit_modules in modules.items():
        in_order = list(unit_modules.values())
        handles.append(in_order[0].register_forward_pre_hook(lambda _m, _a, unit=unit: loader.load(unit)))
        handles.append(in_order[-1].register_forward_hook(lambda _m, _a, _o, unit=unit: loader.drop(unit)))
    try:
        with torch.no_grad():
            output = model(tokens, use_cache=False)
        return torch.cat([output[field] for field in head.outputs], dim=-1)
    finally:
        for handle in handles:
            handle.remove()


@dataclass
class _UnitLoader:
    checkpoint: Checkpoint
    fmt: Format
    head: Head
    config: ScaleVecConfig
    keys: dict[str, list[str]]  # the checkpoint's tensor names by unit
    modules: dict[str, dict[str, torch.nn.Module]]  # each unit's modules by ScaleVec name

    def load(self, unit: str) -> None:
        # As `from_pretrained`: a head stored beside tied embeddings is used (transformers then unties them).
        tied = unit == HEAD and self.head is CAUSAL_LM and LM_HEAD not in self.checkpoint.tensors
        keys = self.keys.get(unit, []) + [EMBEDDINGS] * tied
        tensors = self.fmt.from_disk(unit, self.checkpoint.read(keys), self.config, self.head)
        if tied:  # the LM head is the embedding matrix
            tensors[LM_HEAD] = tensors.pop(EMBEDDINGS)
        for name, module in self.modules[unit].items():
            prefix = name + "."
            own = {key.removeprefix(prefix): t.float() for key, t in tensors.items() if key.startswith(prefix)}
            try:
                module.load_state_dict(own, assign=True)
            except RuntimeError as error:
                raise CheckpointError(f"{self.checkpoint.path}: {unit} does not match its config: {error}") from error

    def drop(self, unit: str) -> None:
        for module in self.modules[unit].values():
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
    heads = [head_of(checkpoint.config, checkpoint.path / "config.json") for checkpoint in checkpoints]
    if heads[0] is not heads[1]:
        raise ConversionError(f"{reference} is a {heads[0].name} model and {candidate} a {heads[1].name} model")
    dtype = max((weight_dtype(checkpoint) for checkpoint in checkpoints), key=lambda d: torch.finfo(d).eps)
    if tokens is None:
        tokens = random_tokens(vocab_sizes.pop())
    if heads[0] is SEQUENCE_CLASSIFICATION and checkpoints[0].config.get("pad_token_id") is None:
        tokens = tokens[:1]  # transformers' sequence head finds where each row ends by its padding: one row, none
    expected = streamed_logits(reference, tokens)
    actual = streamed_logits(candidate, tokens)
    difference = (actual - expected).abs().max().item()
    bound = logit_bound(dtype, expected) if atol is None else atol
    return Comparison(difference, difference / max(expected.abs().max().item(), 1e-30), bound, dtype)
