"""Conversion throughput and memory: export a ~1 GB randomly initialised ScaleVec-unified checkpoint (several
shards) to `llama`, against a plain copy of the same files.

    python benchmarks/bench_convert.py [--repetitions 3] [--size-gb 1.0] [--shards 4] [--workdir DIR]

Each conversion runs in a fresh child process (what `scalevec-convert` does), which reports its RSS before
converting and its peak RSS while converting (Linux: VmHWM, reset after the imports); the copy is
`shutil.copyfile` of every file of the source. Copies and conversions take turns; the figures are medians.
Verification (both models run on fixed tokens, one unit's weights at a time) is timed once, separately.
"""

import argparse
import json
import os
import re
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from _common import machine, today

from scalevec import ScaleVecConfig
from scalevec.convert import cli
from scalevec.convert.formats import FORMATS
from scalevec.convert.meta_model import meta_state
from scalevec.convert.side_files import write_config
from scalevec.convert.units import group_by_unit
from scalevec.convert.writer import ShardedWriter


def bench_config(size_gb: float) -> ScaleVecConfig:
    """A Llama-1B-like shape whose layer count sets the size (fp32 bytes)."""
    dims = dict(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_attention_heads=16, num_key_value_heads=8
    )
    per_layer = 4 * (2 * 1024 * 1024 + 2 * 512 * 1024 + 3 * 1024 * 2816)
    layers = max(1, round((size_gb * 1e9 - 4 * 2 * 32000 * 1024) / per_layer))
    return ScaleVecConfig(**dims, num_hidden_layers=layers, scale_preset="unified")


