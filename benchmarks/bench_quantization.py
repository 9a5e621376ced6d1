"""What weight-only quantization costs each scale-vector strategy: tiny none / standard / unified models trained with
`scalevec-train` (one run per strategy and seed, all with the same data and steps), then the held-out loss of each
unquantized, with int8 and with int4 weights (`scalevec/evaluation/quantization.py`), on the run's own held-out blocks
through the training loop's exact evaluation. Reports per strategy the median difference over seeds and its range, and
the kurtosis of the residual stream (largest over layers) that the run logged at its last evaluation.

Usage: python benchmarks/bench_quantization.py [--output-dir runs/quantization] [--size 4x128] [--steps 300]
       [--seeds 0,1,2] [--strategies none,standard,unified]
Finished runs and their measurements in --output-dir are reused, so processes can share the work by strategy
(`--strategies none`, ...) and a last call with every strategy prints the table.
"""

import argparse
import copy
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks._common import machine, today  # noqa: E402
from scalevec import ScaleVecForCausalLM  # noqa: E402
from scalevec.atomic import write_text_atomically  # noqa: E402
from scalevec.data.build import DataArguments, build_training_data, load_tokenizer  # noqa: E402
from scalevec.data.collator import PackedBlockCollator  # noqa: E402
from scalevec.evaluation.quantization import QUANTIZATION_SCHEMES, quantize_weights  # noqa: E402
from scalevec.train import ScaleVecTrainer, ScaleVecTrainingArguments  # noqa: E402

STRATEGIES = ("none", "standard", "unified")
SEQ_LEN = 128
MAX_EVAL_TOKENS = 1 << 16


def train_run(output_dir: Path, strategy: str, seed: int, size: str, steps: int) -> Path:
    run = output_dir / f"{size}-{steps}steps-{strategy}-seed{seed}"
    argv = [
        sys.executable, "-m", "scalevec.train.cli", "--model-size", size, "--scale-preset", strategy,
        "--seed", str(seed), "--max-steps", str(steps), "--per-device-train-batch-size", "8",
        "--seq-len", str(SEQ_LEN), "--learning-rate", "3e-3", "--max-eval-tokens", str(MAX_EVAL_TOKENS),
        "--eval-strategy", "no", "--logging-steps", str(steps // 5), "--save-strategy", "no",
        "--report-to", "none", "--disable-tqdm", "true", "--resume", "true", "--output-dir", str(run),
    ]  # fmt: skip
    subprocess.run(argv, check=True, stdout=subprocess.DEVNULL)
    return run


def held_out_losses(run: Path, seed: int) -> dict[str, float]:
    """The held-out loss of the run's model (trained with `seed`) as trained and with each scheme's weights."""
    data_args = DataArguments(seq_len=SEQ_LEN, max_eval_tokens=str(MAX_EVAL_TOKENS))
    tokenizer = load_tokenizer(data_args)
    data = build_training_data(data_args, tokenizer, seed, progress=False)
    trained = ScaleVecForCausalLM.from_pretrained(run).eval()
    losses = {}
    for scheme in ("as trained", *QUANTIZATION_SCHEMES):
        model = trained if scheme == "as trained" else quantize_weights(copy.deepcopy(trained), scheme)
        args = ScaleVecTrainingArguments(
            output_dir=str(run / "quantized-eval"), report_to="none", disable_tqdm=True, scale_stats=False,
            per_device_eval_batch_size=8, use_cpu=True,
        )  # fmt: skip
        collator = PackedBlockCollator(tokenizer.eos_token_id, False, False)
        trainer = ScaleVecTrainer(
            model=model, args=args, eval_dataset=data.eval, data_collator=collator, processing_class=tokenizer
        )
        losses[scheme] = trainer.evaluate()["eval_loss"]
    return losses


def residual_kurtosis(run: Path) -> float:
    """The largest residual-stream kurtosis over layers at the run's last evaluation that logged it."""
    history = json.loads((run / "trainer_state.json").read_text())["log_history"]
    logged = [entry for entry in history if any(key.startswith("scale/kurtosis/residual/") for key in entry)]
    return max(value for key, value in logged[-1].items() if key.startswith("scale/kurtosis/residual/"))


def spread(values: list[float], digits: int = 5) -> str:
    return f"{statistics.median(values):+.{digits}f} [{min(values):+.{digits}f}, {max(values):+.{digits}f}]"


def run_results(output_dir: Path, strategy: str, seed: int, size: str, steps: int) -> dict[str, float]:
    """The losses and kurtosis of one run, trained and measured once (kept in the run folder)."""
    run = train_run(output_dir, strategy, seed, size, steps)
    record = run / "quantization.json"
    if not record.is_file():
        write_text_atomically(record, json.dumps({**held_out_losses(run, seed), "kurtosis": residual_kurtosis(run)}))
    return json.loads(record.read_text())


def table(rows: dict[str, list[dict]]) -> str:
    lines = [
        "| strategy | held-out loss | int8 - as trained | int4 - as trained | residual kurtosis (max over layers) |",
        "|---|---|---|---|---|",
    ]
    for strategy, results in rows.items():
        base = [r["as trained"] for r in results]
        int8 = [r["int8"] - r["as trained"] for r in results]
        int4 = [r["int4"] - r["as trained"] for r in results]
        kurtosis = [r["kurtosis"] for r in results]
        lines.append(
            f"| {strategy} | {statistics.median(base):.4f} [{min(base):.4f}, {max(base):.4f}] | {spread(int8)} | "
            f"{spread(int4)} | {statistics.median(kurtosis):.1f} [{min(kurtosis):.1f}, {max(kurtosis):.1f}] |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output-dir", type=Path, default=Path("runs/quantization"))
    parser.add_argument("--size", default="4x128")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--strategies", default=",".join(STRATEGIES), help="processes may share the work by strategy")
    args = parser.parse_args()
    torch.set_num_threads(1)
    seeds = [int(seed) for seed in args.seeds.split(",")]
    rows = {
        strategy: [run_results(args.output_dir, strategy, seed, args.size, args.steps) for seed in seeds]
        for strategy in args.strategies.split(",")
    }
    print(f"{today()}, {machine()}; {args.size}, {args.steps} steps of 8 x {SEQ_LEN} tokens, seeds {args.seeds}")
    print(table(rows))


if __name__ == "__main__":
    main()
