"""What scoring a multiple-choice task costs (scalevec/train/task_scoring.py), on 1 and 2 processes (gloo).

The model is the miniature's 4x128 (`--model-size tiny`, the embedded tokenizer's 4,096 tokens); the task is
HellaSwag-shaped: ITEMS items of a context of about 45 words and 4 endings of about 15 (cut from the embedded
corpus, as text of its own). Each process times, REPETITIONS times after a warm-up, a task evaluation (its share of
the items, then the all-reduce of the sums, between barriers) and a training step of the miniature (8 blocks x 256
tokens per process, forward, backward, AdamW; under DDP with 2 processes), interleaved. Reported: the median
seconds of each, items per second, and the evaluation in training steps; the spread is the range over the
repetitions.

    python benchmarks/bench_tasks.py [--items 500] [--repetitions 5]
"""

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
SEQ_LEN, BATCH = 256, 8


def hellaswag_shaped(count: int):
    from scalevec.data.corpus import default_corpus_file
    from scalevec.evaluation.tasks import Task, TaskItem

    words = " ".join(json.loads(line)["text"] for line in default_corpus_file().read_text().splitlines()).split()
    rng = random.Random(0)

    def phrase(length: int) -> str:
        start = rng.randrange(len(words) - length)
        return " ".join(words[start : start + length])

    items = [TaskItem(phrase(45), tuple(phrase(15) for _ in range(4)), rng.randrange(4)) for _ in range(count)]
    return Task("hellaswag_shaped", "embedded corpus", items, count)


def worker(items: int, repetitions: int) -> None:
    """One process of the measurement (alone, or one of torchrun's); rank 0 prints a JSON line."""
    from scalevec import ScaleVecConfig, ScaleVecForCausalLM
    from scalevec.data import default_tokenizer
    from scalevec.evaluation.task_scoring import TaskEvaluation, reduce_together
    from scalevec.train.presets import size_fields

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        torch.distributed.init_process_group("gloo")
    rank = torch.distributed.get_rank() if world > 1 else 0
    tokenizer = default_tokenizer()
    torch.manual_seed(0)
    config = ScaleVecConfig(**size_fields("tiny"), vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    model = ScaleVecForCausalLM(config)
    trained = torch.nn.parallel.DistributedDataParallel(model) if world > 1 else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    task = hellaswag_shaped(items)
    evaluation = TaskEvaluation(tokenizer, rank, world, batch_size=BATCH)
    blocks = torch.randint(0, len(tokenizer), (BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(rank))

    def evaluate() -> None:
        model.eval()
        sums = evaluation.sums(model, [task])
        if world > 1:
            reduce_together(sums)

    def step() -> None:
        model.train()
        trained(input_ids=blocks, labels=blocks).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    times = {"evaluation": [], "step": []}
    for repetition in range(repetitions + 1):  # the first is a warm-up
        for name, work in (("evaluation", evaluate), ("step", step)):
            if world > 1:
                torch.distributed.barrier()
            start = time.perf_counter()
            work()
            if world > 1:
                torch.distributed.barrier()
            if repetition:
                times[name].append(time.perf_counter() - start)
    if rank == 0:
        print(json.dumps({"processes": world, "times": times}), flush=True)


def measure(processes: int, items: int, repetitions: int) -> dict:
    program = [__file__, "--worker", "--items", str(items), "--repetitions", str(repetitions)]
    if processes > 1:
        program = [
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            str(processes),
            "--master_port",
            "29541",
            *program,
        ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    result = subprocess.run([sys.executable, *program], capture_output=True, text=True, env=env, check=False)
    if result.returncode:
        raise RuntimeError(result.stderr[-3000:])
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--items", type=int, default=500)
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--worker", action="store_true")
    args = parser.parse_args()
    if args.worker:
        return worker(args.items, args.repetitions)
    sys.path.insert(0, str(ROOT))
    from _common import machine, today

    print(f"{today()}, {machine()}, one thread per process; {args.items} HellaSwag-shaped items, 4x128 model")
    print("processes | task evaluation s (median, range) | items/s | training step s (median, range) | in steps")
    for processes in (1, 2):
        times = measure(processes, args.items, args.repetitions)["times"]
        evaluation, step = statistics.median(times["evaluation"]), statistics.median(times["step"])
        spread = lambda values: f"{min(values):.2f}-{max(values):.2f}"  # noqa: E731
        print(
            f"{processes} | {evaluation:.2f} ({spread(times['evaluation'])}) | {args.items / evaluation:,.0f} | "
            f"{step:.3f} ({spread(times['step'])}) | {evaluation / step:.1f}"
        )


if __name__ == "__main__":
    main()
