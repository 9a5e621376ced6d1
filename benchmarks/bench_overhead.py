"""Unified's time overhead over standard against tokens per training step, dense and MoE, with the one-line cost
model that predicts it.

Folding the scales into the weights costs a fixed number of weight-sized passes per step, whatever the token
count, while the matmuls grow with the tokens. So `unified / standard - 1 = N0 / N`: one constant `N0` per shape
(the token count at which the folds cost as much as the rest of the step), fitted here by least squares over the
measured token counts.

    python benchmarks/bench_overhead.py [--repetitions 5] [--tokens 256 1024 4096 8192]
"""

import argparse
import sys

import torch
from _common import interleaved_medians, machine, today
from _common import training_step as common_training_step

from scalevec import ScaleVecConfig, ScaleVecForCausalLM

SEQ = 256
SHAPES = {
    "dense": dict(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4),
    "moe": dict(
        vocab_size=4096,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=4,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=256,
    ),
}


def training_step(shape: str, preset: str, tokens: int):
    torch.manual_seed(0)
    fields = dict(SHAPES[shape], num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    model = ScaleVecForCausalLM(ScaleVecConfig(**fields, scale_preset=preset, attn_implementation="sdpa"))
    return common_training_step(model, fields["vocab_size"], tokens // SEQ, SEQ)


def overheads(shape: str, tokens: list[int], repetitions: int) -> dict[int, float]:
    result = {}
    for count in tokens:
        steps = {preset: training_step(shape, preset, count) for preset in ("standard", "unified")}
        times = interleaved_medians(steps, repetitions)
        result[count] = times["unified"] / times["standard"] - 1
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096, 8192])
    args = parser.parse_args()
    print(f"## Overhead against tokens per step ({today()}, {machine()})\n")
    print(f"hidden 256, 4 layers, seq {SEQ}, fp32, AdamW, median of {args.repetitions} interleaved\n")
    print("| model | tokens | unified / standard | cost model 1 + N0/N |\n|---|---|---|---|")
    for shape in SHAPES:
        measured = overheads(shape, sorted(args.tokens), args.repetitions)
        n0 = sum(o / n for n, o in measured.items()) / sum(1 / n**2 for n in measured)
        for count, overhead in measured.items():
            print(f"| {shape} (N0 = {n0:.0f}) | {count} | {1 + overhead:.3f} | {1 + n0 / count:.3f} |")


if __name__ == "__main__":
    sys.exit(main())
