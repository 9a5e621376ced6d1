"""The data path at three corpus sizes, against the pipeline it replaced (the revision before it, run from a git
archive in the same session): preparation (1 and N processes), peak memory and time to the first step of a training
process, resuming after >= 10 M consumed tokens on the prepared and the streamed path, and streamed tokens per second
per rank under `torchrun`.

Issue 38's parts (`--parts share,speed,kill,feed`, on the largest size): the share of a 17-file stream that each of two
ranks tokenises (against the revision before it); preparation against `encode_batch_fast` on the same text; a
preparation killed half-way and run again; and the rate at which a rank's DataLoader feeds prepared blocks, from the
page cache and cold (the file's pages dropped with `posix_fadvise(DONTNEED)` before each pass), bare and under a
training step that takes `--step-seconds`.

The corpus is real text nobody here wrote: every .py, .txt, .rst and .md file of this Python's standard library and
site-packages, one document per file, de-duplicated, in 16 JSON-lines shards (17 for `share`); each size is a prefix.

    python benchmarks/bench_data.py [--sizes 10,30,85] [--old-revision 3d87363] [--workdir /tmp/bench-data]
    python benchmarks/bench_data.py --sizes 40 --parts share,speed,kill,feed --old-revision main

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


def build_corpus(folder: Path, tokens: float, shards: int = SHARDS) -> Path:
    """The first documents of the corpus adding up to about `tokens` tokens, in `shards` shards."""
    target = folder / (f"corpus-{tokens / 1e6:g}M" + ("" if shards == SHARDS else f"-{shards}"))
    if (target / "done").exists():
        return target
    target.mkdir(parents=True, exist_ok=True)
    budget, seen, written = tokens * BYTES_PER_TOKEN, set(), 0
    files = [open(target / f"part-{index:02d}.jsonl", "w") for index in range(shards)]  # noqa: SIM115
    for number, path in enumerate(corpus_files()):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        digest = hashlib.sha1(text.encode()).digest()
        if not text.strip() or digest in seen:
            continue
        seen.add(digest)
        files[number % shards].write(json.dumps({"text": text}) + "\n")
        written += len(text.encode())
        if written >= budget:
            break
    for file in files:
        file.close()
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


def launch(world: int) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(world)]


STREAM_SHARE = """
import json, os, sys, time
from scalevec.data import default_tokenizer, find_source
from scalevec.data.streaming import streamed_blocks
from scalevec.data.tokenization import DocumentEncoder
rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
tokenised, encode = [0], DocumentEncoder.__call__


def counting(self, texts):
    ids = encode(self, texts)
    tokenised[0] += sum(len(document) for document in ids)
    return ids


DocumentEncoder.__call__ = counting
tokenizer, source = default_tokenizer(), find_source(sys.argv[1])
start = time.perf_counter()
stream = streamed_blocks([source], [1.0], tokenizer, 256, 0, 1000, [frozenset()], rank, world, endless=False)
blocks = sum(1 for _ in stream)
result = {"tokenised": tokenised[0], "delivered": blocks * 256, "seconds": time.perf_counter() - start}
with open(f"{sys.argv[2]}-rank{rank}.json", "w") as file:
    json.dump(result, file)
"""


def stream_shares(corpus: Path, workdir: Path, old: Path) -> dict:
    """One pass over a 17-file stream by one process, then by each of two ranks: the share of the one process's
    tokens that each rank tokenises, and the tokens per second it delivers; this revision and the one before."""
    script = workdir / "stream_share.py"
    script.write_text(STREAM_SHARE)
    results = {}
    for name, path in (("new", str(ROOT)), ("old", str(old))):
        env = {"TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": path}  # one tokenizer thread (core) per process
        runs = {}
        for world in (1, 2):
            prefix = workdir / f"share-{name}-{world}"
            timed([*launch(world), str(script), str(corpus), str(prefix)], env=env)
            runs[world] = [json.loads(Path(f"{prefix}-rank{r}.json").read_text()) for r in range(world)]
        (alone,) = runs[1]
        results[name] = {
            "one_process_tokens_per_second": alone["delivered"] / alone["seconds"],
            "shares": [rank["tokenised"] / alone["tokenised"] for rank in runs[2]],
            "rank_tokens_per_second": [rank["delivered"] / rank["seconds"] for rank in runs[2]],
        }
        print(json.dumps({name: results[name]}), flush=True)
    return results


PREPARE_SPEED = """
import hashlib, json, shutil, sys, time
from pathlib import Path
import numpy as np
from scalevec.data import PrepareOptions, default_tokenizer, find_source, prepare
from scalevec.data.sources import read_documents
from scalevec.data.tokenization import CHARS_PER_CALL, DocumentEncoder, text_pieces, token_dtype

