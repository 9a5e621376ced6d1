"""Model sizes: `tiny` trains in minutes on two CPU cores; the others follow the paper's range (0.12B to 2B dense,
and an MoE model) and are meant for GPUs. Vocabulary size comes from the tokenizer."""

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
