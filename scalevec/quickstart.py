"""The main job, end to end (`scalevec-quickstart`): pretrain a tiny unified ScaleVec model on the embedded default
corpus, export it as `scalevec` (remote code) and as `llama`, each with its model card and picture, then load each
export back in a fresh Python process and generate a sample.

    scalevec-quickstart [--output-dir DIR] [any scalevec-train flag, e.g. --max-steps 600 --optim muon]

Layout of DIR: `run/` (the training run: checkpoint, records, `scale_vectors.png`), `scalevec/` and `llama/`.
"""

import argparse
import json
import math
import subprocess
import sys
import zlib
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer

from .atomic import exit_status, removed_if_left_empty
from .convert.card import card_writer
from .convert.errors import ConversionError
from .convert.pipeline import OutputOptions, export_checkpoint
from .data.held_out import recorded_evaluation
from .data.prepared import TOKENIZER_FOLDER, PreparedMetadata, split_file
from .run_records import RUN_PICTURE, RUN_SUMMARY, TRAINING_DATA, EvaluationRecord, duration_text, read_json
from .train.cli import parse_arguments, train
from .train.trainer import NonFiniteLossError

# Before the user's flags, which override them: 300 steps of 8 blocks of 256 tokens, about 3 CPU-seconds a step on
# an AMD EPYC server (15 CPU-minutes in all); the run prints its pace on the machine at hand at its second log.
TRAINING_DEFAULTS = [
    "--model-size", "tiny",
    "--scale-preset", "unified",
    "--max-steps", "300",
    "--per-device-train-batch-size", "8",
    "--seq-len", "256",
    "--save-strategy", "no",
    "--report-to", "none",
]  # fmt: skip
EXPORTS = ("scalevec", "llama")
PROMPT = "The Python interpreter"

# Run in a fresh interpreter: for the remote-code export, one in which the installed package cannot be imported,
# as on a machine that has only transformers.
LOAD_AND_GENERATE = """
import json, sys
remote = sys.argv[2] == "scalevec"
if remote:
    sys.modules["scalevec"] = None
from transformers import AutoModelForCausalLM, AutoTokenizer
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=remote)
tokenizer = AutoTokenizer.from_pretrained(sys.argv[1], trust_remote_code=remote)  # it reads config.json too
inputs = tokenizer(sys.argv[3], return_tensors="pt")
output = model.generate(**inputs, max_new_tokens=40, do_sample=False)
print(json.dumps({"class": type(model).__name__, "text": tokenizer.decode(output[0], skip_special_tokens=True)}))
"""


