"""Tasks, loss and quantization per strategy on a finished study's largest models (issue 43), with intervals.

The task is a continuation task of real text nobody here wrote and no run trained on: files of this Python's
standard library and site-packages that `bench_data.py`'s corpus did not take, each item a context of CONTEXT words
of one file and four endings of ENDING words, the file's own next words (gold) and three from other files, in a
seeded random order. Each of the study's runs at SIZE, at its variant's selected learning rate (the study's own
selection, on the select half), is scored with `scalevec-eval --tasks TASK --quantize int8,int4`; the held-out loss
and its quantization increase are the study's report-half figures (`results.json`). Per variant: the mean over
seeds, and the paired difference to standard with its 95 % interval (Student t over the seeds, as the claims).
Beside them, each model's activation kurtosis (`activation_kurtosis`, the training loop's diagnostic) over the
gold texts of the first KURTOSIS_ITEMS items: the residual stream's largest over the layers, and the largest over
the linear maps' inputs, whose outliers are the ones that activation quantization would meet.

    python benchmarks/miniature_tasks.py STUDY --corpus CORPUS [--size 2x64] [--items 500]
"""

import argparse
import hashlib
import json
import random
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_data import corpus_files  # noqa: E402

from scalevec.atomic import write_text_atomically  # noqa: E402
from scalevec.evaluation.cli import main as scalevec_eval  # noqa: E402
from scalevec.train.diagnostics import activation_kurtosis  # noqa: E402
from scalevec.train.study.intervals import paired_interval  # noqa: E402
from scalevec.train.study.records import read_results  # noqa: E402
from scalevec.train.study.summary import SELECTED, best_runs, summarise  # noqa: E402

CONTEXT, ENDING, CHOICES, LONGEST = 40, 12, 4, 300
KURTOSIS_ITEMS = 64
VARIANTS, REFERENCE, SCHEMES = ("none", "standard", "unified"), "standard", ("int8", "int4")


def unseen_texts(corpus: Path) -> list[str]:
    """The files of `corpus_files()` that the corpus folder (`bench_data.build_corpus`) does not hold."""
    seen = {
        hashlib.sha1(json.loads(line)["text"].encode()).digest()
        for part in sorted(corpus.glob("part-*.jsonl"))
        for line in part.read_text().splitlines()
    }
    texts = []
    for path in corpus_files():
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        if len(text.split()) >= 2 * (CONTEXT + ENDING) and hashlib.sha1(text.encode()).digest() not in seen:
            texts.append(text)
    return texts


def continuation_items(texts: list[str], count: int, seed: int = 0) -> list[dict]:
    """`count` items of distinct files: a context, its own next words and three endings from other files. A window
    of over LONGEST characters (an escaped table, a base64 blob) is drawn again, then its file skipped: at 3 bytes a
    character, at most 900 byte-level tokens, so that every request fits the models' 1,024 positions."""
    rng = random.Random(seed)
    windows = (w for text in rng.sample(texts, len(texts)) if (w := _window(text, rng)) is not None)
    items = []
    for _ in range(count):
        (context, gold), *others = (next(windows) for _ in range(CHOICES))
        endings = [gold] + [ending for _, ending in others]
        rng.shuffle(endings)
        items.append({"context": context, "choices": endings, "gold": endings.index(gold)})
    return items


def _window(text: str, rng: random.Random, tries: int = 10) -> tuple[str, str] | None:
    words = text.split()
    for _ in range(tries):
        start = rng.randrange(len(words) - CONTEXT - ENDING)
        window = words[start : start + CONTEXT + ENDING]
        if len(" ".join(window)) <= LONGEST:
            return " ".join(window[:CONTEXT]), " ".join(window[CONTEXT:])
    return None


