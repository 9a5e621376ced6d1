"""The documented workflows end to end: each sequence of commands a page gives runs as the real console commands, in
fresh processes, each step reading what the previous one wrote, at a tiny scale. The command lines are the pages'
own (test_docs.py's parsing of their bash blocks and inline code); only the scale (steps, sizes, workers), the data
the test writes, and names that need the Hub are substituted, so a page whose sequence breaks fails here."""

import glob
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ._helpers import SUBPROCESS_ENV, TINY_TRAIN_OVERRIDES, corpus_texts
from .test_docs import invocations

pytestmark = pytest.mark.slow  # the documented command sequences, each command in a fresh process

TASK_ITEMS = [
    {"context": f"Question: what does the {word} hold?\nAnswer:", "choices": [word, "nothing", "the rest"], "gold": 0}
    for word in ("scale", "vector", "norm", "matrix", "decay", "token")
]
# What makes a documented command tiny; every other flag is the page's own
TINY_MODEL = ("--model-size", "tiny", "--config-overrides", TINY_TRAIN_OVERRIDES)
TINY_RUN = ("--per-device-train-batch-size", "4", "--logging-steps", "1", "--report-to", "none")


def documented(page: str, command: str, *, with_flag: str | None = None) -> list[str]:
    """The arguments of the first `command` that `page` shows (with `with_flag` among them, if given)."""
    for invocation in invocations():
        wanted = with_flag is None or with_flag in invocation.arguments
        if invocation.page == page and invocation.command == command and wanted:
            return invocation.arguments
    raise AssertionError(f"{page} no longer shows `{command}`{f' with {with_flag}' if with_flag else ''}")


def at_tiny_scale(arguments: list[str], values: dict[str, str | None], cwd: Path) -> list[str]:
    """`arguments` with each flag of `values` given that value instead (None: dropped, with its value), `...` (the
    page's "the same flags") replaced by `values["..."]`, and globs expanded in `cwd` as a shell would."""
    out, words = [], iter(arguments)
    for word in words:
        if word == "...":
            out += values["..."].split()
        elif word in values:
            next(words)
            if values[word] is not None:
                out += [word, values[word]]
        elif "*" in word:
            out += sorted(glob.glob(word, root_dir=cwd)) or [word]
        else:
            out.append(word)
    return out


def run(command: str, arguments: list[str], cwd: Path, *extra: str) -> str:
    """The console script `command` ("scalevec-data prepare") with `arguments` and `extra`, in a fresh process in
    `cwd`; fails the test with what it printed unless it exits 0. Returns its stdout."""
    script, *subcommand = command.split()
    executable = Path(sys.executable).with_name(script)
    finished = subprocess.run(
        [str(executable), *subcommand, *arguments, *extra],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, **SUBPROCESS_ENV},
    )
    assert finished.returncode == 0, (
        f"`{command} {' '.join([*arguments, *extra])}` exited {finished.returncode}:\n"
        f"{finished.stdout[-3000:]}\n{finished.stderr[-3000:]}"
    )
    return finished.stdout


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    """A folder with the files the pages assume: `data/*.jsonl` (two sources), `my_task.jsonl`."""
    folder = tmp_path_factory.mktemp("workflows")
    texts = corpus_texts(240)
    (folder / "data").mkdir()
    for name, part in (("web", texts[:160]), ("code", texts[160:])):
        (folder / "data" / f"{name}.jsonl").write_text("".join(json.dumps({"text": t}) + "\n" for t in part))
    (folder / "my_task.jsonl").write_text("".join(json.dumps(item) + "\n" for item in TASK_ITEMS))
    return folder


@pytest.fixture(scope="module")
def prepared(workspace) -> Path:
    """The README's `scalevec-data prepare data/*.jsonl --output prepared/web ...` (the embedded tokenizer for gpt2,
    which needs the Hub). Returns the prepared folder."""
    prepare = documented("README.md", "scalevec-data prepare")
    run(
        "scalevec-data prepare",
        at_tiny_scale(prepare, {"--tokenizer": None, "--seq-len": "32", "--num-proc": "1"}, workspace),
        workspace,
    )
    return workspace / prepare[prepare.index("--output") + 1]


@pytest.fixture(scope="module")
def trained(workspace, prepared) -> Path:
    """The README's next two commands: pretrain on the prepared folder (its task file for hellaswag), then score
    the run with `scalevec-eval ... --output results.json`. Returns the run folder; every workflow reuses it."""
    train = documented("README.md", "scalevec-train", with_flag="--dataset")
    tiny = {"--max-steps": "6", "--eval-steps": "3", "--eval-tasks": "my_task.jsonl"}
    run("scalevec-train", at_tiny_scale(train, tiny, workspace), workspace, *TINY_MODEL, *TINY_RUN)
    run("scalevec-eval", documented("README.md", "scalevec-eval"), workspace)
    return workspace / train[train.index("--output-dir") + 1]


