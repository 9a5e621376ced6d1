"""Multiple-choice tasks for downstream evaluation, as lm-evaluation-harness (lm-eval) defines them.

A task file is jsonl, one item a line::

    {"context": "Question: What melts ice?\\nAnswer:", "choices": ["heat", "cold"], "gold": 0}

Each choice is scored as the continuation of the context, joined by lm-eval's `target_delimiter` (" "): the
log-likelihood of `" " + choice` given `context`. An optional `"suffix"` is lm-eval's partial scoring (WinoGrande):
each choice then completes the context, and what is scored is `" " + suffix` after `context + choice`.

The built-in names load from the Hub through `datasets`, at a pinned revision, the split lm-eval scores (its
`ConfigurableTask.eval_docs`: the yaml's `test_split` where it names one, else its `validation_split`), and map their
columns to items as lm-eval's task yamls do (`BUILTIN_TASKS`). Offline, write the items on a machine that reaches
the Hub (`scalevec-eval --export-task NAME FILE`) and pass the file: its first line names the dataset,
config, split and revision the items come from (`{"dataset": ..., "config": ..., "split": ..., "revision": ...}`, a
line any task file may begin with), its name gives the same metric names, and the same subset is drawn from it.

An evaluation reads a fixed subset of each task (`--task-examples`): the first positions of the permutation that
picks the held-out blocks (`evaluation_blocks`), so it is the same at every evaluation, in every run and on any
number of processes, and a smaller subset is part of a larger one.
"""

import json
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ..data.held_out import DEFAULT_TASK_EXAMPLES, set_names
from ..data.sampler import EVALUATION_SEED, evaluation_blocks
from ..data.sources import DataError, check_hub_repo, first_line
from ..run_records import TASKS_MEAN

TARGET_DELIMITER = " "  # lm-eval's default `target_delimiter`, between a context and each choice


class TaskError(ValueError):
    """A task that cannot be read: the message is one line naming the file (and line) or the task."""


@dataclass(frozen=True)
class TaskItem:
    context: str
    choices: tuple[str, ...]
    gold: int  # index into `choices`
    suffix: str | None = None  # partial scoring: each choice completes the context, then this is scored
    origin: str = field(default="", compare=False)  # where it was read ("file:line"), for error messages

    def requests(self) -> list[tuple[str, str]]:
        """(context, continuation) per choice, as lm-eval's `construct_requests` builds them."""
        if self.suffix is None:
            return [(self.context, TARGET_DELIMITER + choice) for choice in self.choices]
        return [(self.context + choice, TARGET_DELIMITER + self.suffix) for choice in self.choices]

    def normalizers(self) -> list[int]:
        """The length in characters that `acc_norm` divides each log-likelihood by: lm-eval's `doc_to_choice`, the
        choice itself (for partial scoring, the context it completes, which is what lm-eval's choices are)."""
        if self.suffix is None:
            return [len(choice) for choice in self.choices]
        return [len(self.context + choice) for choice in self.choices]


SOURCE_FIELDS = ("dataset", "config", "split", "revision")  # where a task's items come from on the Hub


@dataclass
class Task:
    name: str  # in metric names: eval_<name>_acc
    source: str  # the file, or the Hub dataset, revision and split
    items: list[TaskItem]  # the evaluated subset
    available: int  # items in the source
    dataset: str | None = None  # the Hub dataset the items come from (the card's model-index, .eval_results/)
    config: str | None = None  # ... its configuration
    split: str | None = None  # ... its split
    revision: str | None = None  # ... and its commit

    def provenance(self) -> dict:
        """What a score of this task was computed on, for the results file and the card: the Hub dataset, config,
        split and revision where known, and the subset (`items` of `available`, drawn with `subset_seed`)."""
        hub = {key: value for key in SOURCE_FIELDS if (value := getattr(self, key)) is not None}
        return {**hub, "available": self.available, "subset_seed": EVALUATION_SEED}


# --- built-in tasks: lm-eval's task yamls (lm_eval/tasks/<task>/), mapped row by row ---------------------------


def _preprocess_hellaswag(text: str) -> str:
    """lm-eval's hellaswag/utils.py `preprocess`: WikiHow's bracketed artifacts removed."""
    text = text.strip().replace(" [title]", ". ")
    text = re.sub("\\[.*?\\]", "", text)
    return text.replace("  ", " ")


def hellaswag_item(row: dict) -> TaskItem:
    """hellaswag.yaml with utils.process_docs: context `activity_label: ctx_a Ctx_b`, the four endings."""
    context = row["ctx_a"] + " " + row["ctx_b"].capitalize()
    return TaskItem(
        _preprocess_hellaswag(row["activity_label"] + ": " + context),
        tuple(_preprocess_hellaswag(ending) for ending in row["endings"]),
        int(row["label"]),
    )


