"""Compiled vs eager training step: ScaleVec unified against stock Llama (dense) and Qwen3-MoE, each eager and under
`torch.compile` (inductor), in one run with interleaved repetitions and medians. The models and batches are those
of `bench_dense.py` and `bench_moe.py`; AdamW (fused) stays eager, as with the Trainer's `--torch-compile`.

    python benchmarks/bench_compile.py [--repetitions 7] [--models llama unified qwen3_moe unified_moe]
"""

import argparse
import time
from collections.abc import Callable

import bench_dense
import bench_moe
import torch
from _common import interleaved_medians, machine, today
from _common import training_step as common_training_step
from torch._dynamo.utils import counters
from transformers.utils.output_capturing import maybe_install_capturing_hooks

BUILDERS = {
    "llama": (bench_dense, "llama"),
    "unified": (bench_dense, "unified"),
    "qwen3_moe": (bench_moe, "qwen3_moe"),
    "unified_moe": (bench_moe, "unified"),
}


def training_step(name: str, compiled: bool) -> Callable[[], None]:
    bench, preset = BUILDERS[name]
    model = bench.build_model(preset)
    if compiled:
        # as `scalevec-train --torch-compile` does: hooks installed on the first call would break the graph for good
        maybe_install_capturing_hooks(model.model)
        model = torch.compile(model)
    return common_training_step(model, bench.DIMS["vocab_size"], bench.BATCH, bench.SEQ)


def first_step(step: Callable[[], None]) -> tuple[float, int, int]:
    """Seconds of the first (compiling) call, and the graphs and graph breaks it produced."""
    graphs, breaks = counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())
    start = time.perf_counter()
    step()
    seconds = time.perf_counter() - start
    return seconds, counters["stats"]["unique_graphs"] - graphs, sum(counters["graph_break"].values()) - breaks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repetitions", type=int, default=7)
    parser.add_argument("--models", nargs="+", default=list(BUILDERS), choices=list(BUILDERS))
    args = parser.parse_args()
    steps, compilation = {}, {}
    for name in args.models:
        steps[f"{name} eager"] = training_step(name, compiled=False)
        steps[f"{name} compiled"] = training_step(name, compiled=True)
        compilation[name] = first_step(steps[f"{name} compiled"])
    times = interleaved_medians(steps, args.repetitions)
    print(f"## Compiled vs eager step ({today()}, {machine()})\n")
    print(f"fp32, sdpa, fused AdamW, inductor (default mode), median of {args.repetitions} interleaved\n")
    print("| model | eager s | compiled s | eager / compiled | first compiled call s | graphs | graph breaks |")
    print("|---|---|---|---|---|---|---|")
    for name in args.models:
        eager, compiled = times[f"{name} eager"], times[f"{name} compiled"]
        seconds, graphs, breaks = compilation[name]
        row = (name, f"{eager:.3f}", f"{compiled:.3f}", f"{eager / compiled:.2f}", f"{seconds:.0f}", graphs, breaks)
        print("| " + " | ".join(map(str, row)) + " |")


if __name__ == "__main__":
    main()
