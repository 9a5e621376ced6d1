"""Evaluation and the training sampler at scale, beside the revision before them (run from a git archive in the
same session).

- Evaluation: a 2-step `scalevec-train` run on real text (this Python's standard library and site-packages, as
  `bench_data.py` builds it), prepared with two held-out splits (about 0.25 M and 3 M tokens); each revision
  evaluates the whole split at the end of the run (`--max-eval-tokens all` for the new one), on 1 process and 2
  (`torchrun`, gloo). Reported: evaluated tokens, the evaluation's wall time and tokens/s, and the peak RSS of the
  largest process. Then the new default (`--max-eval-tokens` 2^20) on the larger split.
- Sampler: the peak RSS of a process that builds a Trainer and draws the first batch of its DataLoader, over a
  sparse `train.bin` of 0.1 M and 5 M blocks, with the sampler of each revision (the stock `RandomSampler` before):
  what grows with the corpus is the difference between the two sizes.

    python benchmarks/bench_eval.py [--tokens 30] [--old-revision 7101e7d] [--workdir /tmp/bench-eval]
"""

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import machine, today
from bench_data import build_corpus, old_package, timed

ROOT = Path(__file__).resolve().parents[1]
SEQ_LEN = 128
TRAIN = ["--model-size", "tiny", "--seq-len", str(SEQ_LEN), "--per-device-train-batch-size", "8", "--max-steps", "2"]
TRAIN += ["--per-device-eval-batch-size", "16", "--save-strategy", "no", "--report-to", "none"]
TRAIN += ["--disable-tqdm", "true", "--scale-stats", "false"]


def prepared(corpus: Path, output: Path, eval_every: int, max_eval_documents: int) -> Path:
    if not (output / "scalevec_data.json").exists():
        command = [sys.executable, "-m", "scalevec.data.cli", "prepare", str(corpus), "--output", str(output)]
        command += ["--seq-len", str(SEQ_LEN), "--eval-every", str(eval_every)]
        timed([*command, "--max-eval-documents", str(max_eval_documents), "--quiet"])
    return output


def evaluation(folder: Path, run: Path, processes: int, env: dict, *flags: str) -> dict:
    shutil.rmtree(run, ignore_errors=True)
    program = ["-m", "scalevec.train.cli", *TRAIN, "--dataset", str(folder), "--output-dir", str(run), *flags]
    if processes > 1:
        launcher = ["-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port", "29533"]
        program = [*launcher, *program]
    result = timed([sys.executable, *program], env={"OMP_NUM_THREADS": "1", **env})
    metrics = json.loads((run / "all_results.json").read_text())
    tokens = metrics.get("eval_tokens") or _predicted_tokens(folder)
    return {
        "processes": processes,
        "evaluated_tokens": tokens,
        "eval_seconds": metrics["eval_runtime"],
        "eval_tokens_per_second": tokens / metrics["eval_runtime"],
        "eval_loss": metrics["eval_loss"],
        "peak_rss_mib": result["peak_mib"],
    }


def _predicted_tokens(folder: Path) -> int:
    """What the old revision evaluated: every held-out block but its first token (it reports no count)."""
    blocks = json.loads((folder / "scalevec_data.json").read_text())["splits"]["eval"]["blocks"]
    return blocks * (SEQ_LEN - 1)


SAMPLER_RSS = """
import resource, sys, tempfile
from transformers import Trainer
from scalevec.data import PackedBlockCollator, PreparedBlocks
from scalevec import ScaleVecConfig, ScaleVecForCausalLM
from scalevec.train import ScaleVecTrainer, ScaleVecTrainingArguments
folder, stock = sys.argv[1], sys.argv[2] == "stock"
if stock and hasattr(ScaleVecTrainer, "_get_train_sampler"):
    ScaleVecTrainer._get_train_sampler = Trainer._get_train_sampler
config = ScaleVecConfig(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                        num_attention_heads=2, num_key_value_heads=1)
args = ScaleVecTrainingArguments(output_dir=tempfile.mkdtemp(), per_device_train_batch_size=8, report_to="none")
trainer = ScaleVecTrainer(model=ScaleVecForCausalLM(config), args=args, train_dataset=PreparedBlocks(folder),
                          data_collator=PackedBlockCollator(0))
next(iter(trainer.get_train_dataloader()))
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
"""


