"""MoE step time and peak memory: stock Qwen3-MoE vs ScaleVec standard (same architecture) and unified.
`--against REVISION` adds each ScaleVec model as that git revision's model code computes it, in the same run.

python benchmarks/bench_moe.py [--repetitions 7] [--against REVISION]
"""

import argparse
from collections.abc import Callable

import torch
from _common import at_revision, interleaved_medians, machine, peak_memory, split_revision, today
from _common import training_step as common_training_step
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

from scalevec import ScaleVecConfig, ScaleVecForCausalLM

DIMS = dict(
    vocab_size=8192,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=512,
    num_experts=8,
    num_experts_per_tok=2,
    moe_intermediate_size=256,
    norm_topk_prob=True,
    output_router_logits=True,
)
BATCH, SEQ = 8, 256
MODELS = ("qwen3_moe", "standard", "unified")


def build_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "qwen3_moe":
        return Qwen3MoeForCausalLM(Qwen3MoeConfig(**DIMS, attn_implementation="sdpa"))
    preset, revision = split_revision(name)
    config = ScaleVecConfig(**DIMS, scale_preset=preset, qk_norm=True, attn_implementation="sdpa")
    return ScaleVecForCausalLM(config) if revision is None else at_revision(revision, ScaleVecForCausalLM(config))


def training_step(name: str) -> Callable[[], None]:
    return common_training_step(build_model(name), DIMS["vocab_size"], BATCH, SEQ)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repetitions", type=int, default=7)
    parser.add_argument("--against", metavar="REVISION", help="also each ScaleVec model at this git revision")
    args = parser.parse_args()
    models = [*MODELS, *(f"{name} @ {args.against}" for name in MODELS[1:] if args.against)]
    times = interleaved_medians({name: training_step(name) for name in models}, args.repetitions)
    memory = {name: peak_memory(lambda name=name: training_step(name)) for name in models}
    print(f"## MoE step ({today()}, {machine()})\n")
    print(f"dims {DIMS}, batch {BATCH} x {SEQ} tokens, AdamW, fp32, sdpa, median of {args.repetitions} interleaved\n")
    header = (
        "model",
        "step s",
        "peak MiB",
        "time / qwen3_moe",
        "time / standard",
        "memory / qwen3_moe",
        "memory / standard",
    )
    print("| " + " | ".join(header) + " |")
    print("|---|---|---|---|---|---|---|")
    for name in models:
        print(
            f"| {name} | {times[name]:.3f} | {memory[name] / 2**20:.0f} | {times[name] / times['qwen3_moe']:.3f} | "
            f"{times[name] / times['standard']:.3f} | {memory[name] / memory['qwen3_moe']:.3f} | "
            f"{memory[name] / memory['standard']:.3f} |"
        )


if __name__ == "__main__":
    main()