def score_runs(study: Path, size: str, task: Path) -> dict:
    """Per variant and seed: the run's task scores (with each scheme's differences) and its report-half losses."""
    grid, records = read_results(study / "results.json")
    summaries = {s.variant: s for s in summarise(records, grid) if s.size == size}
    best = best_runs(records, list(summaries.values()))
    scores = {}
    for variant in VARIANTS:
        summary = summaries[variant]
        if summary.status != SELECTED:
            raise SystemExit(f"{size} {variant}: no selected learning rate ({summary.status}); finish the grid first")
        scores[variant] = {}
        for run in sorted(best[size, variant], key=lambda run: run.seed):
            folder = run.point.folder(study)
            output = folder / "miniature_tasks.json"
            if not output.exists():
                argv = [str(folder), "--tasks", str(task), "--task-examples", "100000", "--output", str(output)]
                if scalevec_eval([*argv, "--quantize", ",".join(SCHEMES)]) != 0:
                    raise SystemExit(f"scalevec-eval failed on {folder}")
            result = json.loads(output.read_text())
            kurtosis = gold_text_kurtosis(folder, task)
            scores[variant][run.seed] = {
                "learning_rate": summary.best_learning_rate,
                "task": next(iter(result["tasks"].values())),
                "task_differences": {s: next(iter(d["tasks"].values())) for s, d in result["differences"].items()},
                "loss": summary.report_losses[run.seed],
                "loss_increase": {s: summary.quantization_increase[s][run.seed] for s in SCHEMES},
                "residual_kurtosis": max(kurtosis.pop("residual").values()),
                "linear_input_kurtosis": max(value for layers in kurtosis.values() for value in layers.values()),
            }
    return scores


def gold_text_kurtosis(folder: Path, task: Path) -> dict[str, dict[int, float]]:
    """`activation_kurtosis` of the model in `folder` over the context and gold ending of the first KURTOSIS_ITEMS
    items of `task`, one item a batch."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    items = [json.loads(line) for line in task.read_text().splitlines()[:KURTOSIS_ITEMS]]
    texts = [item["context"] + " " + item["choices"][item["gold"]] for item in items]
    return activation_kurtosis(model, [tokenizer(text, return_tensors="pt") for text in texts])


def table(scores: dict) -> str:
    """Markdown: per variant the mean over seeds and, against standard, the paired difference's interval."""
    figures = {
        "acc": lambda run: run["task"]["acc"],
        "acc_norm": lambda run: run["task"]["acc_norm"],
        "bpb": lambda run: run["task"]["bpb"],
        "report loss": lambda run: run["loss"],
        **{f"{s} bpb increase": (lambda run, s=s: run["task_differences"][s]["bpb"]) for s in SCHEMES},
        **{f"{s} acc change": (lambda run, s=s: run["task_differences"][s]["acc"]) for s in SCHEMES},
        **{f"{s} loss increase": (lambda run, s=s: run["loss_increase"][s]) for s in SCHEMES},
        "residual kurtosis": lambda run: run["residual_kurtosis"],
        "linear-input kurtosis": lambda run: run["linear_input_kurtosis"],
    }
    lines = [f"| figure | {' | '.join(VARIANTS)} |", "|---|" + "---|" * len(VARIANTS)]
    for name, figure in figures.items():
        cells = []
        for variant in VARIANTS:
            runs = scores[variant]
            cell = f"{statistics.fmean(figure(run) for run in runs.values()):.5f}"
            if variant != REFERENCE:
                paired = sorted(set(runs) & set(scores[REFERENCE]))
                delta = paired_interval([figure(runs[s]) - figure(scores[REFERENCE][s]) for s in paired])
                cell += f" (Δ {delta.mean:+.5f}, {delta.low:+.5f} to {delta.high:+.5f})"
            cells.append(cell)
        lines.append(f"| {name} | {' | '.join(cells)} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("study", type=Path, help="a scalevec-ablate output folder with results.json")
    parser.add_argument("--size", default="2x64")
    parser.add_argument("--items", type=int, default=500)
    parser.add_argument("--corpus", type=Path, required=True, help="bench_data.py's corpus folder the study used")
    args = parser.parse_args()
    task = args.study / "continuation.jsonl"
    if not task.exists():
        items = continuation_items(unseen_texts(args.corpus), args.items)
        write_text_atomically(task, "".join(json.dumps(item) + "\n" for item in items))
    scores = score_runs(args.study, args.size, task)
    write_text_atomically(args.study / f"tasks-{args.size}.json", json.dumps(scores, indent=2) + "\n")
    print(table(scores))


if __name__ == "__main__":
    main()