def sparse_folder(folder: Path, blocks: int) -> Path:
    """A prepared folder of `blocks` blocks of zeros, its `train.bin` a sparse file (no disk, no page cache)."""
    if not (folder / "scalevec_data.json").exists():
        folder.mkdir(parents=True, exist_ok=True)
        with open(folder / "train.bin", "wb") as file:
            file.truncate(blocks * SEQ_LEN * 2)
        split = {"blocks": blocks, "documents": 1, "tokens": blocks * SEQ_LEN, "dropped_tokens": 0, "bytes": 0}
        split["empty_documents"] = 0
        metadata = {"seq_len": SEQ_LEN, "dtype": "uint16", "eos_token_id": 0, "vocab_size": 256}
        metadata |= {"tokenizer_name": "none", "tokenizer_fingerprint": "none", "sources": ["sparse"], "options": {}}
        metadata |= {"splits": {"train": split}, "format": "scalevec-prepared-blocks", "version": 1}
        (folder / "scalevec_data.json").write_text(json.dumps(metadata))
    return folder


def sampler_rss(folder: Path, env: dict, stock: bool) -> float:
    script = [sys.executable, "-c", SAMPLER_RSS, str(folder), "stock" if stock else "ours"]
    result = subprocess.run(script, capture_output=True, text=True, env={**os.environ, **env}, check=True)
    return float(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=float, default=30, help="corpus size, millions of tokens")
    parser.add_argument("--old-revision", default="7101e7d")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "bench-eval")
    parser.add_argument("--skip-old-large", action="store_true", help="the old revision's ~10-minute evaluation")
    options = parser.parse_args()
    workdir = options.workdir
    corpus = build_corpus(workdir, options.tokens * 1e6)
    splits = {
        "small": prepared(corpus, workdir / "prepared-small", 20, 90),
        "large": prepared(corpus, workdir / "prepared-large", 10, 4000),
    }
    old = {"PYTHONPATH": str(old_package(options.old_revision, workdir))}
    new = {"PYTHONPATH": str(ROOT)}
    results = {"date": today(), "machine": machine(), "evaluation": [], "sampler": []}
    for size, folder in splits.items():
        for processes in (1, 2):
            row = evaluation(folder, workdir / "run", processes, new, "--max-eval-tokens", "all")
            results["evaluation"].append({"revision": "new", "held_out": size, **row})
            print(json.dumps(results["evaluation"][-1]), flush=True)
            if processes == 1 and not (size == "large" and options.skip_old_large):
                row = evaluation(folder, workdir / "run", processes, old)
                results["evaluation"].append({"revision": options.old_revision, "held_out": size, **row})
                print(json.dumps(results["evaluation"][-1]), flush=True)
    for processes in (1, 2):
        row = evaluation(splits["large"], workdir / "run", processes, new)
        results["evaluation"].append({"revision": "new", "held_out": "large, default budget", **row})
        print(json.dumps(results["evaluation"][-1]), flush=True)
    for blocks in (100_000, 5_000_000):
        folder = sparse_folder(workdir / f"sparse-{blocks}", blocks)
        row = {"blocks": blocks, "new_peak_mib": sampler_rss(folder, new, stock=False)}
        row["stock_peak_mib"] = sampler_rss(folder, new, stock=True)
        results["sampler"].append(row)
        print(json.dumps(row), flush=True)
    (workdir / "results.json").write_text(json.dumps(results, indent=2))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
