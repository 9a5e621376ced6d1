"""The data path at three corpus sizes, against the pipeline it replaced (the revision before it, run from a git
archive in the same session): preparation (1 and N processes), peak memory and time to the first step of a training
process, resuming after >= 10 M consumed tokens on the prepared and the streamed path, and streamed tokens per second
per rank under `torchrun`.

The corpus is real text nobody here wrote: every .py, .txt, .rst and .md file of this Python's standard library and
site-packages, one document per file, de-duplicated, in 16 JSON-lines shards; each size is a prefix of it.

    python benchmarks/bench_data.py [--sizes 10,30,85] [--old-revision 3d87363] [--workdir /tmp/bench-data]

Every figure is one process run at a time on an otherwise idle machine (other load is reported beside it).
"""

import argparse
import hashlib
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

from _common import machine, today

ROOT = Path(__file__).resolve().parents[1]
SUFFIXES = (".py", ".txt", ".rst", ".md")
SHARDS = 16
SEQ_LEN, BATCH = 256, 8
TINY = ["--model-size", "tiny", "--report-to", "none", "--logging-steps", "1", "--disable-tqdm", "true"]
TINY += ["--scale-stats", "false", "--per-device-train-batch-size", str(BATCH), "--seq-len", str(SEQ_LEN)]
BYTES_PER_TOKEN = 3.0  # of this corpus with the embedded 4k BPE (measured: 2.9-3.1), to cut the sizes


def corpus_files() -> list[Path]:
    roots = {Path(sysconfig.get_paths()[key]) for key in ("stdlib", "purelib", "platlib")}
    files = sorted({p for root in roots for p in root.rglob("*") if p.suffix in SUFFIXES and p.is_file()})
    return files


def build_corpus(folder: Path, tokens: float) -> Path:
    """The first documents of the corpus adding up to about `tokens` tokens, in 16 shards."""
    target = folder / f"corpus-{tokens / 1e6:g}M"
    if (target / "done").exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    budget, seen, written = tokens * BYTES_PER_TOKEN, set(), 0
    shards = [open(target / f"part-{index:02d}.jsonl", "w") for index in range(SHARDS)]  # noqa: SIM115
    for number, path in enumerate(corpus_files()):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        digest = hashlib.sha1(text.encode()).digest()
        if not text.strip() or digest in seen:
            continue
        seen.add(digest)
        shards[number % SHARDS].write(json.dumps({"text": text}) + "\n")
        written += len(text.encode())
        if written >= budget:
            break
    for shard in shards:
        shard.close()
    (target / "done").write_text(str(written))
    return target


def timed(command: list[str], env: dict | None = None, marker: str | None = None) -> dict:
    """Run `command`; its wall time, peak RSS (MiB), and the seconds until a stdout line containing `marker`."""
    environment = {**os.environ, "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1", **(env or {})}
    start = time.perf_counter()
    # Not from the checkout (where `python -m` would import its package first): PYTHONPATH chooses the old one.
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=environment,
        cwd=tempfile.gettempdir(),
    )
    marked, lines = None, []
    for line in process.stdout:
        lines.append(line)
        if marker and marked is None and marker in line:
            marked = time.perf_counter() - start
    _, status, usage = os.wait4(process.pid, 0)
    process.returncode = os.waitstatus_to_exitcode(status)
    if process.returncode:
        raise RuntimeError(f"{' '.join(command)} failed:\n{''.join(lines[-30:])}")
    return {"seconds": time.perf_counter() - start, "peak_mib": usage.ru_maxrss / 1024, "marked": marked}


def old_package(revision: str, folder: Path) -> Path:
    """The package as it was at `revision` (its `git archive`), importable with PYTHONPATH."""
    target = folder / f"old-{revision}"
    if not (target / "scalevec").exists():
        target.mkdir(parents=True, exist_ok=True)
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision, "scalevec"], capture_output=True)
        subprocess.run(["tar", "-x", "-C", str(target)], input=archive.stdout, check=True)
    return target


def prepare(corpus: Path, output: Path, num_proc: int) -> dict:
    command = [sys.executable, "-m", "scalevec.data.cli", "prepare", str(corpus), "--output", str(output)]
    result = timed([*command, "--seq-len", str(SEQ_LEN), "--num-proc", str(num_proc), "--quiet"])
    metadata = json.loads((output / "scalevec_data.json").read_text())
    tokens = sum(split["tokens"] for split in metadata["splits"].values())
    return {**result, "tokens": tokens, "tokens_per_second": tokens / result["seconds"]}


