"""scalevec-eval against lm-evaluation-harness (lm-eval) on the same items and model: whole commands, interleaved.

The model: a SIZE ScaleVec (random weights, scales in [0.7, 1.3], the embedded tokenizer's 4,096 tokens) exported
to Llama (`scalevec-convert export --to llama`), the folder both commands load. The task: ITEMS HellaSwag-shaped
items (a context of 45 words and 4 endings of 15, cut from the embedded corpus), one jsonl that scalevec-eval reads
and a local lm-eval task over it (`output_type: multiple_choice`). A first run of each writes its scores (lm-eval
its samples too); then REPETITIONS rounds run the two commands in turn, each first in every other round
(`scalevec-eval --batch-size B`, `lm_eval --batch_size B`; CPU, float32, offline, THREADS torch threads each),
timing each whole command (start-up, loading, scoring) and its scoring alone (the seconds scalevec-eval prints;
lm-eval's progress bar over its requests, to the second). Reported: medians and ranges, the ratios of the medians,
the tokens each feeds (lm-eval: one input per choice, less its batches' padding), both commands' acc and acc_norm,
and the largest difference of a choice's log-likelihood (lm-eval's samples against `TaskEvaluation`).

    python benchmarks/bench_tasks.py [--items 300] [--size 6x384] [--batch-size 8] [--repetitions 3]
"""

import argparse
import contextlib
import io
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent  # the environment's console scripts
sys.path.insert(0, str(ROOT))


def write_items(path: Path, count: int) -> None:
    from scalevec.data.corpus import default_corpus_file

    words = " ".join(json.loads(line)["text"] for line in default_corpus_file().read_text().splitlines()).split()
    rng = random.Random(0)

    def phrase(length: int) -> str:
        start = rng.randrange(len(words) - length)
        return " ".join(words[start : start + length])

    with open(path, "w") as lines:
        for _ in range(count):
            record = {"context": phrase(45), "choices": [phrase(15) for _ in range(4)], "gold": rng.randrange(4)}
            lines.write(json.dumps(record) + "\n")


def export_model(workdir: Path, size: str) -> Path:
    from scalevec import ScaleVecConfig, ScaleVecForCausalLM
    from scalevec.convert.cli import main as convert
    from scalevec.data import default_tokenizer
    from scalevec.train.presets import size_fields

    tokenizer = default_tokenizer()
    torch.manual_seed(0)
    config = ScaleVecConfig(**size_fields(size), vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    model = ScaleVecForCausalLM(config)
    with torch.no_grad():
        for names in model.scale_vector_roles().values():
            for name in names:
                model.get_parameter(name).uniform_(0.7, 1.3)
    model.save_pretrained(workdir / "scalevec")
    tokenizer.save_pretrained(workdir / "scalevec")
    with contextlib.redirect_stdout(io.StringIO()):
        failed = convert(["export", str(workdir / "scalevec"), str(workdir / "llama"), "--to", "llama", "-q"])
    if failed:
        raise RuntimeError("the Llama export failed")
    return workdir / "llama"


def commands(model: Path, workdir: Path, items: int, batch_size: int) -> dict[str, list[str]]:
    scalevec = [
        str(BIN / "scalevec-eval"),
        str(model),
        "--tasks",
        str(workdir / "items.jsonl"),
        "--task-examples",
        str(items),
    ]
    lm_eval = [str(BIN / "lm_eval"), "--model", "hf", "--model_args", f"pretrained={model},dtype=float32", "--tasks"]
    lm_eval += ["items_task", "--include_path", str(workdir), "--device", "cpu"]
    return {
        "scalevec-eval": [*scalevec, "--batch-size", str(batch_size)],
        "lm-eval": [*lm_eval, "--batch_size", str(batch_size)],
    }


def run(command: list[str], env: dict) -> str:
    """The command's output (stdout, then stderr), or its error."""
    result = subprocess.run(command, capture_output=True, text=True, env=env, check=False)
    if result.returncode:
        raise RuntimeError(f"{command[0]} failed:\n{result.stderr[-3000:]}")
    return result.stdout + result.stderr


def scoring_seconds(name: str, output: str) -> float:
    """The scoring alone: the seconds scalevec-eval prints, the time lm-eval's progress bar gives its requests."""
    if name == "scalevec-eval":
        return float(re.search(r"^in ([\d.]+) s$", output, re.M).group(1))
    *_, (hours, minutes, seconds) = re.findall(
        r"Running loglikelihood requests: 100%.*?\[(?:(\d+):)?(\d+):(\d+)<", output
    )
    return 3600 * int(hours or 0) + 60 * int(minutes) + int(seconds)


def agreement(tokenizer, model, workdir: Path, task) -> tuple[dict, dict, float]:
    """Both commands' acc and acc_norm (from their first runs' files), and the largest difference of a choice's
    log-likelihood between lm-eval's samples and `TaskEvaluation` on the same folder."""
    from scalevec.evaluation.task_scoring import TaskEvaluation

    ours = json.loads((workdir / "scalevec.json").read_text())["tasks"]["items"]
    (results,) = (workdir / "lm_eval").rglob("results_*.json")
    theirs = json.loads(results.read_text())["results"]["items_task"]
    (samples,) = (workdir / "lm_eval").rglob("samples_items_task_*.jsonl")
    scored = dict(TaskEvaluation(tokenizer).loglikelihoods(model, task.items))
    largest = max(
        abs(mine - float(reference))  # lm-eval writes its samples' numbers as strings
        for sample in map(json.loads, samples.read_text().splitlines())
        for mine, (reference, _) in zip(scored[sample["doc_id"]], sample["filtered_resps"])
    )
    return ours, {"acc": theirs["acc,none"], "acc_norm": theirs["acc_norm,none"]}, largest


def tokens_fed(tokenizer, model, task, batch_size: int) -> tuple[int, int]:
    """(scalevec-eval's tokens fed, one input per choice: what lm-eval feeds, less its batches' padding)."""
    from scalevec.evaluation.task_scoring import encode_pair, fed_tokens

    inputs = [encode_pair(tokenizer, *request) for item in task.items for request in item.requests()]
    ours = fed_tokens(tokenizer, [task], model, batch_size)
    return ours, sum(len(context) + len(continuation) - 1 for context, continuation in inputs)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--items", type=int, default=300)
    parser.add_argument("--size", default="6x384", help="the ScaleVec size exported (LAYERSxHIDDEN or a preset)")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each command")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-tasks-") as workdir:
        measure(args, Path(workdir))


