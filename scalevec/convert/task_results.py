"""What a `scalevec-eval` results file puts on a model card and beside it: the downstream task table, the differences
that weight quantization makes, the card's `model-index` entries, and the Hub's `.eval_results/` files.

The results file (`scalevec-eval ... --output results.json`) is
`{"model", "tasks": {name: {"acc", "acc_norm", "bpb", "items"[, "available", "subset_seed", "dataset", "config",
"split", "revision"]}}, "held_out": {"loss", "perplexity", "bits_per_byte", "tokens"} or null, "quantized": {scheme:
{"tasks": ..., "held_out": ...}}}`: `items` of the `available` items of the task's source, drawn with `subset_seed`,
from the Hub `dataset`'s `config` and `split` at `revision` where the task names them. A task that names its Hub
`dataset` also gets a `.eval_results/<task>.yaml` file.
"""

import json
import math
import re
from pathlib import Path

import yaml
from huggingface_hub import EvalResult, EvalResultEntry, eval_result_entries_to_yaml

from ..atomic import write_text_atomically
from ..evaluation.quantization import QUANTIZATION_SCHEMES, quantization_deltas
from ..run_records import TASK_FIGURES

# The Hub's current format for evaluation scores: YAML lists in `.eval_results/*.yaml` at the root of a model repo,
# shown on the model page and gathered into the benchmark's leaderboard
# (https://huggingface.co/docs/hub/eval-results; huggingface_hub's `EvalResultEntry` writes an entry).
EVAL_RESULTS_FOLDER = ".eval_results"
TASK_SOURCE = ("dataset", "config", "split", "revision")  # `Task.provenance`'s Hub fields
SCORING = "zero-shot multiple choice, each choice scored by its log-likelihood as lm-evaluation-harness scores it"


def read_task_results(path: str | Path) -> dict:
    """The results file at `path`, checked in full: every field the card reads has its type and range (a fraction
    for accuracies, a whole number for counts), every quantized scheme has what the unquantized scores have; else a
    one-line `ValueError` naming the file and the field."""
    path = Path(path)
    try:
        results = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"{path}: not a readable scalevec-eval results file ({error}).") from None
    if not isinstance(results, dict):
        raise ValueError(f"{path}: not a scalevec-eval results file (an object with 'tasks' and 'held_out').")
    if not results.get("tasks") and not results.get("held_out"):
        raise ValueError(f"{path}: no 'tasks' or 'held_out' results; write it with `scalevec-eval --output`.")
    check = _Checker(path)
    check.optional(results, "model", str, "a string")
    check.optional(results, "date", str, "a string")
    check.optional(results, "seconds", _is_number, "a number")
    _check_scores(check, results, "")
    quantized = check.optional(results, "quantized", dict, "an object of schemes") or {}
    for scheme, scores in quantized.items():
        where = f"quantized.{scheme}"
        check.require(isinstance(scores, dict), where, "an object with 'tasks' and 'held_out'", scores)
        _check_scores(check, scores, f"{where}.")
        if missing := [task for task in results.get("tasks") or {} if task not in (scores.get("tasks") or {})]:
            raise ValueError(f"{path}: {where}.tasks has no results for {', '.join(missing)}.")
        if results.get("held_out") and not scores.get("held_out"):
            raise ValueError(f"{path}: {where}.held_out is missing: the unquantized model has a held-out loss.")
    return results


class _Checker:
    """Checks of the fields of one results file, each failing in one line that names the file and the field."""

    def __init__(self, path: Path):
        self.path = path

    def require(self, ok: bool, field: str, expected: str, value) -> None:
        if not ok:
            raise ValueError(f"{self.path}: {field} must be {expected}; got {json.dumps(value)[:80]}.")

    def optional(self, record: dict, key: str, kind, expected: str, prefix: str = ""):
        """`record[key]` where it is present and not null, checked to be `kind` (a type or a predicate)."""
        value = record.get(key)
        if value is not None:
            ok = isinstance(value, kind) if isinstance(kind, type) else kind(value)
            self.require(ok, f"{prefix}{key}", expected, value)
        return value

    def needed(self, record: dict, key: str, kind, expected: str, prefix: str):
        if record.get(key) is None:
            raise ValueError(f"{self.path}: {prefix}{key} is missing (it must be {expected}).")
        return self.optional(record, key, kind, expected, prefix)