def test_prepare_train_evaluate(workspace, prepared, trained):
    """Each step read what the previous one wrote: the run trained on the prepared folder's blocks, and
    scalevec-eval scored the run as its own last evaluation did (the same model, items and scoring)."""
    data = json.loads((trained / "training_data.json").read_text())
    assert [(source["kind"], source["folder"]) for source in data["sources"]] == [("prepared", "prepared/web")]
    assert data["sources"][0]["documents"] == 240 - 240 // 20  # both files, every 20th document held out
    summary = json.loads((trained / "run_summary.json").read_text())
    assert summary["steps"] == 6 and summary["eval"]["eval_tokens"] > 0
    results = json.loads((workspace / "results.json").read_text())
    assert results["model"] == "runs/web" and results["tasks"]["my_task"]["items"] == len(TASK_ITEMS)
    for score in ("acc", "acc_norm", "bpb"):
        assert results["tasks"]["my_task"][score] == pytest.approx(summary["eval"][f"eval_my_task_{score}"], rel=1e-5)


def test_evaluate_export_with_the_results_load_the_card(trained, workspace):
    """docs/converting.md: `scalevec-eval ... --quantize int8,int4 --output results.json` (no held-out set), then
    `scalevec-convert export ... --eval-results results.json`; the card's `model-index` holds the scores."""
    from huggingface_hub import ModelCard

    folder = workspace / "publish"
    (folder / "runs" / "quickstart").mkdir(parents=True)
    for name in ("run", "scalevec"):  # the quickstart's run and folded export: here, the README's run
        (folder / "runs" / "quickstart" / name).symlink_to(trained, target_is_directory=True)
    shutil.copy(workspace / "my_task.jsonl", folder)
    evaluate = documented("docs/converting.md", "scalevec-eval", with_flag="--quantize")
    run("scalevec-eval", evaluate, folder)
    export = documented("docs/converting.md", "scalevec-convert export", with_flag="--eval-results")
    run("scalevec-convert export", export, folder)

    results = json.loads((folder / "results.json").read_text())
    assert set(results["quantized"]) == {"int8", "int4"}
    exported = folder / export[1]
    assert json.loads((exported / "config.json").read_text())["model_type"] == "llama"
    card = ModelCard.load(exported / "README.md")
    scores = {(r.task_name, r.metric_type): r.metric_value for r in card.data.eval_results}
    for score in ("acc", "acc_norm", "bpb"):
        assert scores[("my_task", score)] == pytest.approx(results["tasks"]["my_task"][score])
    for scheme in ("int8", "int4"):  # the quantization table: each scheme's accuracy and its difference
        acc = results["quantized"][scheme]["tasks"]["my_task"]["acc"]
        assert f"| `{scheme}` | {acc:.4f} (" in card.text, card.text


def test_study_then_report_from_the_lone_records(workspace, prepared):
    """docs/study.md: a study, then `--report-only true` over a folder that holds only its `results.json` writes
    the same text reports byte for byte and keeps every record."""
    study = documented("docs/study.md", "scalevec-ablate", with_flag="--seeds")
    tiny = {"--max-steps": "3"}
    # two variants (of the page's six) and the prepared folder: six runs of 3 steps
    extra = ("--variants", "none,standard", "--dataset", str(prepared), "--config-overrides", TINY_TRAIN_OVERRIDES)
    run("scalevec-ablate", at_tiny_scale(study, tiny, workspace), workspace, *extra, *TINY_RUN)
    study_folder = workspace / study[study.index("--output-dir") + 1]
    records = workspace / "runs" / "records"
    records.mkdir()
    shutil.copy(study_folder / "results.json", records)

    # the page's `scalevec-ablate ... --report-only true`, its "..." the folder
    report = documented("docs/study.md", "scalevec-ablate", with_flag="--report-only")
    printed = run("scalevec-ablate", at_tiny_scale(report, {"...": "--output-dir runs/records"}, workspace), workspace)
    assert "report only: training nothing" in printed, printed
    assert sorted(path.name for path in records.iterdir()) == ["claims.md", "results.json", "results.md"]
    before = json.loads((study_folder / "results.json").read_text())
    after = json.loads((records / "results.json").read_text())
    assert len(before["runs"]) == 6 and after["runs"] == before["runs"]
    for name in ("results.md", "claims.md"):
        assert (records / name).read_text() == (study_folder / name).read_text(), name