corpus, workdir, seq_len, repetitions = Path(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
tokenizer = default_tokenizer()
source = find_source(str(corpus))
texts = [text for shard in source.shards() for text in read_documents(shard) if text]
pieces = [text_pieces(text) for text in texts]
flat = [piece for parts in pieces for piece in parts]
calls, start = [], 0  # the calls of the tokenizer that preparing makes: up to CHARS_PER_CALL characters each
while start < len(flat):
    end, chars = start, 0
    while end < len(flat) and (end == start or chars + len(flat[end]) <= CHARS_PER_CALL):
        chars, end = chars + len(flat[end]), end + 1
    calls.append(flat[start:end])
    start = end
backend = DocumentEncoder(tokenizer, token_dtype(len(tokenizer))).backend


def encoding(method):
    start = time.perf_counter()
    for call in calls:
        [encoding.ids for encoding in getattr(backend, method)(call, add_special_tokens=False)]
    return time.perf_counter() - start


rounds = []
for round in range(repetitions):  # interleaved
    output = workdir / f"speed-{seq_len}"
    shutil.rmtree(output, ignore_errors=True)
    fast, slow = encoding("encode_batch_fast"), encoding("encode_batch")
    start = time.perf_counter()
    metadata = prepare([source], tokenizer, PrepareOptions(seq_len, eval_every=0), output, progress=False)
    rounds.append({"encode_batch_fast": fast, "encode_batch": slow, "prepare": time.perf_counter() - start})
encoded = (e for call in calls for e in backend.encode_batch_fast(call, add_special_tokens=False))
ids = (np.asarray(encoding.ids, dtype=np.uint16) for encoding in encoded)
eos = np.array([tokenizer.eos_token_id], dtype=np.uint16)
stream = np.concatenate([part for parts in pieces for part in [*(next(ids) for _ in parts), eos]])
train = np.fromfile(output / "train.bin", dtype=np.uint16)
same = bool(np.array_equal(stream[: len(train)], train)) and len(stream) - len(train) < seq_len
print(json.dumps({"tokens": int(len(stream)), "rounds": rounds, "same_ids": same}))
"""


def prepare_speed(corpus: Path, workdir: Path, seq_len: int, repetitions: int) -> dict:
    """`prepare` against the fast tokenizer's `encode_batch_fast` (and `encode_batch`) on the same documents, cut
    into the same calls, in one process, interleaved; and whether the prepared ids are the encoder's."""
    script = workdir / "prepare_speed.py"
    script.write_text(PREPARE_SPEED)
    command = [sys.executable, str(script), str(corpus), str(workdir), str(seq_len), str(repetitions)]
    result = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    if result.returncode:
        raise RuntimeError(result.stderr[-3000:])
    report = json.loads(result.stdout.strip().splitlines()[-1])
    rounds = report.pop("rounds")
    for key in ("encode_batch_fast", "encode_batch", "prepare"):
        report[f"{key}_tokens_per_second"] = statistics.median(report["tokens"] / row[key] for row in rounds)
    report["prepare_over_fast"] = [row["encode_batch_fast"] / row["prepare"] for row in rounds]
    return report


def folder_digest(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*")):
        if path.is_file():
            digest.update(str(path.relative_to(folder)).encode() + path.read_bytes())
    return digest.hexdigest()


def prepare_command(corpus: Path, output: Path, seq_len: int) -> list[str]:
    arguments = ["prepare", str(corpus), "--output", str(output), "--seq-len", str(seq_len), "--quiet"]
    return [sys.executable, "-m", "scalevec.data.cli", *arguments]


def saved_share(staging: Path, tokens: int) -> float:
    """The share of `tokens` that the progress saved in `staging` says are written."""
    try:
        progress = json.loads((staging / "progress.json").read_text())
    except (OSError, ValueError):
        return 0.0
    return progress["train"]["info"]["tokens"] / tokens if "train" in progress else 0.0


def kill_and_resume(corpus: Path, workdir: Path, seq_len: int, repetitions: int) -> list[dict]:
    """A preparation killed (SIGKILL) once its saved progress has passed half of the training tokens, half a save
    interval later (the work lost to a kill at a random moment, on average), then run again: the second run's time
    against an uninterrupted one's, the share of the tokens saved at the kill, and whether the folder is the
    uninterrupted one, byte for byte."""
    from scalevec.data.preparation import CHECKPOINT_SECONDS

    rows = []
    for round in range(repetitions):
        full, killed = workdir / f"kill-full-{round}", workdir / f"kill-{round}"
        staging = killed.with_name(f".{killed.name}.staging")
        for folder in (full, killed, staging):
            shutil.rmtree(folder, ignore_errors=True)
        whole = timed(prepare_command(corpus, full, seq_len))["seconds"]
        tokens = json.loads((full / "scalevec_data.json").read_text())["splits"]["train"]["tokens"]
        environment, command = {**os.environ, "OMP_NUM_THREADS": "2"}, prepare_command(corpus, killed, seq_len)
        process = subprocess.Popen(command, env=environment, cwd=tempfile.gettempdir())
        while saved_share(staging, tokens) < 0.5:
            time.sleep(0.05)
        time.sleep(CHECKPOINT_SECONDS / 2)
        process.kill()
        process.wait()
        saved = saved_share(staging, tokens)
        again = timed(prepare_command(corpus, killed, seq_len))["seconds"]
        equal = folder_digest(killed) == folder_digest(full)
        rows.append({"full_seconds": whole, "saved_share": saved, "rerun_seconds": again, "equal": equal})
        print(json.dumps(rows[-1]), flush=True)
    return rows


FEED = """
import json, sys, time
import torch
from scalevec.data import PackedBlockCollator, PreparedBlocks

folder, workers, batch, count, step = sys.argv[1], *map(int, sys.argv[2:5]), float(sys.argv[5])
data = PreparedBlocks(folder)
sampler = torch.utils.data.RandomSampler(data, generator=torch.Generator().manual_seed(0))
collate = PackedBlockCollator(0)
loader = torch.utils.data.DataLoader(data, batch, sampler=sampler, collate_fn=collate, num_workers=workers)
batches = iter(loader)
waited, tokens, start = 0.0, 0, time.perf_counter()
for _ in range(count):
    asked = time.perf_counter()
    tokens += next(batches)["input_ids"].numel()
    waited += time.perf_counter() - asked
    time.sleep(step)  # the training step (a GPU's: the CPU is free meanwhile)
seconds = time.perf_counter() - start
print(json.dumps({"tokens_per_second": tokens / seconds, "wait_ms_per_step": 1000 * waited / count}))
"""


def resident_bytes(path: Path) -> int | None:
    """How much of `path` is in the page cache (`fincore`), where the tool is there."""
    if not shutil.which("fincore"):
        return None
    result = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)], capture_output=True)
    return int(result.stdout.split()[0]) if result.returncode == 0 else None