def write_random_checkpoint(folder: Path, config: ScaleVecConfig, shards: int) -> None:
    """Random matrices (std 0.02) and scales (1 + 0.3 N(0, 1)), streamed unit by unit into `shards` files."""
    state, roles = meta_state(config)
    scales = set(roles["input"] + roles["output"])
    plan = [(name, tuple(t.shape)) for name, t in state.items()]
    total = sum(t.numel() for t in state.values()) * 4
    folder.mkdir(parents=True)
    generator = torch.Generator().manual_seed(0)
    with ShardedWriter(folder, plan, torch.float32, max_shard_bytes=total // shards + 1) as writer:
        for names in group_by_unit(state, config.num_hidden_layers).values():
            writer.write(
                {
                    name: 1 + 0.3 * torch.randn(state[name].shape, generator=generator)
                    if name in scales
                    else 0.02 * torch.randn(state[name].shape, generator=generator)
                    for name in names
                }
            )
        writer.close()
    write_config(folder, FORMATS["scalevec"], config, torch.float32)


def plain_copy(source: Path, destination: Path) -> float:
    start = time.perf_counter()
    destination.mkdir()
    for file in source.iterdir():
        shutil.copyfile(file, destination / file.name)
    return time.perf_counter() - start


def _status_kib(field: str) -> int:
    return int(re.search(rf"^{field}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1))


def child(source: str, destination: str, verify: bool) -> None:
    """Runs in the child process: convert as `scalevec-convert export` does, then print seconds and RSS as JSON.
    The peak is the kernel's high-water mark (VmHWM), reset after the imports, so it is the conversion's own."""
    Path("/proc/self/clear_refs").write_text("5")
    baseline = _status_kib("VmRSS") * 1024
    start = time.perf_counter()
    arguments = ["export", source, destination, "--to", "llama", "--quiet"] + ([] if verify else ["--no-verify"])
    if cli.main(arguments):
        raise SystemExit("the conversion failed")
    seconds = time.perf_counter() - start
    peak = _status_kib("VmHWM") * 1024
    lifetime_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # imports included
    print(json.dumps({"seconds": seconds, "baseline_rss": baseline, "peak_rss": peak, "lifetime_peak": lifetime_peak}))


def convert_in_child(source: Path, destination: Path, verify: bool = False) -> dict:
    start = time.perf_counter()
    command = [sys.executable, __file__, "--child", str(source), str(destination)] + (["--verify"] if verify else [])
    output = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    result = json.loads(output.strip().splitlines()[-1])
    return {**result, "process_seconds": time.perf_counter() - start}


def measure(workdir: Path, source: Path, repetitions: int) -> tuple[list[float], list[dict], dict]:
    copies, conversions = [], []
    for repetition in range(repetitions):
        _settle(workdir)
        copies.append(plain_copy(source, workdir / "copy"))
        _settle(workdir)
        conversions.append(convert_in_child(source, workdir / "out"))
        print(f"repetition {repetition}: copy {copies[-1]:.2f} s, convert {conversions[-1]['seconds']:.2f} s")
    _settle(workdir)
    return copies, conversions, convert_in_child(source, workdir / "out", verify=True)


def _settle(workdir: Path) -> None:
    """Remove the previous outputs and flush dirty pages, so that each timed step starts from the same state
    instead of paying for the writeback of the step before it."""
    for output in ("copy", "out"):
        shutil.rmtree(workdir / output, ignore_errors=True)
    os.sync()


def report(config: ScaleVecConfig, source: Path, copies: list[float], conversions: list[dict], verified: dict) -> str:
    shard_sizes = [p.stat().st_size for p in source.glob("*.safetensors")]
    source_bytes, largest, mib = sum(p.stat().st_size for p in source.iterdir()), max(shard_sizes), 2**20
    copy_s = statistics.median(copies)
    convert_s, process_s, peak, baseline, lifetime = (
        statistics.median(c[key] for c in conversions)
        for key in ("seconds", "process_seconds", "peak_rss", "baseline_rss", "lifetime_peak")
    )
    return "\n".join(
        [
            f"- checkpoint: {source_bytes / 1e9:.2f} GB fp32, {config.num_hidden_layers} layers, unified "
            f"(branch/both/magdir), {len(shard_sizes)} shards, largest {largest / mib:.0f} MiB",
            f"- plain copy (shutil.copyfile): {copy_s:.2f} s ({source_bytes / copy_s / 1e9:.2f} GB/s)",
            f"- export --to llama, --no-verify: {convert_s:.2f} s ({source_bytes / convert_s / 1e9:.2f} GB/s); "
            f"{process_s:.2f} s with interpreter start and imports",
            f"- **throughput relative to the copy: {copy_s / convert_s:.2f}** (target >= 0.5); "
            f"{copy_s / process_s:.2f} counting start-up",
            f"- **peak RSS while converting: {peak / mib:.0f} MiB = {peak / largest:.2f} x the largest shard** "
            f"(target <= 2); {baseline / mib:.0f} MiB of it were there before converting (Python, torch, "
            f"transformers), so the conversion adds {(peak - baseline) / mib:.0f} MiB = "
            f"{(peak - baseline) / largest:.2f} x; whole-process peak incl. imports {lifetime / mib:.0f} MiB",
            f"- with verification (both models run in fp32, streamed): {verified['seconds']:.2f} s, peak RSS "
            f"{verified['peak_rss'] / mib:.0f} MiB = {verified['peak_rss'] / largest:.2f} x the largest shard",
        ]
    )


def run(args: argparse.Namespace) -> str:
    workdir = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="bench_convert_"))
    source = workdir / "src"
    shutil.rmtree(source, ignore_errors=True)
    config = bench_config(args.size_gb)
    write_random_checkpoint(source, config, args.shards)
    try:
        return report(config, source, *measure(workdir, source, args.repetitions))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--size-gb", type=float, default=1.0)
    parser.add_argument("--shards", type=int, default=4)
    parser.add_argument("--workdir", help="where to put the checkpoints (default: a temporary folder)")
    parser.add_argument("--child", nargs=2, metavar=("SRC", "DST"), help=argparse.SUPPRESS)
    parser.add_argument("--verify", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child, args.verify)
        return
    report = run(args)
    print(
        f"\n## Conversion (bench_convert.py)\n\n{today()}, {machine()}, "
        f"`python benchmarks/bench_convert.py --repetitions {args.repetitions}`\n\n{report}"
    )


if __name__ == "__main__":
    main()