def measure(args: argparse.Namespace, workdir: Path) -> None:
    from _common import today

    write_items(workdir / "items.jsonl", args.items)
    (workdir / "items_task.yaml").write_text(
        f"task: items_task\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {workdir / 'items.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: context\ndoc_to_choice: choices\n"
        "doc_to_target: gold\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    folder = export_model(workdir, args.size)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    env["TOKENIZERS_PARALLELISM"] = "false"
    steps = commands(folder, workdir, args.items, args.batch_size)
    run([*steps["scalevec-eval"], "--output", str(workdir / "scalevec.json")], env)
    run([*steps["lm-eval"], "--output_path", str(workdir / "lm_eval"), "--log_samples"], env)
    times = {name: {"whole": [], "scoring": []} for name in steps}
    for turn in range(args.repetitions):  # the two in turn, each first in every other round
        for name in list(steps)[:: 1 if turn % 2 == 0 else -1]:
            start = time.perf_counter()
            output = run(steps[name], env)
            times[name]["whole"].append(time.perf_counter() - start)
            times[name]["scoring"].append(scoring_seconds(name, output))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from scalevec.evaluation.tasks import load_tasks

    tokenizer, loaded = AutoTokenizer.from_pretrained(folder), AutoModelForCausalLM.from_pretrained(folder).eval()
    (task,) = load_tasks([str(workdir / "items.jsonl")], args.items)
    ours, theirs, largest = agreement(tokenizer, loaded, workdir, task)
    fed, per_choice = tokens_fed(tokenizer, loaded, task, args.batch_size)
    median = {
        name: {kind: statistics.median(values) for kind, values in kinds.items()} for name, kinds in times.items()
    }
    print(
        f"{today()}, {os.cpu_count()} CPUs, {args.threads} thread(s) a command, load average "
        f"{os.getloadavg()[0]:.1f} at the end; {args.items} items of 4 choices, a {args.size} Llama export "
        f"({sum(p.numel() for p in loaded.parameters()):,} parameters), batch size {args.batch_size}, "
        f"{args.repetitions} rounds"
    )
    print(
        "command | whole command, s (median, range) | scoring alone, s (median, range) | tokens fed | acc | acc_norm"
    )
    print("---|---|---|---|---|---")
    for name, tokens, score in (("scalevec-eval", fed, ours), ("lm-eval", per_choice, theirs)):
        cells = [f"{median[name][kind]:.1f} ({min(times[name][kind]):.1f}-{max(times[name][kind]):.1f})"
                 for kind in ("whole", "scoring")]  # fmt: skip
        print(f"{name} | {' | '.join(cells)} | {tokens:,} | {score['acc']:.4f} | {score['acc_norm']:.4f}")
    ratio = {kind: median["lm-eval"][kind] / median["scalevec-eval"][kind] for kind in ("whole", "scoring")}
    print(
        f"lm-eval / scalevec-eval (medians): {ratio['whole']:.2f}x whole commands, {ratio['scoring']:.2f}x scoring "
        f"alone; largest log-likelihood difference {largest:.2e}"
    )


if __name__ == "__main__":
    main()
