"""The main job, end to end (`scalevec-quickstart`): pretrain a tiny unified ScaleVec model on the embedded default
corpus, export it as `scalevec` (remote code) and as `llama`, each with its model card and picture, then load each
export back in a fresh Python process and generate a sample.

    scalevec-quickstart [--output-dir DIR] [any scalevec-train flag, e.g. --max-steps 600 --optim muon]

Layout of DIR: `run/` (the training run: checkpoint, records, `scale_vectors.png`), `scalevec/` and `llama/`.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

from .atomic import describe_os_error, removed_if_left_empty
from .convert.card import card_writer
from .convert.errors import ConversionError
from .convert.pipeline import OutputOptions, export_checkpoint
from .train.cli import parse_arguments, train
from .train.trainer import NonFiniteLossError

# Before the user's flags, which override them: about three minutes on two CPU cores.
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


def run(output_dir: Path, train_flags: list[str]) -> dict[str, dict[str, str]]:
    """Train, export, load back; returns the sample of each export."""
    if output_dir.exists() and any(output_dir.iterdir()):
        raise ValueError(f"{output_dir} is not empty: choose a new --output-dir (nothing there is overwritten)")
    run_dir = output_dir / "run"
    arguments = parse_arguments([*TRAINING_DEFAULTS, *train_flags, "--output-dir", str(run_dir)])
    with removed_if_left_empty(output_dir):
        metrics = train(*arguments).metrics
    samples = {}
    for target in EXPORTS:
        export_checkpoint(run_dir, output_dir / target, target, OutputOptions(before_commit=card_writer(run_dir)))
        samples[target] = load_and_generate(output_dir / target, target)
    _report(output_dir, metrics, samples)
    return samples


def _report(output_dir: Path, metrics: dict, samples: dict[str, dict[str, str]]) -> None:
    print("\n== ScaleVec quickstart ==")
    for key in ("train_loss", "eval_loss", "eval_perplexity", "eval_bits_per_byte"):
        if key in metrics:
            print(f"{key:>20}: {metrics[key]:.4f}")
    for target, sample in samples.items():
        print(f"\n{output_dir / target} loads as {sample['class']} in a fresh process; greedy sample:")
        print(f"  {sample['text']!r}")
    same = len({sample["text"] for sample in samples.values()}) == 1
    print(f"\nthe exports generate {'the same' if same else 'different'} text")
    print(f"publish with: scalevec-convert push {output_dir / 'scalevec'} <your-name>/<model-name>")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="scalevec-quickstart", description=__doc__.split("\n\n")[0], epilog="Other flags go to scalevec-train."
    )
    parser.add_argument("--output-dir", type=Path, default=Path("runs/quickstart"), help="default runs/quickstart")
    args, train_flags = parser.parse_known_args(argv)
    try:
        run(args.output_dir, train_flags)
    except (ValueError, NonFiniteLossError, ConversionError, RuntimeError) as error:
        print(f"scalevec-quickstart: error: {error}", file=sys.stderr)
        return 1
    except OSError as error:
        print(f"scalevec-quickstart: error: {describe_os_error(error)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