def first_step(dataset_flags: list[str], output: Path, env: dict | None = None, *flags: str) -> dict:
    """A training process: its peak memory and the seconds from its start to its first logged step (a fresh run
    in `output`, unless it resumes)."""
    if "--resume" not in flags:
        shutil.rmtree(output, ignore_errors=True)
    command = [sys.executable, "-m", "scalevec.train.cli", *TINY, *dataset_flags, "--output-dir", str(output)]
    return timed([*command, "--eval-every", "0", "--max-steps", "3", *flags], env=env, marker="'loss'")


def consumed_checkpoint(run: Path, steps: int) -> None:
    """Make `run`'s checkpoint-2 say it is `steps` steps in (what a run that far leaves, but for the weights)."""
    state_file = run / "checkpoint-2" / "trainer_state.json"
    state = json.loads(state_file.read_text())
    state.update(global_step=steps, max_steps=steps + 2)
    state_file.write_text(json.dumps(state))
    (run / "checkpoint-2").rename(run / f"checkpoint-{steps}")
    for name in ("model.safetensors", "trainer_state.json", "all_results.json"):
        (run / name).unlink(missing_ok=True)


def stream_position(corpus: Path, steps: int, checkpoint: Path) -> float:
    """Consume `steps` batches of the stream in this process, as a run would, and save the loader's position into
    `checkpoint`; returns the seconds it took (what the old pipeline spends again at every resume)."""
    from torchdata.stateful_dataloader import StatefulDataLoader

    from scalevec.data import DataArguments, PackedBlockCollator, build_training_data, default_tokenizer

    tokenizer = default_tokenizer()
    args = DataArguments(dataset=str(corpus), streaming=True, seq_len=SEQ_LEN, eval_every=0)
    data = build_training_data(args, tokenizer, seed=42, progress=False)
    loader = StatefulDataLoader(data.train, batch_size=BATCH, collate_fn=PackedBlockCollator(tokenizer.eos_token_id))
    start = time.perf_counter()
    batches = iter(loader)
    for _ in range(steps):
        next(batches)
    seconds = time.perf_counter() - start
    (checkpoint / "data_state_rank0.json").write_text(json.dumps(loader.state_dict()))
    return seconds


def data_paths(corpus: Path, prepared: Path) -> dict[str, list[str]]:
    """The `scalevec-train` flags of each data path: the prepared folder, and the raw corpus streamed."""
    return {"prepared": ["--dataset", str(prepared)], "streamed": ["--dataset", str(corpus), "--streaming", "true"]}


def train_runtime(run: Path) -> float:
    """The Trainer's `train_runtime` of a finished run: from the start of its training loop, where a resumed run
    skips to its position, to its end."""
    return json.loads((run / "all_results.json").read_text())["train_runtime"]


def resume(corpus: Path, prepared: Path, workdir: Path, tokens: float) -> dict:
    """Two steps from scratch against two steps resumed after `tokens` consumed tokens, on each path: the skip is
    the difference of their training loops' times."""
    steps = math.ceil(tokens / (BATCH * SEQ_LEN))
    results = {"consumed_tokens": steps * BATCH * SEQ_LEN}
    for name, flags in data_paths(corpus, prepared).items():
        run = workdir / f"resume-{name}"
        saving = ["--save-strategy", "steps", "--save-steps", "2", "--max-steps", "2"]
        fresh = first_step(flags, run, None, *saving)
        fresh_loop = train_runtime(run)
        consumed_checkpoint(run, steps)
        if name == "streamed":
            results["streamed_consumption_seconds"] = stream_position(corpus, steps, run / f"checkpoint-{steps}")
        resumed = first_step(flags, run, None, "--resume", "true", "--max-steps", str(steps + 2))
        results[name] = {
            "fresh_first_step": fresh["marked"],
            "resumed_first_step": resumed["marked"],
            "skip_seconds": train_runtime(run) - fresh_loop,
        }
    return results


STREAM_RATE = """
import json, os, sys, time
import torch.distributed as dist
from scalevec.data import DataArguments, build_training_data, default_tokenizer
rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
tokenizer = default_tokenizer()
args = DataArguments(dataset=sys.argv[1], streaming=True, seq_len=256, eval_every=0)
stream = iter(build_training_data(args, tokenizer, seed=0, rank=rank, world_size=world, progress=False).train)
next(stream)
start, blocks = time.perf_counter(), 0
while time.perf_counter() - start < float(sys.argv[2]):
    next(stream)
    blocks += 1
rate = blocks * 256 / (time.perf_counter() - start)
with open(f"{sys.argv[3]}-rank{rank}.json", "w") as file:
    json.dump({"rank": rank, "world": world, "tokens_per_second": rate}, file)
"""


