"""The current model code against a git revision's, in one process: what both compute from the same weights.

Every strategy (the 24 combinations of `norm_scale` x `linear_scale` x `scale_param`, of which the presets are three)
dense and MoE, plus QK-norm with output norms and a MoE with a shared expert; fp32, tiny dims, scales moved away from
1. For each: the training loss and logits and every parameter's gradient, the logits without gradients (the cached
folded weights) and greedy tokens, with ScaleVec's CPU kernels off and on (where they build). Prints the largest
absolute difference of each kind and exits non-zero above `--tolerance`.

    python benchmarks/check_against_revision.py --against REVISION [--tolerance 1e-6]
"""

import argparse
import itertools
import os
import sys

import torch
from _common import TINY_DIMS, at_revision, move_scales_off_one

from scalevec import ScaleVecConfig, ScaleVecForCausalLM, cpu_kernels

MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
STRATEGIES = list(itertools.product(("none", "shared", "branch"), ("none", "in", "out", "both"), ("direct", "magdir")))


def cases() -> dict[str, dict]:
    fields = {}
    for norm_scale, linear_scale, scale_param in STRATEGIES:
        strategy = dict(norm_scale=norm_scale, linear_scale=linear_scale, scale_param=scale_param)
        name = f"{norm_scale}/{linear_scale}/{scale_param}"
        fields[f"dense {name}"], fields[f"moe {name}"] = strategy, dict(strategy, **MOE)
    fields["dense unified, qk-norm, output norms"] = dict(scale_preset="unified", qk_norm=True, output_norm=True)
    fields["moe unified, shared expert, one dense layer"] = dict(
        MOE, scale_preset="unified", shared_expert_intermediate_size=8, mlp_only_layers=[0]
    )
    return fields


def outputs(model: torch.nn.Module, ids: torch.Tensor) -> dict[str, torch.Tensor]:
    """Training loss, logits and gradients; then logits without gradients twice (folding, then the cached folded
    weights); then greedy tokens."""
    model.train().zero_grad()
    out = model(ids, labels=ids)
    out.loss.backward()
    results = {"loss": out.loss.detach(), "logits": out.logits.detach()}
    results |= {f"grad {name}": p.grad for name, p in model.named_parameters()}
    model.eval()
    with torch.no_grad():
        results["logits, no grad, folding"] = model(ids).logits
        results["logits, no grad, cached"] = model(ids).logits
    results["tokens"] = model.generate(ids[:, :4], max_new_tokens=6, do_sample=False).float()
    return results


def largest_differences(revision: str, kernels: bool) -> dict[str, float]:
    os.environ["SCALEVEC_CPU_KERNELS"] = "1" if kernels else "0"
    worst = {}
    for name, fields in cases().items():
        torch.manual_seed(0)
        model = ScaleVecForCausalLM(ScaleVecConfig(**TINY_DIMS, **fields))
        move_scales_off_one(model)
        ids = torch.randint(0, TINY_DIMS["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(0))
        current, old = outputs(model, ids), outputs(at_revision(revision, model), ids)
        assert current.keys() == old.keys(), name
        for key, value in current.items():
            kind = key.split(" ")[0] if key.startswith("grad") else key
            difference = (value - old[key]).abs().max().item()
            if difference > worst.get(kind, (-1.0, ""))[0]:
                worst[kind] = (difference, f"{name}: {key}")
    return worst


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--against", metavar="REVISION", required=True)
    parser.add_argument("--tolerance", type=float, default=1e-6)
    args = parser.parse_args()
    torch.set_num_threads(1)
    failed = False
    for kernels in (False, True) if cpu_kernels.load() is not None else (False,):
        print(f"\nCPU kernels {'on' if kernels else 'off'}, {len(cases())} models, against {args.against}:")
        for kind, (difference, where) in largest_differences(args.against, kernels).items():
            failed |= difference > args.tolerance
            print(f"  {kind:<26} max |difference| {difference:.1e}  ({where})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
