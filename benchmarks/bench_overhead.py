"""Unified's time overhead over standard against tokens per step, dense and MoE, training and decoding, with the
one-line cost model that predicts it from the shapes.

Cost model. Folding the scales into the weights on the fly costs, per step, a fixed number of weight-sized passes
per linear map (with both scales: fold 2, refold 2, `G * W` 1, two reductions, two in-place rescalings = 9; with
one scale 5) plus the small ops that form the scale vectors, whatever the token count. So

    unified / standard = 1 + (sum_maps passes * |W| / R_pass + extra_ops * t_op) / T_standard(N)

with `R_pass` (weight elements per second of one elementwise pass) and `t_op` (seconds of one small op) measured
here on this machine, `extra_ops` counted (aten ops per step, unified minus standard) and `T_standard(N)` the
measured standard step. The fixed part does not grow with N, so the overhead falls as 1/N.

Page faults. glibc hands large freed blocks back to the kernel and takes them again on the next step, so every step
pays page faults (zeroed pages) for a share of its tensors; which share moves with each step's allocation order, and
two presets can differ by thousands of faults per step (several ms at 1k tokens). The table reports them;
`--keep-freed-memory` asks glibc (mallopt) to keep what it frees, which leaves the compute alone in the ratio.

    python benchmarks/bench_overhead.py [--repetitions 11] [--tokens 256 1024 4096 8192] [--profile]
                                        [--keep-freed-memory] [--passes] [--cpu-kernels] [--in-step]
                                        [--against REVISION]

`--passes` times unified at 1k tokens with each group of its weight-sized passes replaced by a no-op (wrong
numbers, timing only): what is left above standard once they are gone is everything else unified does.
`--cpu-kernels` runs every step with ScaleVec's fused CPU kernels (SCALEVEC_CPU_KERNELS=1, scalevec/cpu_kernels.py),
which make those passes in one read of each weight. `--in-step` times the passes themselves inside real steps, per
weight shape, eager and with the kernels. `--against REVISION` times unified with the modeling code of a git
revision beside the current one, in the same process.
"""

import argparse
import contextlib
import ctypes
import os
import resource
import statistics
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Iterable
from unittest import mock

import torch
from _common import at_revision, interleaved_medians, interleaved_times, machine, today
from _common import training_step as common_training_step
from torch.utils._python_dispatch import TorchDispatchMode

from scalevec import ScaleVecConfig, ScaleVecForCausalLM, cpu_kernels, scaled_ops

SEQ = 256
DENSE = dict(vocab_size=4096, hidden_size=256, intermediate_size=704, num_hidden_layers=4)
SHAPES = {"dense": DENSE, "moe": dict(DENSE, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=256)}


def build(shape: str, preset: str, **overrides) -> ScaleVecForCausalLM:
    torch.manual_seed(0)
    fields = dict(SHAPES[shape], num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=SEQ)
    config = ScaleVecConfig(**fields | overrides, scale_preset=preset, attn_implementation="sdpa")
    return ScaleVecForCausalLM(config)


