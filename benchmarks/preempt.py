"""Preemption: kill a real `scalevec-train` (SIGKILL) at each phase of a checkpoint save and at random moments,
restart it with the same command plus `--resume` until it finishes, and count the restarts whose run reproduces
the uninterrupted run's losses (every logged step, to 1e-5) and final weights.

    python benchmarks/preempt.py [--steps 20] [--save-steps 5] [--random-kills 5] [--workdir runs/preempt]

A phase is caught by polling the output folder for the file that begins it, then killing at once; the save may
have moved on by the time the signal lands, so the table says what the folder held when the process was dead.
"""

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from _common import machine, today
from safetensors.torch import load_file

TOLERANCE = 1e-5
POLL_SECONDS = 0.0002

# The files that begin each phase of saving checkpoint-N (N = the first save), relative to the output folder.
# `{n}` is the step. The last phase is the final result of the run, staged the same way.
SAVE_PHASES = {
    "staging folder created": ".checkpoint-{n}.staging",
    "weights written": ".checkpoint-{n}.staging/checkpoint-{n}/model.safetensors",
    "optimizer written": ".checkpoint-{n}.staging/checkpoint-{n}/optimizer.pt",
    "scheduler written": ".checkpoint-{n}.staging/checkpoint-{n}/scheduler.pt",
    "trainer state written": ".checkpoint-{n}.staging/checkpoint-{n}/trainer_state.json",
    "renamed into place": "checkpoint-{n}",
    "final result staged": ".result.staging",
}


def train_command(output: Path, steps: int, save_steps: int, resume: bool) -> list[str]:
    flags = [
        *("--model-size", "tiny", "--seq-len", "64", "--per-device-train-batch-size", "4"),
        *("--max-documents", "300", "--eval-every", "0", "--max-steps", str(steps), "--logging-steps", "1"),
        *("--save-strategy", "steps", "--save-steps", str(save_steps), "--save-total-limit", "2"),
        *("--report-to", "none", "--disable-tqdm", "true", "--output-dir", str(output)),
    ]
    return [sys.executable, "-m", "scalevec.train.cli", *flags, *(["--resume", "true"] if resume else [])]


