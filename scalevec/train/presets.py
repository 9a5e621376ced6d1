"""Model sizes: `tiny` trains in minutes on two CPU cores; the others follow the paper's range (0.12B to 2B dense,
and an MoE model) and are meant for GPUs; `size_fields` also builds any `LAYERSxHIDDEN` size by one rule (for
scaling ladders). Vocabulary size comes from the tokenizer."""

import math

_TINY = dict(
    hidden_size=128,
    intermediate_size=352,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
)

MODEL_SIZES: dict[str, dict] = {
    "tiny": _TINY,
    "tiny-moe": dict(_TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128),
    "0.12b": dict(
        hidden_size=768,
        intermediate_size=2048,
        num_hidden_layers=12,
        num_attention_heads=12,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    ),
    "0.5b": dict(
        hidden_size=1280,
        intermediate_size=3456,
        num_hidden_layers=24,
        num_attention_heads=10,
        num_key_value_heads=2,
        max_position_embeddings=4096,
    ),
    "1b": dict(
        hidden_size=2048,
        intermediate_size=5504,
        num_hidden_layers=20,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    ),
    "2b": dict(
        hidden_size=2560,
        intermediate_size=6912,
        num_hidden_layers=26,
        num_attention_heads=20,
        num_key_value_heads=4,
        max_position_embeddings=4096,
    ),
    "moe-0.6b": dict(
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=16,
        num_attention_heads=16,
        num_key_value_heads=4,
        max_position_embeddings=4096,
        num_experts=16,
        num_experts_per_tok=2,
        moe_intermediate_size=704,
        qk_norm=True,
    ),
}

# The dimensions a size sets; `LAYERSxHIDDEN` sets these on top of a preset, which gives everything else.
SIZE_FIELDS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "moe_intermediate_size",
)
HEAD_DIM = 32
SIZE_RULE = (
    f"LAYERSxHIDDEN (e.g. 2x64): heads of {HEAD_DIM} dimensions (one head of HIDDEN below {HEAD_DIM}; HIDDEN a "
    f"multiple of {HEAD_DIM} above), key-value heads half the heads rounded down to a divisor of them (1 for one "
    "head), SwiGLU width 8/3 x HIDDEN rounded up to a multiple of 16 (Llama's rule), an MoE preset's expert width in "
    "that preset's ratio to its hidden size; everything else (context length, experts) is the --model-size preset's. "
    "4x128 is the `tiny` preset"
)


def size_fields(size: str, base: str = "tiny") -> dict:
    """The ScaleVecConfig fields of `size`: a preset of MODEL_SIZES, or `LAYERSxHIDDEN` on top of the preset
    `base` (SIZE_RULE)."""
    if size in MODEL_SIZES:
        return dict(MODEL_SIZES[size])
    layers, separator, hidden = size.partition("x")
    if not (separator and layers.isdigit() and hidden.isdigit() and int(layers) > 0 and int(hidden) > 0):
        raise ValueError(f"size {size!r} is neither a preset ({', '.join(MODEL_SIZES)}) nor LAYERSxHIDDEN like 2x64")
    layers, hidden = int(layers), int(hidden)
    if hidden % 2 or (hidden > HEAD_DIM and hidden % HEAD_DIM):
        raise ValueError(
            f"size {size!r}: HIDDEN must be even and, above {HEAD_DIM}, a multiple of the head dimension {HEAD_DIM}"
        )
    heads = max(1, hidden // HEAD_DIM)
    fields = dict(MODEL_SIZES[base])
    fields.update(
        hidden_size=hidden,
        intermediate_size=_multiple_of_16(8 * hidden / 3),
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=next(kv for kv in range(max(1, heads // 2), 0, -1) if heads % kv == 0),
    )
    if "moe_intermediate_size" in fields:
        ratio = fields["moe_intermediate_size"] / MODEL_SIZES[base]["hidden_size"]
        fields["moe_intermediate_size"] = _multiple_of_16(ratio * hidden)
    return fields


def _multiple_of_16(width: float) -> int:
    return 16 * math.ceil(width / 16 - 1e-9)