def load_and_generate(folder: Path, target: str) -> dict[str, str]:
    """The class that `from_pretrained` built from `folder` in a fresh process, and its greedy continuation."""
    command = [sys.executable, "-c", LOAD_AND_GENERATE, str(folder), target, PROMPT]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, stdin=subprocess.DEVNULL)
    if result.returncode:
        raise RuntimeError(f"loading {folder} in a fresh process failed:\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def run(output_dir: Path, train_flags: list[str], model_name: str | None = None) -> dict[str, dict[str, str]]:
    """Train, export, load back, explain; returns the sample of each export."""
    if output_dir.exists() and any(output_dir.iterdir()):
        raise ValueError(f"{output_dir} is not empty: choose a new --output-dir (nothing there is overwritten)")
    run_dir = output_dir / "run"
    arguments = parse_arguments([*TRAINING_DEFAULTS, *train_flags, "--output-dir", str(run_dir)])
    with removed_if_left_empty(output_dir):
        train(*arguments)
    samples = {}
    for target in EXPORTS:
        card = card_writer(run_dir, model_name=model_name)
        export_checkpoint(run_dir, output_dir / target, target, OutputOptions(before_commit=card))
        samples[target] = load_and_generate(output_dir / target, target)
    print(summary_text(output_dir, samples))
    return samples


def baselines(run_dir: Path) -> dict[str, float] | None:
    """What the eval loss compares with, on the same held-out blocks: guessing uniformly over the vocabulary
    (nats per token), predicting every token by its frequency in the training blocks (add-one smoothed), and
    zlib's bits per byte on the held-out text. None where the run's data was not prepared with a held-out split."""
    record = read_json(run_dir / TRAINING_DATA) or {}
    folders = [Path(source["folder"]) for source in record.get("sources", []) if "folder" in source]
    evaluation = EvaluationRecord.read(record)
    if not folders or evaluation is None or not evaluation.sets:
        return None
    metadata = PreparedMetadata.read(folders[0])
    counts = np.ones(metadata.vocab_size)
    for folder in folders:
        tokens = np.fromfile(split_file(folder, "train"), dtype=metadata.dtype)
        counts += np.bincount(tokens, minlength=len(counts))
    blocks = [block["input_ids"] for part in recorded_evaluation(evaluation).values() for block in part]
    held_out = np.concatenate(blocks)
    predicted = np.stack(blocks)[:, 1:]  # what the eval loss scores: all but a block's first
    text = AutoTokenizer.from_pretrained(folders[0] / TOKENIZER_FOLDER).decode(held_out).encode()
    return {
        "uniform": math.log(metadata.vocab_size),
        "unigram": float(-np.mean(np.log(counts[predicted] / counts.sum()))),
        "zlib_bits_per_byte": 8 * len(zlib.compress(text, 9)) / len(text),
    }


def _explained(metrics: dict, vocabulary: int, reference: dict[str, float] | None) -> list[str]:
    if "eval_loss" not in metrics:
        return ["No held-out evaluation ran (no held-out data)."]
    loss, perplexity = metrics["eval_loss"], metrics["eval_perplexity"]
    lines = [
        f"Held-out loss {loss:.3f} nats per token: perplexity {perplexity:.0f}, as unsure as a fair choice among "
        f"{perplexity:.0f} of the {vocabulary:,} tokens."
    ]
    if reference is None:
        return lines
    return lines + [
        "For scale, on the same held-out tokens:",
        f"  - guessing uniformly scores {reference['uniform']:.3f} nats (perplexity {vocabulary:,});",
        f"  - predicting each token by its frequency in the training data scores {reference['unigram']:.3f}: "
        + _beyond_frequencies(reference["unigram"] - loss),
        f"  - bits per byte {metrics['eval_bits_per_byte']:.2f}, where zlib -9 compresses the same text to "
        f"{reference['zlib_bits_per_byte']:.2f}.",
    ]


def _beyond_frequencies(gain: float) -> str:
    if gain > 0:
        return f"the model has learned {gain:.2f} nats per token of context beyond token frequencies;"
    return "the model has not learned even that much yet (train longer: --max-steps);"


def summary_text(output_dir: Path, samples: dict[str, dict[str, str]]) -> str:
    """The summary of the main job, in plain words: what the numbers mean, what to open and run next."""
    run_dir = output_dir / "run"
    summary, metrics = read_json(run_dir / RUN_SUMMARY) or {}, read_json(run_dir / "all_results.json") or {}
    config = read_json(run_dir / "config.json") or {}
    sources = [source["name"] for source in (read_json(run_dir / TRAINING_DATA) or {}).get("sources", [])]
    lines = [
        "",
        "== ScaleVec quickstart: what happened ==",
        f"Trained a {config.get('scale_preset')} ScaleVec model for {summary['steps']:,} steps on "
        f"{summary['tokens_seen']:,} tokens of {', '.join(sources)}, in {duration_text(summary['wall_seconds'])} on "
        f"{summary['hardware']}.",
        *_explained(metrics, config.get("vocab_size"), baselines(run_dir)),
        "A model this small, trained for minutes, repeats itself: the samples below show that both exports load "
        "and generate the same text, not what the architecture can do.",
    ]
    for target, sample in samples.items():
        lines += [f"  {target} ({sample['class']}): {sample['text']!r}"]
    same = len({sample["text"] for sample in samples.values()}) == 1
    lines.append(f"The exports generate {'the same' if same else 'DIFFERENT'} text.")
    lines += [
        "",
        "Open:",
        f"  {output_dir / 'scalevec' / 'README.md'} and {output_dir / 'llama' / 'README.md'}: the model cards",
        f"  {run_dir / RUN_PICTURE}: the loss and the scale vectors per layer (its caption says how to read it)",
        f"  {output_dir / 'scalevec'} (loads with trust_remote_code=True) and {output_dir / 'llama'} (a stock "
        "LlamaForCausalLM checkpoint)",
        "Next:",
        f"  scalevec-convert push {output_dir / 'scalevec'} <your-name>/<model-name>   # publish on the Hub",
        "  scalevec-train --dataset data/ --max-steps 2000 --output-dir runs/mine    # your own text/jsonl/parquet",
        "  scalevec-ablate --max-steps 300 --seeds 0,1,2 --output-dir runs/ablation  # the paper's strategies",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scalevec-quickstart", description=__doc__.split("\n\n")[0], epilog="Other flags go to scalevec-train."
    )
    parser.add_argument("--output-dir", type=Path, default=Path("runs/quickstart"), help="default runs/quickstart")
    parser.add_argument("--model-name", help="the model cards' title (default: the model's kind and size)")
    args, train_flags = parser.parse_known_args(argv)
    expected = (ValueError, NonFiniteLossError, ConversionError, RuntimeError)
    return exit_status("scalevec-quickstart", lambda: run(args.output_dir, train_flags, args.model_name), expected)


if __name__ == "__main__":
    sys.exit(main())
