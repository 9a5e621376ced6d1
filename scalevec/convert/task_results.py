"""What a `scalevec-eval` results file puts on a model card and beside it: the downstream task table, the differences
that weight quantization makes, the card's `model-index` entries, and the Hub's `.eval_results/` files.

The results file (`scalevec-eval ... --output results.json`) is
`{"model", "tasks": {name: {"acc", "acc_norm", "bpb", "items"[, "dataset", "revision"]}}, "held_out": {"loss",
"perplexity", "bits_per_byte", "tokens"}, "quantized": {scheme: {"tasks": ..., "held_out": ...}}}`; a task that
names its Hub `dataset` (and `revision`) also gets a `.eval_results/<task>.yaml` file.
"""

import json
import re
from pathlib import Path

import yaml
from huggingface_hub import EvalResult, EvalResultEntry, eval_result_entries_to_yaml

from ..atomic import write_text_atomically
from ..quantization import QUANTIZATION_SCHEMES, quantization_deltas

# The Hub's current format for evaluation scores: YAML lists in `.eval_results/*.yaml` at the root of a model repo,
# shown on the model page and gathered into the benchmark's leaderboard
# (https://huggingface.co/docs/hub/eval-results; huggingface_hub's `EvalResultEntry` writes an entry).
EVAL_RESULTS_FOLDER = ".eval_results"
TASK_SCORES = ("acc", "acc_norm", "bpb")
SCORING = "zero-shot multiple choice, each choice scored by its log-likelihood as lm-evaluation-harness scores it"


def read_task_results(path: str | Path) -> dict:
    """The results file at `path`, checked: every task has its scores and item count; else one clear error."""
    path = Path(path)
    try:
        results = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: not a readable scalevec-eval results file ({error}).") from None
    if not isinstance(results, dict) or not isinstance(results.get("tasks", {}), dict):
        raise ValueError(f"{path}: not a scalevec-eval results file (an object with 'tasks' and 'held_out').")
    if not results.get("tasks") and not results.get("held_out"):
        raise ValueError(f"{path}: no 'tasks' or 'held_out' results; write it with `scalevec-eval --output`.")
    for scheme, quantized in {None: results, **(results.get("quantized") or {})}.items():
        for name, scores in (quantized.get("tasks") or {}).items():
            scores = scores if isinstance(scores, dict) else {}
            missing = [key for key in (*TASK_SCORES, "items") if not isinstance(scores.get(key), int | float)]
            if missing:
                where = f"quantized {scheme!r} task" if scheme else "task"
                raise ValueError(f"{path}: {where} {name!r} has no {', '.join(missing)}.")
    for scheme, quantized in (results.get("quantized") or {}).items():
        if missing := [task for task in results.get("tasks", {}) if task not in (quantized.get("tasks") or {})]:
            raise ValueError(f"{path}: quantized {scheme!r} has no results for {', '.join(missing)}.")
        if "loss" in (results.get("held_out") or {}) and "loss" not in (quantized.get("held_out") or {}):
            raise ValueError(f"{path}: quantized {scheme!r} has no held-out loss.")
    return results


def evaluation_section(results: dict) -> dict:
    """The card template's variables for the evaluation of `results`: its note, task rows and quantization table."""
    return {
        "evaluation_note": _evaluation_note(results),
        "task_rows": [
            (f"`{name}`", f"{scores['items']:,}", *(f"{scores[key]:.4f}" for key in TASK_SCORES))
            for name, scores in results.get("tasks", {}).items()
        ],
        **_quantization_table(results),
    }


def _evaluation_note(results: dict) -> str:
    note = f"Scored with `scalevec-eval`: {SCORING}; bits per byte are those of the correct choice."
    held_out = results.get("held_out")
    if held_out:
        note += (
            f" Held-out loss {held_out['loss']:.4f} nats per token (perplexity {held_out['perplexity']:.2f}"
            + (f", {held_out['bits_per_byte']:.4f} bits per byte" if "bits_per_byte" in held_out else "")
            + f") over {int(held_out['tokens']):,} predicted tokens."
        )
    return note


def _quantization_table(results: dict) -> dict:
    """A row for the unquantized weights and one per scheme: the held-out loss and each task's accuracy, with the
    scheme's difference from the unquantized value in brackets."""
    quantized = results.get("quantized") or {}
    if not quantized:
        return {"quantization_header": [], "quantization_rows": [], "quantization_note": ""}
    deltas = quantization_deltas(results, quantized)
    tasks = list(results.get("tasks", {}))
    loss = "held_out" in results and "loss" in results["held_out"]
    header = ["weights", *(["held-out loss"] if loss else []), *(f"`{task}` acc" for task in tasks)]
    rows = [["as published", *([f"{results['held_out']['loss']:.4f}"] if loss else [])]]
    rows[0] += [f"{results['tasks'][task]['acc']:.4f}" for task in tasks]
    for scheme, result in quantized.items():
        row = [f"`{scheme}`"]
        if loss:
            row.append(_with_delta(result["held_out"]["loss"], deltas[scheme]["held_out"]["loss"]))
        row += [_with_delta(result["tasks"][task]["acc"], deltas[scheme]["tasks"][task]["acc"]) for task in tasks]
        rows.append(row)
    described = [
        f"`{name}`: {QUANTIZATION_SCHEMES[name].description}" for name in quantized if name in QUANTIZATION_SCHEMES
    ]
    note = "Weight-only quantization of the decoder layers' linear maps (embeddings and head as published)"
    note += f"; {'; '.join(described)}." if described else "."
    return {"quantization_header": header, "quantization_rows": rows, "quantization_note": note}


def _with_delta(value: float, delta: float) -> str:
    return f"{value:.4f} ({delta:+.4f})"


def task_model_index(results: dict) -> list[EvalResult]:
    """The card's `model-index` entries: each task's accuracy, normalised accuracy and bits per byte."""
    return [
        EvalResult(
            task_type="multiple-choice",
            task_name=name,
            dataset_type=scores.get("dataset", name),
            dataset_name=name,
            dataset_revision=scores.get("revision"),
            metric_type=key,
            metric_name=f"{name} {key}",
            metric_value=scores[key],
        )
        for name, scores in results.get("tasks", {}).items()
        for key in TASK_SCORES
    ]


def write_eval_result_files(folder: str | Path, results: dict, repo_id: str | None = None) -> list[Path]:
    """Write `folder/.eval_results/<task>.yaml` for each task of `results` that names its Hub `dataset`: its
    accuracy, with how it was scored in the entry's notes. Returns the files written."""
    written = []
    for name, scores in results.get("tasks", {}).items():
        if "dataset" not in scores:
            continue  # a user's own task file: no Hub benchmark to file the score under
        entry = EvalResultEntry(
            dataset_id=scores["dataset"],
            task_id=name,
            value=scores["acc"],
            dataset_revision=scores.get("revision"),
            date=results.get("date"),
            source_url=f"https://huggingface.co/{repo_id}" if repo_id else None,
            source_name="Model card" if repo_id else None,
            notes=f"acc over {scores['items']:,} items; {SCORING}; scalevec-eval",
        )
        file = Path(folder) / EVAL_RESULTS_FOLDER / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.yaml"
        file.parent.mkdir(exist_ok=True)
        written.append(
            write_text_atomically(file, yaml.safe_dump(eval_result_entries_to_yaml([entry]), sort_keys=False))
        )
    return written