def stream_rates(corpus: Path, workdir: Path, seconds: float = 30) -> dict:
    """Streamed tokens per second of each rank, one tokenizer thread per process (so two ranks on two cores each
    have a core): one process alone, then two under torchrun."""
    script = workdir / "stream_rate.py"
    script.write_text(STREAM_RATE)
    env = {"TOKENIZERS_PARALLELISM": "false"}
    rates = {}
    for world in (1, 2):
        prefix = workdir / f"rate-{world}"
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world)]
        timed([*launch, str(script), str(corpus), str(seconds), str(prefix)], env=env)
        rates[world] = [
            json.loads(Path(f"{prefix}-rank{r}.json").read_text())["tokens_per_second"] for r in range(world)
        ]
    return rates


OLD_SKIP = """
import sys, time
from transformers import AutoTokenizer
from scalevec.train.corpus import default_tokenizer
from scalevec.train.data import DataArguments, build_datasets
args = DataArguments(dataset=sys.argv[1], streaming=True, seq_len=256, eval_every=0)
stream = iter(build_datasets(args, default_tokenizer(), seed=42).train)
start, blocks = time.perf_counter(), 0
for blocks, _ in enumerate(stream, 1):
    if blocks == int(sys.argv[2]) * 8:
        break
print("skip seconds", (time.perf_counter() - start) * int(sys.argv[2]) * 8 / blocks)
"""


def old_runs(old: Path, corpus: Path, workdir: Path, name: str) -> dict:
    """The old pipeline's first step from raw files: tokenising (cold, then from `datasets`' cache) and packing."""
    env = {"PYTHONPATH": str(old)}
    flags = ["--dataset", str(corpus)]
    cold = first_step(flags, workdir / f"old-{name}-cold", env)
    warm = first_step(flags, workdir / f"old-{name}-warm", env)
    return {"cold": cold, "warm": warm}


def old_stream_skip(old: Path, corpus: Path, workdir: Path, steps: int) -> float:
    """What resuming the old stream costs: reading and tokenising every consumed batch again (scaled up from the
    whole corpus where it holds fewer blocks)."""
    script = workdir / "old_skip.py"
    script.write_text(OLD_SKIP)
    command = [sys.executable, str(script), str(corpus), str(steps)]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(old)})
    lines = [line for line in result.stdout.splitlines() if line.startswith("skip seconds")]
    if not lines:
        raise RuntimeError(result.stderr[-3000:])
    return float(lines[-1].split()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10,30,85", help="corpus sizes in millions of tokens")
    parser.add_argument("--old-revision", default="3d87363", help="the revision whose pipeline is compared")
    parser.add_argument("--old-up-to", type=float, default=85, help="run the old pipeline up to this size (M)")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "scalevec-bench-data")
    parser.add_argument("--json", type=Path, help="write every figure here")
    parser.add_argument("--repetitions", type=int, default=3, help="training starts per path and size (median)")
    parser.add_argument(
        "--parts",
        default="prepare,train,old,resume,rates",
        help="what to measure (without prepare: the folders a previous run prepared)",
    )
    args = parser.parse_args()
    args.workdir.mkdir(parents=True, exist_ok=True)
    report = {"date": today(), "machine": machine(), "cores": os.cpu_count(), "sizes": {}}
    parts = set(args.parts.split(","))
    old = old_package(args.old_revision, args.workdir)
    largest = None
    for size in (float(size) for size in args.sizes.split(",")):
        corpus = build_corpus(args.workdir, size * 1e6)
        prepared = args.workdir / f"prepared-{size:g}M-1"
        row = {}
        for num_proc in (1, 2) if "prepare" in parts else ():
            output = args.workdir / f"prepared-{size:g}M-{num_proc}"
            shutil.rmtree(output, ignore_errors=True)
            row[f"prepare_{num_proc}proc"] = prepare(corpus, output, num_proc)
        for name, flags in data_paths(corpus, prepared).items() if "train" in parts else ():
            runs = [first_step(flags, args.workdir / f"run-{name}-{size:g}M") for _ in range(args.repetitions)]
            row[f"train_{name}"] = {key: statistics.median(run[key] for run in runs) for key in runs[0]}
        if "old" in parts and size <= args.old_up_to:
            row["old_train"] = old_runs(old, corpus, args.workdir, f"{size:g}M")
        report["sizes"][f"{size:g}M"] = row
        largest = (corpus, prepared)
        print(json.dumps({f"{size:g}M": row}, indent=1), flush=True)
    if "resume" in parts:
        report["resume"] = resume(*largest, args.workdir, 10e6)
        steps = math.ceil(10e6 / (BATCH * SEQ_LEN))
        report["resume"]["old_streamed_skip_seconds"] = old_stream_skip(old, largest[0], args.workdir, steps)
        print(json.dumps({"resume": report["resume"]}, indent=1), flush=True)
    if "rates" in parts:
        report["stream_rates"] = stream_rates(largest[0], args.workdir)
        print(json.dumps({"stream_rates": report["stream_rates"]}, indent=1), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    sys.exit(main())
