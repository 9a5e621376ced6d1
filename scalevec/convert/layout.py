"""Where the scale vectors of a ScaleVec decoder layer sit, relative to layer-local parameter names.

Shared by folding (ScaleVec of any strategy -> folded form) and placement (folded form -> any strategy), so the
two stay inverse to each other. The names are the parameter names of `modeling_scalevec.py`.
"""

from dataclasses import dataclass


@dataclass(frozen=True)
class LinearSite:
    """A linear map `y = out_scale * (W (in_scale * x))` stored as `matrix`, with optional scale vectors stored
    under the prefixes `in_scale` / `out_scale` (each `.weight`, or `.magnitude` + `.direction`).

    `row_groups=2` marks the stacked experts' `gate_up_proj` (E, 2I, H): its rows are two groups (gate, up) whose
    scales have shape (E, 2, I) and (E, 2, H)."""

    matrix: str
    in_scale: str
    out_scale: str
    row_groups: int = 1


def linear(name: str) -> LinearSite:
    return LinearSite(f"{name}.weight", f"{name}.in_scale", f"{name}.out_scale")


EXPERTS_GATE_UP = LinearSite(
    "mlp.experts.gate_up_proj", "mlp.experts.gate_up_in_scale", "mlp.experts.gate_up_out_scale", row_groups=2
)
EXPERTS_DOWN = LinearSite("mlp.experts.down_proj", "mlp.experts.down_in_scale", "mlp.experts.down_out_scale")

# Each input norm and the linear maps that read its output (absent ones, e.g. no shared expert, are skipped).
NORM_CONSUMERS = {
    "input_layernorm": (linear("self_attn.q_proj"), linear("self_attn.k_proj"), linear("self_attn.v_proj")),
    "post_attention_layernorm": (
        linear("mlp.gate_proj"),
        linear("mlp.up_proj"),
        linear("mlp.gate"),
        EXPERTS_GATE_UP,
        linear("mlp.shared_expert.gate_proj"),
        linear("mlp.shared_expert.up_proj"),
        linear("mlp.shared_expert_gate"),
    ),
}
# Linear maps that read something other than a norm: only their own column and row scales apply.
INNER_LINEARS = (
    linear("self_attn.o_proj"),
    linear("mlp.down_proj"),
    EXPERTS_DOWN,
    linear("mlp.shared_expert.down_proj"),
)
# Output-role scales: not foldable, they stay the weights of their norms.
OUTPUT_NORMS = ("self_attn.q_norm", "self_attn.k_norm", "attention_output_layernorm", "mlp_output_layernorm")

FINAL_NORM = "model.norm"
LM_HEAD = "lm_head.weight"
EMBEDDINGS = "model.embed_tokens.weight"