def arc_item(row: dict) -> TaskItem:
    """arc_easy.yaml (and arc_challenge.yaml): "Question: {question}\\nAnswer:", gold where answerKey is."""
    labels = list(row["choices"]["label"])
    return TaskItem(
        f"Question: {row['question']}\nAnswer:", tuple(row["choices"]["text"]), labels.index(row["answerKey"])
    )


def piqa_item(row: dict) -> TaskItem:
    """piqa.yaml: "Question: {goal}\\nAnswer:", choices sol1 and sol2."""
    return TaskItem(f"Question: {row['goal']}\nAnswer:", (row["sol1"], row["sol2"]), int(row["label"]))


def winogrande_item(row: dict) -> TaskItem:
    """winogrande/default.yaml (preprocess_winogrande.py), partial scoring: the sentence up to its blank completed
    by each option is the context, the rest of the sentence after the blank (stripped) the scored continuation."""
    blank = row["sentence"].index("_")
    return TaskItem(
        row["sentence"][:blank],
        (row["option1"], row["option2"]),
        {"1": 0, "2": 1}[str(row["answer"])],
        suffix=row["sentence"][blank + 1 :].strip(),
    )


def sciq_item(row: dict) -> TaskItem:
    """sciq.yaml: "{support.lstrip()}\\nQuestion: {question}\\nAnswer:", the three distractors then the answer."""
    return TaskItem(
        f"{row['support'].lstrip()}\nQuestion: {row['question']}\nAnswer:",
        (row["distractor1"], row["distractor2"], row["distractor3"], row["correct_answer"]),
        3,
    )


@dataclass(frozen=True)
class BuiltinTask:
    path: str  # the Hub dataset lm-eval's yaml names
    config: str | None
    revision: str  # the dataset's commit
    to_item: Callable[[dict], TaskItem]
    split: str  # the split lm-eval scores: its yaml's test_split where it names one, else validation_split


# Revisions: each is the commit that several public evaluation projects pin, and that `datasets` caches of real
# downloads show in their paths (<owner>___<name>/<config>/0.0.0/<commit>); this machine reaches no Hub to ask.
BUILTIN_TASKS = {
    "hellaswag": BuiltinTask(
        "Rowan/hellaswag", None, "218ec52e09a7e7462a5400043bb9a69a41d06b76", hellaswag_item, "validation"
    ),
    "arc_easy": BuiltinTask(
        "allenai/ai2_arc", "ARC-Easy", "210d026faf9955653af8916fad021475a3f00453", arc_item, "test"
    ),
    "arc_challenge": BuiltinTask(
        "allenai/ai2_arc", "ARC-Challenge", "210d026faf9955653af8916fad021475a3f00453", arc_item, "test"
    ),
    "piqa": BuiltinTask("baber/piqa", None, "142f6d7367fd9877f0fb3b5734ea6a545f54cdd1", piqa_item, "validation"),
    "winogrande": BuiltinTask(
        "allenai/winogrande",
        "winogrande_xl",
        "01e74176c63542e6b0bcb004dcdea22d94fb67b5",
        winogrande_item,
        "validation",
    ),
    "sciq": BuiltinTask("allenai/sciq", None, "2c94ad3e1aafab77146f384e23536f97a4849815", sciq_item, "test"),
}


# --- loading -----------------------------------------------------------------------------------------------------


def parse_task_list(text: str) -> list[str]:
    """`--eval-tasks hellaswag,my_task.jsonl`: the entries, each a built-in name or a jsonl file."""
    entries = [entry.strip() for entry in text.split(",") if entry.strip()]
    if not entries:
        raise TaskError(f"no task in {text!r}: give built-in names ({', '.join(BUILTIN_TASKS)}) or jsonl files")
    return entries


def load_tasks(entries: list[str], examples: int = DEFAULT_TASK_EXAMPLES) -> list[Task]:
    """Each entry's fixed subset of at most `examples` items, named for metrics (a file by its stem)."""
    if examples < 1:
        raise TaskError(f"--task-examples must be at least 1; got {examples}")
    names = set_names(entries)
    if TASKS_MEAN in names:
        raise TaskError(f"a task may not be named {TASKS_MEAN!r}: eval_{TASKS_MEAN}_* is the mean over the tasks")
    return [_load_task(entry, name, examples) for entry, name in zip(entries, names)]


def _load_task(entry: str, name: str, examples: int) -> Task:
    path = Path(entry).expanduser()
    if path.is_file():
        items, hub = read_task_file(path)
        chosen = evaluation_blocks(len(items), examples)
        return Task(name, str(path), [items[index] for index in chosen], len(items), **hub)
    if entry in BUILTIN_TASKS:
        return _load_builtin(entry, examples)
    if entry.endswith(".jsonl") or "/" in entry:
        raise TaskError(f"task file {entry}: no such file")
    raise TaskError(f"unknown task {entry!r}: a jsonl file or one of {', '.join(BUILTIN_TASKS)}")