def model_step(model: torch.nn.Module, tokens: int, optimized: Iterable[torch.Tensor] | None = None):
    """A training step of `model` on `tokens` tokens: sequences of SEQ tokens, or one shorter sequence."""
    return common_training_step(model, model.config.vocab_size, max(tokens // SEQ, 1), min(tokens, SEQ), optimized)


def preset_step(shape: str, tokens: int, preset: str, **overrides):
    return model_step(build(shape, preset, **overrides), tokens)


def training_steps(shape: str, tokens: int, **overrides) -> dict:
    return {preset: preset_step(shape, tokens, preset, **overrides) for preset in ("standard", "unified")}


def decoding_steps(shape: str, new_tokens: int = 32) -> dict:
    """`generate` on the training form (scales unfolded), as in an evaluation callback."""
    prompt = torch.randint(0, 4096, (1, 16), generator=torch.Generator().manual_seed(0))

    def decode(model):
        model.eval()
        return lambda: model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    return {preset: decode(build(shape, preset)) for preset in ("standard", "unified")}


class OpCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def ops_per_step(step) -> int:
    """aten ops dispatched by one call of `step`."""
    with OpCounter() as counter:
        step()
    return counter.count


def weight_passes(model: ScaleVecForCausalLM) -> int:
    """Sum over the folded linear maps of (passes per step) x (weight elements)."""
    total = 0
    for module in model.modules():
        for weight, in_scale, out_scale in module.scaled_maps() if hasattr(module, "scaled_maps") else []:
            scales = (in_scale is not None) + (out_scale is not None)
            total += (0, 5, 9)[scales] * weight.numel()
    return total


def machine_rates() -> tuple[float, float]:
    """R_pass: weight elements per second of one out-of-place elementwise pass, over 28 weights of 704 x 256 in turn
    (as a step meets them: not in cache, each result freed before the next). t_op: seconds per aten op of a chain
    of small ops on 256-vectors recorded by autograd and differentiated (dispatch and graph included)."""
    weights, rows = [torch.randn(704, 256) for _ in range(28)], torch.rand(704, 1)

    def passes():
        for weight in weights:
            torch.mul(weight, rows)

    r_pass = 28 * weights[0].numel() / _median_seconds(passes)
    vector = torch.rand(256, requires_grad=True)

    def chain():
        out = vector
        for _ in range(100):
            out = out * vector
        out.sum().backward()

    t_op = _median_seconds(chain) / ops_per_step(chain)
    return r_pass, t_op


def _median_seconds(fn) -> float:
    return interleaved_medians({"fn": fn}, repetitions=21, warmup=1)["fn"]


def profile_table(shape: str, tokens: int) -> str:
    """torch.profiler self-CPU time per op and step, unified minus standard (3 x 3 profiled steps each)."""
    from torch.profiler import ProfilerActivity, profile

    steps = training_steps(shape, tokens)
    totals = {preset: Counter() for preset in steps}
    calls = {preset: Counter() for preset in steps}
    for step in steps.values():
        step(), step()
    for _ in range(3):
        for preset, step in steps.items():
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    step()
            for event in prof.key_averages():
                totals[preset][event.key] += event.self_cpu_time_total / 9e3
                calls[preset][event.key] += event.count / 9
    keys = sorted(
        set(totals["standard"]) | set(totals["unified"]), key=lambda k: totals["standard"][k] - totals["unified"][k]
    )
    lines = ["| op | standard ms (calls) | unified ms (calls) | difference ms |\n|---|---|---|---|"]
    for key in keys[:14]:
        std, uni = totals["standard"][key], totals["unified"][key]
        std_calls, uni_calls = calls["standard"][key], calls["unified"][key]
        lines.append(f"| `{key}` | {std:.2f} ({std_calls:.0f}) | {uni:.2f} ({uni_calls:.0f}) | {uni - std:+.2f} |")
    std, uni = sum(totals["standard"].values()), sum(totals["unified"].values())
    lines.append(f"| all ops | {std:.1f} | {uni:.1f} | {uni - std:+.1f} |")
    return "\n".join(lines)


@contextlib.contextmanager
def replaced(**functions):
    """scaled_ops' functions of these names replaced for the duration (timing only)."""
    saved = {name: getattr(scaled_ops, name) for name in functions}
    for name, function in functions.items():
        setattr(scaled_ops, name, function)
    try:
        yield
    finally:
        for name, function in saved.items():
            setattr(scaled_ops, name, function)


def _without_scale_grads(grad, weight, in_scale, out_scale, dtype, refold):
    """`fold_backward` with its refold and no scale-gradient passes (zeros instead)."""
    folded = scaled_ops.fold_scales(weight, in_scale, out_scale, dtype) if refold else None
    return folded, (grad, *(None if scale is None else torch.zeros_like(scale) for scale in (in_scale, out_scale)))


def _variant(
    shape: str,
    tokens: int,
    preset: str,
    kernels: bool = False,
    optimize_scales: bool = True,
    fixed_vectors: bool = False,
    **functions,
):
    """The training step with `functions` replaced in scaled_ops, the CPU kernels on or off, the scale parameters in
    AdamW or left out of it, and the magnitude-direction vectors formed each step or fixed (formed once, detached)."""
    model = build(shape, preset)
    scales = {name for names in model.scale_vector_roles().values() for name in names}
    optimized = [p for name, p in model.named_parameters() if optimize_scales or name not in scales]
    if fixed_vectors:
        magdir = [module for module in model.modules() if getattr(module, "scale_param", None) == "magdir"]
        fixed = {scale: scale.vector().detach() for scale in magdir}
        functions["formed_scale_vectors"] = lambda _: fixed
    step = model_step(model, tokens, optimized)

    def run():
        with replaced(**functions), mock.patch.dict(os.environ, {"SCALEVEC_CPU_KERNELS": "1" if kernels else "0"}):
            step()

    return run


def without_passes(shape: str, tokens: int, repetitions: int) -> str:
    """Where unified's overhead goes: its eager training step with one group of weight-sized passes replaced by a
    no-op (wrong numbers, timing only) — the fold in forward, the refold in backward, the scale gradients, or all
    three — and with all of them made by the fused CPU kernels instead (where they build). Then what is left with
    none of them: the scale parameters left out of AdamW, and the vectors fixed (neither formed nor optimized)."""
    fold = scaled_ops.fold_scales

    def fold_except_in(*skipped: str):
        def folding(weight, in_scale, out_scale, dtype):
            caller = sys._getframe(1).f_code.co_name  # the fused function's forward, or its backward's refold
            return weight if caller in skipped else fold(weight, in_scale, out_scale, dtype)

        return folding

    no_passes = dict(fold_scales=lambda weight, *_: weight, fold_backward=_without_scale_grads)
    no_refold = fold_except_in("backward", "fold_backward")
    variants = {
        "standard": _variant(shape, tokens, "standard"),
        "unified": _variant(shape, tokens, "unified"),
        "no fold in forward": _variant(shape, tokens, "unified", fold_scales=fold_except_in("forward")),
        "no refold in backward": _variant(shape, tokens, "unified", fold_scales=no_refold),
        "no scale-gradient passes": _variant(shape, tokens, "unified", fold_backward=_without_scale_grads),
        "none of them": _variant(shape, tokens, "unified", **no_passes),
        "none, scales not in AdamW": _variant(shape, tokens, "unified", optimize_scales=False, **no_passes),
        "none, vectors fixed": _variant(shape, tokens, "unified", fixed_vectors=True, **no_passes),
    }
    if cpu_kernels.load() is not None:
        variants["the passes by the fused CPU kernels"] = _variant(shape, tokens, "unified", kernels=True)
    times = interleaved_medians(variants, repetitions)
    return " / ".join(f"{name} {seconds / times['standard']:.3f}" for name, seconds in times.items())


def passes_in_step(shape: str, tokens: int, repetitions: int) -> str:
    """Wall time of the weight-sized passes inside real unified steps, per weight shape (median per call x calls
    per step): the fold in forward and the backward's refold + scale gradients, eager and with the fused CPU kernels
    (where they build), in alternate steps. In a step the weights come cold from L3 after the matmuls, so these
    differ from the passes timed alone."""
    fold, refold_and_grads = scaled_ops.fold_scales, scaled_ops.fold_backward
    variants = {"eager": False, "CPU kernels": True} if cpu_kernels.load() is not None else {"eager": False}
    times = {name: defaultdict(list) for name in variants}

    def timed(part: str, function, name: str):
        def run(*args, **kwargs):
            if part == "fold" and sys._getframe(1).f_code.co_name != "forward":
                return function(*args, **kwargs)  # the backward's refold is timed with its scale gradients
            start = time.perf_counter()
            result = function(*args, **kwargs)
            weight = args[1] if part == "backward" else args[0]
            times[name][(part, tuple(weight.shape))].append(time.perf_counter() - start)
            return result

        return run

    def variant(name: str, kernels: bool):
        timed_passes = dict(fold_scales=timed("fold", fold, name))
        timed_passes["fold_backward"] = timed("backward", refold_and_grads, name)
        return _variant(shape, tokens, "unified", kernels=kernels, **timed_passes)

    interleaved_times({name: variant(name, kernels) for name, kernels in variants.items()}, repetitions)
    per_step = {
        name: {key: statistics.median(calls) * len(calls) / (repetitions + 2) for key, calls in by_key.items()}
        for name, by_key in times.items()
    }
    lines = ["| pass | weight shape | " + " | ".join(f"{name} ms per step" for name in variants) + " |"]
    lines.append("|---|---|" + "---|" * len(variants))
    for part, weight_shape in per_step["eager"]:
        cells = " | ".join(f"{per_step[name][(part, weight_shape)] * 1e3:.2f}" for name in variants)
        lines.append(f"| {part} | {weight_shape} | {cells} |")
    totals = " | ".join(f"{sum(per_step[name].values()) * 1e3:.2f}" for name in variants)
    lines.append(f"| all | | {totals} |")
    return "\n".join(lines)


def against_revision(shape: str, tokens: int, revision: str, repetitions: int) -> str:
    """Unified's step with the current code and with the code of `revision`, side by side, against standard's."""
    steps = training_steps(shape, tokens)
    steps[f"unified at {revision}"] = model_step(at_revision(revision, build(shape, "unified")), tokens)
    times = interleaved_medians(steps, repetitions)
    return " / ".join(f"{name} {seconds / times['standard']:.3f}" for name, seconds in times.items())


def receiving_experts(repetitions: int) -> str:
    """Training steps of 16 tokens on a 64-expert top-2 MoE (at most 32 experts receive tokens): folding only the
    receiving experts against folding all of them, unified."""
    steps = {}
    every_expert = dict(receiving_experts=lambda group_sizes: (None, group_sizes))
    for name, functions in (("all experts", every_expert), ("receiving only", {})):
        step = preset_step("moe", 16, "unified", num_experts=64)

        def timed(step=step, functions=functions):
            with replaced(**functions):
                step()

        steps[name] = timed
    times = interleaved_medians(steps, repetitions)
    return " / ".join(f"{name} {seconds * 1e3:.1f} ms" for name, seconds in times.items())


def keep_freed_memory() -> None:
    """glibc keeps freed blocks for reuse instead of returning them to the kernel (no page faults after warm-up)."""
    libc = ctypes.CDLL("libc.so.6")
    m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
    for option, value in ((m_mmap_threshold, 32 << 20), (m_trim_threshold, 1 << 40), (m_top_pad, 256 << 20)):
        if not libc.mallopt(option, value):
            raise RuntimeError(f"mallopt({option}, {value}) failed: --keep-freed-memory needs glibc")


def timed_with_faults(steps: dict, repetitions: int) -> tuple[dict[str, list[float]], dict[str, float]]:
    """`interleaved_times` of the steps, and the median minor page faults per step of each."""
    faults = {name: [] for name in steps}

    def counting(name, step):
        def run():
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            step()
            faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

        return run

    times = interleaved_times({name: counting(name, step) for name, step in steps.items()}, repetitions)
    return times, {name: statistics.median(counts) for name, counts in faults.items()}


def row(label: str, times: dict[str, list[float]], faults: dict[str, float], model: str) -> str:
    std, uni = (statistics.median(times[preset]) for preset in ("standard", "unified"))
    best = min(times["unified"]) / min(times["standard"])
    page_faults = f"{faults['standard']:.0f} / {faults['unified']:.0f}"
    return f"| {label} | {std * 1e3:.1f} | {uni * 1e3:.1f} | {uni / std:.3f} | {best:.3f} | {page_faults} | {model} |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repetitions", type=int, default=11)
    parser.add_argument("--tokens", type=int, nargs="+", default=[256, 1024, 4096, 8192])
    parser.add_argument("--profile", action="store_true", help="also print a torch.profiler table at 1k tokens")
    parser.add_argument("--keep-freed-memory", action="store_true", help="no page faults: see the docstring")
    parser.add_argument("--passes", action="store_true", help="also time unified without its weight-sized passes")
    parser.add_argument("--cpu-kernels", action="store_true", help="fused CPU kernels for the passes")
    parser.add_argument("--in-step", action="store_true", help="also time the passes inside 1k-token steps")
    parser.add_argument("--against", metavar="REVISION", help="also time unified at 1k with this git revision's code")
    args = parser.parse_args()
    if args.keep_freed_memory:
        keep_freed_memory()
    if args.cpu_kernels:
        os.environ["SCALEVEC_CPU_KERNELS"] = "1"  # every step but --passes', which sets them per step
        if cpu_kernels.load() is None:
            raise SystemExit("the CPU kernels could not be built (see the warning)")
    r_pass, t_op = machine_rates()
    print(f"## Overhead against tokens per step ({today()}, {machine()})\n")
    print(f"hidden 256, 4 layers, seq {SEQ}, fp32, AdamW; {args.repetitions} interleaved steps: median and best.")
    allocator = "keeps freed memory (mallopt)" if args.keep_freed_memory else "glibc defaults"
    kernels = "fused CPU kernels" if args.cpu_kernels else "eager passes"
    rates = f"R_pass = {r_pass / 1e9:.2f} G elements/s, t_op = {t_op * 1e6:.1f} us"
    print(f"Allocator: {allocator}; {kernels}. Machine rates: {rates}\n")
    print(
        "| model | tokens | standard ms | unified ms | unified / standard | best / best | page faults per step "
        "(std / uni) | cost model |"
    )
    print("|---|---|---|---|---|---|---|---|")
    passes = {shape: weight_passes(build(shape, "unified")) for shape in SHAPES}
    for shape in SHAPES:
        for tokens in sorted(args.tokens):
            steps = training_steps(shape, tokens)
            extra_ops = ops_per_step(steps["unified"]) - ops_per_step(steps["standard"])
            fixed = passes[shape] / r_pass + extra_ops * t_op
            times, faults = timed_with_faults(steps, args.repetitions)
            predicted = 1 + fixed / statistics.median(times["standard"])
            print(row(f"{shape} | {tokens}", times, faults, f"{predicted:.3f}"))
        times, faults = timed_with_faults(decoding_steps(shape), args.repetitions)
        print(row(f"{shape}, decoding 32 tokens | 1", times, faults, "1 (folded weights cached)"))
    print(
        f"\nFixed cost of unified, from the shapes: dense {passes['dense'] / 1e6:.1f} M, "
        f"MoE {passes['moe'] / 1e6:.1f} M weight-element passes per step"
    )
    print(f"\n64 experts, 16 tokens per step: {receiving_experts(args.repetitions)}")
    if args.passes:
        for shape in SHAPES:
            print(f"\n{shape}, 1024 tokens, step / standard's: {without_passes(shape, 1024, args.repetitions)}")
    if args.against:
        for shape in SHAPES:
            line = against_revision(shape, 1024, args.against, args.repetitions)
            print(f"\n{shape}, 1024 tokens, step / standard's: {line}")
    if args.in_step:
        for shape in SHAPES:
            table = passes_in_step(shape, 1024, args.repetitions)
            print(f"\n### Passes inside {shape} steps of 1024 tokens\n\n{table}")
    if args.profile:
        for shape in SHAPES:
            print(f"\n### torch.profiler, {shape}, 1024 tokens per step (ms per step)\n\n{profile_table(shape, 1024)}")


if __name__ == "__main__":
    sys.exit(main())
