"""Model FLOPs per token (`scalevec.train.throughput.model_flops_per_token`) against a measured count: the FLOPs
that `torch.utils.flop_counter` sees in one forward and backward of real models (ScaleVec standard and unified,
stock Llama / Qwen3-MoE of the same shapes), dense and MoE, at a few shapes. Exits 1 where they differ by more
than 5 %.

    python benchmarks/bench_flops.py [--json flops.json]
"""

import argparse
import json
import math
import sys
from dataclasses import asdict, dataclass

import torch
from _common import machine, today
from torch.utils.flop_counter import FlopCounterMode
from transformers import AutoModelForCausalLM

from scalevec import ScaleVecConfig
from scalevec.convert.formats import FORMATS
from scalevec.train.throughput import matmul_parameters_per_token, model_flops_per_token

TOLERANCE = 0.05
STOCK = {"dense": "llama", "moe": "qwen3_moe"}


@dataclass(frozen=True)
class Case:
    name: str
    kind: str  # "dense" or "moe"
    fields: dict  # ScaleVecConfig fields
    seq_len: int
    batch: int = 2


_DENSE = dict(vocab_size=4096, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)
_MOE = dict(_DENSE, num_experts=4, num_experts_per_tok=2, qk_norm=True)
CASES = (
    Case("dense 4 x 128", "dense", dict(_DENSE, hidden_size=128, intermediate_size=352, num_hidden_layers=4), 256),
    Case(
        "dense 2 x 256, 8 heads",
        "dense",
        dict(_DENSE, hidden_size=256, intermediate_size=704, num_hidden_layers=2, num_attention_heads=8),
        512,
    ),
    Case("moe 4 x 128", "moe", dict(_MOE, hidden_size=128, num_hidden_layers=4, moe_intermediate_size=128), 256),
    Case(
        "moe 4 x 128, every 2nd layer, shared expert",
        "moe",
        dict(
            _MOE,
            hidden_size=128,
            intermediate_size=352,
            num_hidden_layers=4,
            moe_intermediate_size=96,
            decoder_sparse_step=2,
            shared_expert_intermediate_size=64,
        ),
        256,
    ),
)
MODELS = ("stock", "standard", "unified")


def _grouped_mm_flops(a_shape, b_shape, *args, out_shape=None, **kwargs) -> int:
    # (tokens, in) x (groups, in, out), or (out, tokens) x (tokens, in) split by group: 2 FLOPs per multiply-add
    return 2 * math.prod(a_shape) * b_shape[-1]


# Matmuls that torch's counter has no formula for: grouped GEMMs, and ScaleVec's loop operator in their place.
UNCOUNTED = {torch.ops.aten._grouped_mm: _grouped_mm_flops, torch.ops.scalevec.grouped_mm_loop: _grouped_mm_flops}


def build(case: Case, model: str) -> torch.nn.Module:
    torch.manual_seed(0)
    preset = "standard" if model == "stock" else model
    # Eager attention: its products are the model's. The counter's formula for a fused attention backward adds
    # the scores that a flash kernel recomputes (hardware FLOPs: + 2 x L x heads x d x seq per token).
    config = ScaleVecConfig(**case.fields, scale_preset=preset)
    if model == "stock":
        config = FORMATS[STOCK[case.kind]].stock_config(config)
    return AutoModelForCausalLM.from_config(config, attn_implementation="eager")


def counted_flops_per_token(model: torch.nn.Module, batch: int, seq_len: int) -> float:
    """FLOPs of the matrix products of one training forward and backward, per token."""
    model.train()
    ids = torch.randint(0, model.config.vocab_size, (batch, seq_len), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False, custom_mapping=UNCOUNTED) as counter:
        model(ids, labels=ids).loss.backward()
    return counter.get_total_flops() / ids.numel()


@dataclass
class Row:
    case: str
    model: str
    matmul_parameters: int
    formula: float
    counted: float

    @property
    def ratio(self) -> float:
        return self.counted / self.formula


def measure(case: Case, model: str) -> Row:
    built = build(case, model)
    counted = counted_flops_per_token(built, case.batch, case.seq_len)
    formula = model_flops_per_token(built.config, case.seq_len)
    name = STOCK[case.kind] if model == "stock" else model
    return Row(case.name, name, matmul_parameters_per_token(built.config), formula, counted)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args()
    rows = [measure(case, model) for case in CASES for model in MODELS]
    print(f"## Model FLOPs per token against torch.utils.flop_counter ({today()}, {machine()})\n")
    print("One forward + backward, batch 2, eager attention, fp32.")
    print("Formula: 6 x matmul parameters per token + 12 x layers x heads x head_dim x seq.\n")
    print("| case | seq | model | matmul parameters / token | formula MFLOP / token | counted | counted / formula |")
    print("|---|---|---|---|---|---|---|")
    seq = {case.name: case.seq_len for case in CASES}
    for row in rows:
        cells = (row.case, seq[row.case], row.model, f"{row.matmul_parameters:,}", f"{row.formula / 1e6:.3f}")
        print("| " + " | ".join(map(str, cells)) + f" | {row.counted / 1e6:.3f} | {row.ratio:.4f} |")
    if args.json:
        with open(args.json, "w") as file:
            json.dump([asdict(row) | {"ratio": row.ratio} for row in rows], file, indent=1)
    return int(any(abs(row.ratio - 1) > TOLERANCE for row in rows))


if __name__ == "__main__":
    sys.exit(main())