def _check_scores(check: _Checker, scores: dict, prefix: str) -> None:
    """The `tasks` and `held_out` of unquantized or quantized scores."""
    tasks = check.optional(scores, "tasks", dict, "an object of tasks", prefix) or {}
    for name, task in tasks.items():
        where = f"{prefix}tasks.{name}."
        check.require(isinstance(task, dict), where[:-1], "an object of scores", task)
        for key in ("acc", "acc_norm"):
            check.needed(task, key, _is_fraction, "a fraction between 0 and 1", where)
        check.needed(task, "bpb", _is_positive, "a finite number of bits, not negative", where)
        items = check.needed(task, "items", _is_count, "a whole number of items, at least 1", where)
        available = check.optional(task, "available", _is_count, "a whole number of items, at least 1", where)
        if available is not None:
            check.require(available >= items, f"{where}available", f"at least the {items} items scored", available)
        check.optional(task, "subset_seed", _is_integer, "a whole number", where)
        for key in TASK_SOURCE:
            check.optional(task, key, _is_name, "a non-empty string", where)
    held_out = check.optional(scores, "held_out", dict, "an object (or null)", prefix)
    if held_out is not None:
        where = f"{prefix}held_out."
        check.needed(held_out, "loss", _is_positive, "a finite loss in nats, not negative", where)
        check.needed(held_out, "perplexity", _is_positive, "a finite perplexity", where)
        check.needed(held_out, "tokens", _is_count, "a whole number of tokens, at least 1", where)
        check.optional(held_out, "bits_per_byte", _is_positive, "a finite number of bits, not negative", where)


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_fraction(value) -> bool:
    return _is_number(value) and 0 <= value <= 1


def _is_positive(value) -> bool:
    return _is_number(value) and value >= 0


def _is_integer(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_count(value) -> bool:
    return _is_integer(value) and value >= 1


def _is_name(value) -> bool:
    return isinstance(value, str) and bool(value.strip())


def evaluation_section(results: dict) -> dict:
    """The card template's variables for the evaluation of `results`: its note, task rows and quantization table."""
    return {
        "evaluation_note": _evaluation_note(results),
        "task_rows": [
            (f"`{name}`", _source_text(scores), subset_text(scores), *(f"{scores[key]:.4f}" for key in TASK_FIGURES))
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
    loss = bool(results.get("held_out"))  # null without --eval-dataset
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
    """The card's `model-index` entries: each task's accuracy, normalised accuracy and bits per byte, filed under
    its Hub dataset's config, split and revision (so two configs of one dataset, ARC-Easy and ARC-Challenge, stay
    apart: huggingface_hub merges entries whose `unique_identifier` is equal), the subset in `dataset_args`."""
    return [
        EvalResult(
            task_type="multiple-choice",
            task_name=name,
            dataset_type=scores.get("dataset", name),
            dataset_name=f"{name} ({subset_text(scores)})",
            dataset_config=scores.get("config"),
            dataset_split=scores.get("split"),
            dataset_revision=scores.get("revision"),
            dataset_args=_subset_args(scores),
            metric_type=key,
            metric_name=f"{name} {key}",
            metric_value=scores[key],
        )
        for name, scores in results.get("tasks", {}).items()
        for key in TASK_FIGURES
    ]


def subset_text(scores: dict) -> str:
    """Which items a task's scores cover: `500 of the 2,376 items of the test split, drawn with seed 0`."""
    split = f" of the {scores['split']} split" if "split" in scores else ""
    if "available" not in scores:
        return f"{scores['items']:,} items{split}"
    if scores["items"] == scores["available"]:
        return f"all {scores['items']:,} items{split}"
    seed = f", drawn with seed {scores['subset_seed']}" if "subset_seed" in scores else ""
    return f"{scores['items']:,} of the {scores['available']:,} items{split}{seed}"


def _source_text(scores: dict) -> str:
    """`allenai/ai2_arc` (`ARC-Easy`) at `210d026`: the Hub dataset a task's items come from, or "task file"."""
    if "dataset" not in scores:
        return "task file"
    config = f" (`{scores['config']}`)" if "config" in scores else ""
    revision = f" at `{scores['revision'][:7]}`" if "revision" in scores else ""
    return f"`{scores['dataset']}`{config}{revision}"


def _subset_args(scores: dict) -> dict:
    return {key: scores[key] for key in ("items", "available", "subset_seed") if key in scores}


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
            notes=f"acc over {subset_text(scores)}{_config_text(scores)}; {SCORING}; scalevec-eval",
        )
        file = Path(folder) / EVAL_RESULTS_FOLDER / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}.yaml"
        file.parent.mkdir(exist_ok=True)
        written.append(
            write_text_atomically(file, yaml.safe_dump(eval_result_entries_to_yaml([entry]), sort_keys=False))
        )
    return written


def _config_text(scores: dict) -> str:
    """The dataset config, which `.eval_results/` entries have no field for (two ARC sets share one dataset id)."""
    return f" (config {scores['config']})" if "config" in scores else ""