def feed_rates(folder: Path, workdir: Path, old: Path, repetitions: int, step: float) -> dict:
    """Tokens per second that one rank's DataLoader delivers from a prepared folder (32 x its block length, random
    order): the new default (2 workers, prefetch) against the revision before (in the training process), from the
    page cache and cold, with no training step and with a step of `step` seconds (then also the mean wait)."""
    script = workdir / "feed.py"
    script.write_text(FEED)
    train = folder / "train.bin"
    passes = json.loads((folder / "scalevec_data.json").read_text())["splits"]["train"]["blocks"] // 32
    results: dict[str, list] = {}
    for _ in range(repetitions):
        for cache in ("warm", "cold"):
            for name, path, workers in (("new", ROOT, 2), ("old", old, 0)):
                for label, count, seconds in (("bare", passes, 0.0), ("stepped", min(passes, 150), step)):
                    descriptor = os.open(train, os.O_RDONLY)
                    if cache == "cold":
                        os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
                    else:
                        while os.read(descriptor, 1 << 24):  # into the page cache
                            pass
                    os.close(descriptor)
                    resident = resident_bytes(train)
                    command = [sys.executable, str(script), str(folder), str(workers), "32", str(count), str(seconds)]
                    result = subprocess.run(
                        command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(path)}
                    )
                    if result.returncode:
                        raise RuntimeError(result.stderr[-3000:])
                    row = {**json.loads(result.stdout.strip().splitlines()[-1]), "resident_before": resident}
                    results.setdefault(f"{name} {cache} {label}", []).append(row)
    summary = {}
    for key, rows in results.items():
        summary[key] = {
            field: statistics.median(row[field] for row in rows) for field in rows[0] if field != "resident_before"
        }
        summary[key]["resident_before"] = [row["resident_before"] for row in rows]
    return summary


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
        help="what to measure (without prepare: the folders a previous run prepared); also share,speed,kill,feed",
    )
    parser.add_argument("--feed-seq-len", type=int, default=2048, help="block length of `speed`, `kill` and `feed`")
    parser.add_argument("--step-seconds", type=float, default=0.05, help="the training step that `feed` simulates")
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
    if "share" in parts:
        report["stream_shares"] = stream_shares(build_corpus(args.workdir, size * 1e6, shards=17), args.workdir, old)
    if "speed" in parts:
        report["prepare_speed"] = prepare_speed(largest[0], args.workdir, args.feed_seq_len, args.repetitions)
        print(json.dumps({"prepare_speed": report["prepare_speed"]}, indent=1), flush=True)
    if "kill" in parts:
        report["kill_and_resume"] = kill_and_resume(largest[0], args.workdir, args.feed_seq_len, 2)
    if "feed" in parts:
        folder = args.workdir / f"speed-{args.feed_seq_len}"  # prepared by `speed`
        report["feed"] = feed_rates(folder, args.workdir, old, args.repetitions, args.step_seconds)
        print(json.dumps({"feed": report["feed"]}, indent=1), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    sys.exit(main())
