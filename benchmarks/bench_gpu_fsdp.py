"""Pretraining step on GPUs as it is meant to run at scale: FSDP2 (`apply_fsdp`: each decoder layer + root, bf16
parameters, fp32 reductions), each decoder layer compiled (as torchtitan does), AdamW or Muon (`MuonAdamW`). Prints
median step time, tokens per second per GPU, peak memory, and the optimizer step alone, eager vs compiled.

    torchrun --nproc_per_node 8 benchmarks/bench_gpu_fsdp.py --model-size 0.12b --optim muon
    torchrun --nproc_per_node 8 benchmarks/bench_gpu_fsdp.py --model-size moe-0.6b --batch 8 --seq 2048

Runs on CPUs too (gloo, fp32, no mixed precision), for a smoke test: `--model-size tiny --batch 2 --seq 64`.
"""

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist

from scalevec import ScaleVecConfig, ScaleVecForCausalLM
from scalevec.train.distributed import apply_fsdp, sharding_units
from scalevec.train.optim import DecayConfig, MuonAdamW, parameter_groups
from scalevec.train.presets import MODEL_SIZES

VOCAB = 32768


def build(model_size: str, compiled: bool, device: torch.device) -> ScaleVecForCausalLM:
    torch.manual_seed(0)
    config = ScaleVecConfig(**MODEL_SIZES[model_size], vocab_size=VOCAB, attn_implementation="sdpa")
    model = ScaleVecForCausalLM(config).to(device)
    if compiled:
        for layer in sharding_units(model):
            layer.compile()
    return apply_fsdp(model)


def make_optimizer(model: torch.nn.Module, name: str) -> torch.optim.Optimizer:
    groups = parameter_groups(model, DecayConfig(weight_decay=0.1))
    kwargs = dict(lr=1e-3, betas=(0.9, 0.95))
    if name == "muon":
        return MuonAdamW(groups, **kwargs)
    return torch.optim.AdamW(groups, fused=torch.cuda.is_available() or None, **kwargs)


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(function) -> float:
    synchronize()
    start = time.perf_counter()
    function()
    synchronize()
    return time.perf_counter() - start


def measure(model, optimizer, ids: torch.Tensor, steps: int, warmup: int) -> dict[str, float]:
    step_times, optimizer_times = [], []
    for index in range(warmup + steps):
        forward_backward = timed(lambda: model(ids, labels=ids).loss.backward())
        optimizer_time = timed(optimizer.step)
        optimizer.zero_grad(set_to_none=True)
        if index >= warmup:
            step_times.append(forward_backward + optimizer_time)
            optimizer_times.append(optimizer_time)
    return {"step": statistics.median(step_times), "optimizer": statistics.median(optimizer_times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-size", default="0.12b", choices=list(MODEL_SIZES))
    parser.add_argument("--optim", default="muon", choices=["adamw", "muon"])
    parser.add_argument("--batch", type=int, default=8, help="sequences per GPU")
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = True
    ids = torch.randint(0, VOCAB, (args.batch, args.seq), device=device)
    rows = []
    for compiled in (False, True):
        model = build(args.model_size, compiled, device)
        optimizer = make_optimizer(model, args.optim)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times = measure(model, optimizer, ids, args.steps, args.warmup)
        peak = torch.cuda.max_memory_allocated() / 2**30 if cuda else float("nan")
        rows.append(("compiled" if compiled else "eager", times, peak))
        del model, optimizer
    if dist.get_rank() == 0:
        name = torch.cuda.get_device_name() if cuda else "CPU"
        print(f"{args.model_size}, {args.optim}, {dist.get_world_size()} x {name}, FSDP2, {args.batch} x {args.seq}")
        print("| mode | step s | tokens/s per device | optimizer step s | peak GiB |\n|---|---|---|---|---|")
        for mode, times, peak in rows:
            tokens = args.batch * args.seq / times["step"]
            print(f"| {mode} | {times['step']:.3f} | {tokens:,.0f} | {times['optimizer']:.3f} | {peak:.1f} |")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