def _load_builtin(name: str, examples: int) -> Task:
    import datasets

    task = BUILTIN_TASKS[name]
    where = f"{task.path}{f' ({task.config})' if task.config else ''} at {task.revision}"
    offline = (
        f"offline, pass {name}.jsonl instead, written where the Hub is reachable by "
        f"`scalevec-eval --export-task {name} {name}.jsonl`"
    )
    try:
        check_hub_repo("--tasks", task.path, "dataset", described=f"task {name}: {where} is in no local cache")
        rows = datasets.load_dataset(task.path, task.config, split=task.split, revision=task.revision)
    except DataError as error:
        raise TaskError(f"{error}; {offline}") from None
    except Exception as error:  # offline: ConnectionError, OSError or datasets' own errors, depending on the cache
        raise TaskError(
            f"task {name}: {where} could not be loaded from the Hub ({first_line(error)}); {offline}"
        ) from None
    chosen = [int(index) for index in evaluation_blocks(len(rows), examples)]
    items = [
        _with_origin(task.to_item(row), f"task {name}: {task.path} {task.split} row {index}")
        for index, row in zip(chosen, rows.select(chosen))
    ]
    hub = {"dataset": task.path, "config": task.config, "split": task.split, "revision": task.revision}
    return Task(name, f"{where}, {task.split} split", items, len(rows), **hub)


def _with_origin(item: TaskItem, origin: str) -> TaskItem:
    return TaskItem(item.context, item.choices, item.gold, item.suffix, origin)


def read_task_file(path: Path) -> tuple[list[TaskItem], dict]:
    """Every item of a jsonl task file, and the Hub source its first line may name (`SOURCE_FIELDS`, else {});
    a bad line is a `TaskError` naming the file and line."""
    items, hub = [], {}
    with open(path, "rb") as lines:
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            where = f"{path}:{number}"
            record = _json_object(line, where)
            if not items and not hub and "context" not in record and "dataset" in record:
                hub = _parse_source(record, where)
            else:
                items.append(_parse_item(record, where))
    if not items:
        raise TaskError(f"task file {path}: no items")
    return items, hub


def _json_object(line: bytes, where: str) -> dict:
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        raise TaskError(f"{where}: not UTF-8 text") from None
    except ValueError as error:
        raise TaskError(f"{where}: not a JSON object ({error})") from None
    if not isinstance(record, dict):
        raise TaskError(f"{where}: not a JSON object but a {type(record).__name__}")
    return record


def _parse_source(record: dict, where: str) -> dict:
    """The first line's Hub source: `{"dataset": "owner/name", "config": ..., "split": ..., "revision": ...}`."""
    if unknown := sorted(set(record) - set(SOURCE_FIELDS)):
        raise TaskError(f"{where}: a source line has only {', '.join(SOURCE_FIELDS)}; got {', '.join(unknown)}")
    for key, value in record.items():
        if value is not None and (not isinstance(value, str) or not value.strip()):
            raise TaskError(f'{where}: "{key}" of the source line must be a non-empty string; got {value!r}')
    if record["dataset"] is None:
        raise TaskError(f'{where}: a source line names its "dataset"')
    return record


def _parse_item(record: dict, where: str) -> TaskItem:
    for key in ("context", "choices", "gold"):
        if key not in record:
            raise TaskError(f'{where}: missing "{key}" (an item is {{"context": ..., "choices": [...], "gold": i}})')
    context, choices, gold, suffix = record["context"], record["choices"], record["gold"], record.get("suffix")
    if not isinstance(context, str):
        raise TaskError(f'{where}: "context" must be a string; got {context!r}')
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise TaskError(f'{where}: "choices" must be a non-empty list of non-empty strings; got {choices!r}')
    if isinstance(gold, bool) or not isinstance(gold, int) or not 0 <= gold < len(choices):
        raise TaskError(f'{where}: "gold" must be an index into the {len(choices)} choices; got {gold!r}')
    if suffix is not None and (not isinstance(suffix, str) or not suffix):
        raise TaskError(f'{where}: "suffix" must be a non-empty string; got {suffix!r}')
    if not context.strip() and suffix is None:
        raise TaskError(f'{where}: "context" is {"only whitespace" if context else "empty"}: nothing to score from')
    return TaskItem(context, tuple(choices), gold, suffix, where)


def task_file_text(task: Task) -> str:
    """`task` as a task file that `read_task_file` reads back: its Hub source on the first line (where it has one),
    then an item a line."""
    hub = {key: getattr(task, key) for key in SOURCE_FIELDS}
    lines = [hub] if task.dataset is not None else []
    lines += [_item_record(item) for item in task.items]
    return "".join(json.dumps(line) + "\n" for line in lines)


def _item_record(item: TaskItem) -> dict:
    record = {"context": item.context, "choices": list(item.choices), "gold": item.gold}
    return record if item.suffix is None else {**record, "suffix": item.suffix}
