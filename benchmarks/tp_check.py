"""Tensor and expert parallelism on CPU: each checkpoint loaded with `tp_plan="auto"` (and the MoE with its experts
sharded too, `ep_size` = N) in N gloo processes gives the logits of the unsharded model. Without `--worker` it
saves tiny ScaleVec checkpoints (standard with QK-norm, unified dense, unified with tied embeddings, unified MoE;
scales moved away from 1) and a tied Llama beside them, and launches the workers with torchrun.

    python benchmarks/tp_check.py [--nproc 2] [--json report.json]
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from _common import move_scales_off_one

CASES = {
    "standard-qk-norm": dict(scale_preset="standard", qk_norm=True),
    "unified": dict(scale_preset="unified"),
    "unified-tied": dict(scale_preset="unified", tie_word_embeddings=True),
    "unified-moe": dict(scale_preset="unified", num_experts=4, moe_intermediate_size=16, mlp_only_layers=[0]),
}
DIMS = dict(
    vocab_size=101, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, head_dim=8
)


def save_cases(root: Path) -> None:
    from transformers import LlamaConfig, LlamaForCausalLM

    from scalevec import ScaleVecConfig, ScaleVecForCausalLM

    for name, fields in CASES.items():
        torch.manual_seed(0)
        model = ScaleVecForCausalLM(ScaleVecConfig(**DIMS, num_key_value_heads=2, **fields))
        move_scales_off_one(model)
        model.save_pretrained(root / name)
    LlamaForCausalLM(LlamaConfig(**DIMS, num_key_value_heads=2, tie_word_embeddings=True)).save_pretrained(
        root / "llama-tied"
    )


def local_rows(tensor: torch.Tensor) -> int:
    from torch.distributed.tensor import DTensor

    return (tensor.to_local() if isinstance(tensor, DTensor) else tensor).shape[0]


def worker(root: Path, report: Path) -> None:
    """Runs in every process: the sharded and the whole model's logits on the same tokens."""
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM
    from transformers.distributed import DistributedConfig

    import scalevec  # noqa: F401  (registers the Auto classes)

    dist.init_process_group("gloo")
    ids = torch.randint(0, DIMS["vocab_size"], (2, 9), generator=torch.Generator().manual_seed(0))
    size = dist.get_world_size()
    plans = {name: DistributedConfig(tp_plan="auto") for name in [*CASES, "llama-tied"]}
    plans["unified-moe-expert-parallel"] = DistributedConfig(tp_size=size, ep_size=size)
    rows = {}
    for name, plan in plans.items():
        folder = root / name.removesuffix("-expert-parallel")
        whole = AutoModelForCausalLM.from_pretrained(folder).eval()
        sharded = AutoModelForCausalLM.from_pretrained(folder, distributed_config=plan).eval()
        with torch.no_grad():
            difference = (sharded(ids).logits - whole(ids).logits).abs().max().item()
        layer = sharded.model.layers[-1]
        rows[name] = {
            "max_logit_diff": difference,
            "q_proj_local_rows": local_rows(layer.self_attn.q_proj.weight),
        }
        if hasattr(layer.mlp, "experts"):
            rows[name]["local_experts"] = local_rows(layer.mlp.experts.gate_up_proj)
    if dist.get_rank() == 0:
        report.write_text(json.dumps({"world_size": dist.get_world_size(), "cases": rows}, indent=2))
    dist.destroy_process_group()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--json", type=Path, help="write the report here")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.worker, args.json)
        return 0
    with tempfile.TemporaryDirectory() as folder:
        root = Path(folder)
        save_cases(root)
        report = args.json or root / "report.json"
        command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(args.nproc)]
        command += ["--standalone", __file__, "--worker", str(root)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run([*command, "--json", str(report)], check=True, env=env)
        result = json.loads(report.read_text())
    for name, row in result["cases"].items():
        print(f"{name}: {result['world_size']} processes, max |logit diff| {row['max_logit_diff']:.2e}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
