"""Dense step time and peak memory: stock Llama vs ScaleVec none / standard / unified, and the per-site choice
between folding scales into the weight on the fly and applying them to the activation. `--against REVISION` adds
each ScaleVec model as that git revision's model code computes it, in the same interleaved run.

    python benchmarks/bench_dense.py [--repetitions 7] [--against REVISION]
"""

import argparse
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from _common import at_revision, interleaved_medians, machine, peak_memory, split_revision, today
from _common import training_step as common_training_step
from transformers import LlamaConfig, LlamaForCausalLM

from scalevec import ScaleVecConfig, ScaleVecForCausalLM
from scalevec.scaled_ops import scaled_linear

DIMS = dict(
    vocab_size=8192,
    hidden_size=384,
    intermediate_size=1024,
    num_hidden_layers=6,
    num_attention_heads=6,
    num_key_value_heads=2,
    max_position_embeddings=512,
)
BATCH, SEQ = 4, 256
MODELS = ("llama", "none", "standard", "unified")


def build_model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if name == "llama":
        return LlamaForCausalLM(LlamaConfig(**DIMS, attn_implementation="sdpa"))
    preset, revision = split_revision(name)
    model = ScaleVecForCausalLM(ScaleVecConfig(**DIMS, scale_preset=preset, attn_implementation="sdpa"))
    return model if revision is None else at_revision(revision, model)


def training_step(name: str) -> Callable[[], None]:
    return common_training_step(build_model(name), DIMS["vocab_size"], BATCH, SEQ)


def site_variants(tokens: int, hidden: int = DIMS["hidden_size"]) -> dict[str, Callable[[], torch.Tensor]]:
    """q/k/v of one layer with branch and row scales, implemented three ways."""
    kv = hidden // 3
    generator = torch.Generator().manual_seed(0)

    def leaf(*shape):
        return torch.randn(*shape, generator=generator).requires_grad_(True)

    x = leaf(tokens, hidden)
    weights = [leaf(hidden, hidden), leaf(kv, hidden), leaf(kv, hidden)]
    alphas = [leaf(hidden) for _ in weights]
    betas = [leaf(w.shape[0]) for w in weights]

    def activation():
        return torch.cat([F.linear(x * a, w) * b for w, a, b in zip(weights, alphas, betas)], dim=-1)

    def autograd_fold():
        return F.linear(x, torch.cat([w * b[:, None] * a[None, :] for w, a, b in zip(weights, alphas, betas)]))

    def custom_fold():
        return torch.cat(scaled_linear(x, list(zip(weights, alphas, betas))), dim=-1)

    return {"activation": activation, "autograd fold": autograd_fold, "fold (ours)": custom_fold}


def saved_bytes(forward: Callable[[], torch.Tensor]) -> int:
    """Bytes autograd keeps for backward beyond the inputs themselves."""
    seen: dict[int, int] = {}

    def pack(tensor):
        if not (tensor.requires_grad and tensor.is_leaf):
            seen[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward()
    return sum(seen.values())


def site_table(repetitions: int) -> list[str]:
    rows = ["| tokens | variant | fwd+bwd ms | saved for backward (KiB) |", "|---|---|---|---|"]
    for tokens in (1, 256, 2048):
        variants = site_variants(tokens)
        steps = {name: (lambda f=f: f().sum().backward()) for name, f in variants.items()}
        times = interleaved_medians(steps, repetitions)
        for name, forward in variants.items():
            rows.append(f"| {tokens} | {name} | {times[name] * 1e3:.3f} | {saved_bytes(forward) / 1024:.0f} |")
    return rows


def model_table(repetitions: int, models: list[str]) -> list[str]:
    times = interleaved_medians({name: training_step(name) for name in models}, repetitions)
    memory = {name: peak_memory(lambda name=name: training_step(name)) for name in models}
    rows = [
        "| model | step s | peak MiB | time / llama | time / standard | memory / llama | memory / standard |",
        "|---|---|---|---|---|---|---|",
    ]
    for name in models:
        rows.append(
            f"| {name} | {times[name]:.3f} | {memory[name] / 2**20:.0f} | {times[name] / times['llama']:.3f} | "
            f"{times[name] / times['standard']:.3f} | {memory[name] / memory['llama']:.3f} | "
            f"{memory[name] / memory['standard']:.3f} |"
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repetitions", type=int, default=7)
    parser.add_argument("--against", metavar="REVISION", help="also each ScaleVec model at this git revision")
    args = parser.parse_args()
    models = [*MODELS, *(f"{name} @ {args.against}" for name in MODELS[1:] if args.against)]
    print(f"## Dense step ({today()}, {machine()})\n")
    print(f"dims {DIMS}, batch {BATCH} x {SEQ} tokens, AdamW, fp32, sdpa, median of {args.repetitions} interleaved\n")
    print("\n".join(model_table(args.repetitions, models)))
    print("\nPer-site choice (q/k/v with branch + row scales):\n")
    print("\n".join(site_table(args.repetitions * 3)))


if __name__ == "__main__":
    sys.exit(main())