def start(command: list[str], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL) -> subprocess.Popen:
    """Unread output goes nowhere: a full pipe would stop the run. Unbuffered, to read steps as they happen."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(command, stdout=stdout, stderr=stderr, stdin=subprocess.DEVNULL, text=True, env=env)


def run_to_the_end(command: list[str]) -> None:
    process = start(command, stderr=subprocess.PIPE)
    _, err = process.communicate()
    if process.returncode:
        raise RuntimeError(f"{' '.join(command[3:])} failed:\n{err[-3000:]}")


def kill_when_present(process: subprocess.Popen, marker: Path) -> bool:
    """SIGKILL `process` as soon as `marker` exists; False if the process ended first."""
    while not marker.exists():
        if process.poll() is not None:
            return False
        time.sleep(POLL_SECONDS)
    process.send_signal(signal.SIGKILL)
    process.wait()
    return True


def kill_after_steps(process: subprocess.Popen, steps: int, delay: float) -> bool:
    """SIGKILL `process` `delay` seconds after it logged its `steps`-th step; False if it ended first."""
    logged = 0
    for line in process.stdout:
        logged += line.startswith("{'loss'")
        if logged == steps:
            time.sleep(delay)
            process.send_signal(signal.SIGKILL)
            process.communicate()
            return True
    process.communicate()
    return False


KEY_FILES = ("model.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json")


def what_is_left(output: Path) -> str:
    """The checkpoint folders in `output`, and which key files the staging folders hold."""
    entries = []
    for path in sorted(output.iterdir()) if output.exists() else []:
        if path.name.startswith("."):
            inside = {p.name for p in path.rglob("*")}
            entries.append(f"{path.name} ({', '.join(n for n in KEY_FILES if n in inside) or 'empty'})")
        elif "checkpoint" in path.name:
            entries.append(path.name)
    return ", ".join(entries) or "nothing"


def newest_checkpoint_step(output: Path) -> int:
    steps = [int(path.name.split("-")[1]) for path in output.glob("checkpoint-*")] if output.exists() else []
    return max(steps, default=0)


def losses(output: Path) -> list[float]:
    history = json.loads((output / "trainer_state.json").read_text())["log_history"]
    return [entry["loss"] for entry in history if "loss" in entry]


@dataclass
class Outcome:
    kill: str
    left: str
    restarts: int
    set_aside: int
    loss_error: float
    weight_error: float

    @property
    def reproduced(self) -> bool:
        return self.loss_error <= TOLERANCE and self.weight_error <= TOLERANCE


def compare(output: Path, reference: Path, kill: str, left: str, restarts: int) -> Outcome:
    got, expected = losses(output), losses(reference)
    loss_error = max(abs(a - b) for a, b in zip(got, expected, strict=True)) if len(got) == len(expected) else 1.0
    a, b = load_file(output / "model.safetensors"), load_file(reference / "model.safetensors")
    weight_error = max(float((a[name] - b[name]).abs().max()) for name in b)
    set_aside = len(list(output.glob("incomplete-checkpoint-*")))
    return Outcome(kill, left, restarts, set_aside, loss_error, weight_error)


def phase_kill(workdir: Path, reference: Path, phase: str, args) -> Outcome:
    output = workdir / phase.replace(" ", "-")
    shutil.rmtree(output, ignore_errors=True)
    marker = output / SAVE_PHASES[phase].format(n=args.save_steps)
    killed = kill_when_present(start(train_command(output, args.steps, args.save_steps, False)), marker)
    left = what_is_left(output) if killed else "(finished before the kill)"
    run_to_the_end(train_command(output, args.steps, args.save_steps, True))
    return compare(output, reference, f"save phase: {phase}", left, 1)


def random_kills(workdir: Path, reference: Path, args) -> Outcome:
    """One run killed `args.random_kills` times, each time a random number of steps into the attempt and a random
    fraction of a step later, and restarted with `--resume` after each kill."""
    output = workdir / "random"
    shutil.rmtree(output, ignore_errors=True)
    generator = random.Random(args.seed)
    kills = []
    while len(kills) < args.random_kills:
        done = newest_checkpoint_step(output)
        if done + 1 >= args.steps:
            break
        steps = generator.randint(1, min(args.save_steps + 2, args.steps - done - 1))
        process = start(train_command(output, args.steps, args.save_steps, resume=bool(kills)), stdout=subprocess.PIPE)
        if not kill_after_steps(process, steps, delay=generator.uniform(0, 0.05)):
            break
        kills.append(f"step {done + steps}")
    left = what_is_left(output)
    run_to_the_end(train_command(output, args.steps, args.save_steps, True))
    return compare(output, reference, f"random: {len(kills)} kills, after {', '.join(kills)}", left, len(kills))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--save-steps", type=int, default=5)
    parser.add_argument("--random-kills", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--workdir", type=Path, default=Path("runs/preempt"))
    args = parser.parse_args()
    reference = args.workdir / "uninterrupted"
    shutil.rmtree(reference, ignore_errors=True)
    began = time.perf_counter()
    run_to_the_end(train_command(reference, args.steps, args.save_steps, False))
    duration = time.perf_counter() - began
    outcomes = [phase_kill(args.workdir, reference, phase, args) for phase in SAVE_PHASES]
    outcomes.append(random_kills(args.workdir, reference, args))

    print(f"{today()}, {machine()}; {args.steps} steps, a checkpoint every {args.save_steps} (at most 2 kept), ")
    print(f"uninterrupted run {duration:.1f} s; tolerance {TOLERANCE:g} on every logged loss and every weight\n")
    print("| kill | folder when dead | restarts | set aside | max abs loss diff | max abs weight diff | reproduced |")
    print("|---|---|---|---|---|---|---|")
    for o in outcomes:
        print(
            f"| {o.kill} | {o.left} | {o.restarts} | {o.set_aside} | {o.loss_error:.1e} | {o.weight_error:.1e} "
            f"| {'yes' if o.reproduced else 'NO'} |"
        )
    restarts = sum(o.restarts for o in outcomes)
    good = sum(o.restarts for o in outcomes if o.reproduced)
    print(f"\n{good} of {restarts} restarts reproduced the uninterrupted run")


if __name__ == "__main__":
    main()
