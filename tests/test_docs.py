"""The documentation (README.md and docs/): the site builds with `mkdocs build --strict` (a broken link, a missing
page or an unknown anchor fails), every console script and subcommand has its reference generated from `--help`,
the short commands the pages show run as written, and every flag of the other commands exists in its parser."""

import importlib.util
import json
import logging
import re
import shlex
import shutil
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from ._helpers import corpus_texts, saved_scalevec, tiny_config, write_dataset

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
# Commands a test runs as written once it has made the folder they read (the others need a corpus, the Hub, a GPU
# or hours); `--help` of any command runs too
RUNNABLE = {"scalevec-data info", "scalevec-convert fold", "scalevec-convert export", "scalevec-convert verify"}


def _load_hook():
    spec = importlib.util.spec_from_file_location("cli_reference", ROOT / "docs" / "hooks" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


cli_reference = _load_hook()


@dataclass
class Invocation:
    page: str
    command: str  # the console script, with its subcommand where it has them: "scalevec-data info"
    arguments: list[str]  # what follows the command
    line: str
    in_block: bool  # a line of a bash block, not a command named in the text


def _entry_modules() -> dict[str, str]:
    """`scalevec.train.cli` -> `scalevec-train`: what `torchrun -m` or `python -m` runs."""
    return {entry.partition(":")[0]: script for script, entry in cli_reference.console_scripts().items()}


def _invocation(page: str, words: list[str], line: str, in_block: bool) -> Invocation | None:
    scripts = cli_reference.console_scripts()
    if words and words[0] in scripts:
        script, arguments = words[0], words[1:]
    elif "-m" in words[:-1] and words[words.index("-m") + 1] in _entry_modules():
        at = words.index("-m")
        script, arguments = _entry_modules()[words[at + 1]], words[at + 2 :]
    else:
        return None
    if not cli_reference.subcommands(script) or arguments[:1] == ["--help"]:
        return Invocation(page, script, arguments, line, in_block)
    if not arguments:  # the script named in prose, as `scalevec-data`
        return None
    return Invocation(page, f"{script} {arguments[0]}", arguments[1:], line, in_block)


def invocations() -> list[Invocation]:
    """Every scalevec command of the pages' bash blocks and inline code: continuation lines joined, comments
    dropped, `a && b` as two commands."""
    found = []
    for page in PAGES:
        text = page.read_text()
        name = str(page.relative_to(ROOT))
        blocks = [
            line
            for block in re.findall(r"```bash\n(.*?)```", text, re.S)
            for line in re.sub(r"\\\n\s*", " ", block).splitlines()
        ]
        inline = re.findall(r"`(scalevec-[a-z]+ [^`]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
        for line, in_block in [
            *((line, True) for line in blocks),
            *((span.replace("\n", " "), False) for span in inline),
        ]:
            words = shlex.split(line, comments=True)
            while words:
                end = words.index("&&") if "&&" in words else len(words)
                command = _invocation(name, words[:end], line, in_block)
                if command is not None:
                    found.append(command)
                words = words[end + 1 :]
    return found


def test_the_pages_show_every_command():
    commands = {invocation.command for invocation in invocations()}
    scripts = set(cli_reference.console_scripts())
    named = {name for page in PAGES for name in re.findall(r"\b(scalevec-[a-z]+)\b", page.read_text())}
    assert named <= scripts, f"not console scripts: {named - scripts}"
    assert {command.split()[0] for command in commands} == scripts  # the parsing finds each script in use
    assert {"scalevec-data prepare", "scalevec-data info", "scalevec-convert export"} <= commands


def test_every_flag_in_the_documentation_exists():
    unknown = []
    for invocation in invocations():
        script, *subcommand = invocation.command.split()
        if subcommand and subcommand[0] not in cli_reference.subcommands(script):
            unknown.append(f"{invocation.page}: {script} has no subcommand {subcommand[0]} (in {invocation.line!r})")
            continue
        options = cli_reference.options(invocation.command)
        for word in invocation.arguments:
            flag = word.split("=")[0]
            if re.fullmatch(r"--?[A-Za-z][\w-]*", flag) and flag not in options:
                unknown.append(f"{invocation.page}: {invocation.command} has no {flag} (in {invocation.line!r})")
    assert not unknown, "\n".join(unknown)


def test_the_flag_check_sees_a_mistake():
    assert "--seq-len" in cli_reference.options("scalevec-data prepare")
    assert "--seq-length" not in cli_reference.options("scalevec-data prepare")
    assert {"--max-steps", "--max_steps", "--learning-rate"} <= cli_reference.options("scalevec-train")
    assert {"--tokens-per-parameter", "--max-steps"} <= cli_reference.options("scalevec-ablate")
    assert "--tokens-per-parameter" not in cli_reference.options("scalevec-train")


@pytest.fixture
def process_state_restored():
    """`scalevec-convert` sets up the process it runs in (signal handlers, transformers' progress bars): in the test
    process, put them back afterwards."""
    from transformers.utils import logging as transformers_logging

    handlers = {number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)}
    progress_bars = transformers_logging.is_progress_bar_enabled()
    yield
    for number, handler in handlers.items():
        signal.signal(number, handler)
    if progress_bars:
        transformers_logging.enable_progress_bar()


def _run(invocation: Invocation, capsys, monkeypatch) -> tuple[int, str]:
    """`invocation` as its console script runs it: `main` of its entry point, `sys.argv[0]` its name."""
    script, *subcommand = invocation.command.split()
    arguments = [*subcommand, *invocation.arguments]
    monkeypatch.setattr(sys, "argv", [script, *arguments])
    module, _, function = cli_reference.console_scripts()[script].partition(":")
    try:
        status = getattr(importlib.import_module(module), function)(arguments)
    except SystemExit as exit:  # argparse's --help
        status = exit.code
    return status, capsys.readouterr().out


def _make_what_it_reads(invocation: Invocation, source) -> None:
    """The folder a runnable command reads, where the page names it: a small prepared corpus for `scalevec-data
    info`, a tiny ScaleVec checkpoint for a conversion (a later command of the page reads what an earlier wrote)."""
    from scalevec.data import PrepareOptions, default_tokenizer, prepare

    read = Path(invocation.arguments[0])
    if invocation.arguments[0] == "--help" or read.exists():
        return
    if invocation.command == "scalevec-data info":
        prepare([source], default_tokenizer(), PrepareOptions(seq_len=16, eval_every=5), read)
    else:
        saved_scalevec(read, tiny_config())


@pytest.mark.slow
def test_short_commands_run_as_written(tmp_path, monkeypatch, capsys, process_state_restored):
    from scalevec.data import find_source

    runnable = [i for i in invocations() if i.in_block and (i.command in RUNNABLE or i.arguments[-1:] == ["--help"])]
    assert {"scalevec-data info", "scalevec-convert verify"} <= {i.command for i in runnable}
    assert {i.command for i in runnable if i.arguments == ["--help"]} >= set(cli_reference.console_scripts())
    source = find_source(str(write_dataset(tmp_path / "raw", "jsonl", corpus_texts(60))))
    for invocation in runnable:  # each page in a folder of its own, its commands in their order
        folder = tmp_path / invocation.page.replace("/", "-")
        folder.mkdir(exist_ok=True)
        monkeypatch.chdir(folder)
        _make_what_it_reads(invocation, source)
        status, printed = _run(invocation, capsys, monkeypatch)
        assert status == 0, f"{invocation.page}: {invocation.line!r} exited {status}:\n{printed}"
        if invocation.arguments[-1:] == ["--help"]:
            assert printed.startswith(f"usage: {invocation.command}")
        elif invocation.command == "scalevec-data info":
            assert "train: " in printed and "checked: file sizes" in printed, printed
    written = tmp_path / "docs-converting.md" / "runs"  # the converting page's commands wrote what they say
    assert json.loads((written / "tiny-llama" / "config.json").read_text())["model_type"] == "llama"
    assert json.loads((written / "tiny-folded" / "config.json").read_text())["folded"] is True


def test_every_command_has_its_generated_reference_page():
    for script in cli_reference.console_scripts():
        page = ROOT / "docs" / "reference" / f"{script}.md"
        assert page.is_file(), f"no reference page for {script}"
        markers = set(cli_reference.MARKER.findall(page.read_text()))
        expected = {script, *(f"{script} {sub}" for sub in cli_reference.subcommands(script))}
        assert markers == expected, f"{page.name}: markers {sorted(markers)}, expected {sorted(expected)}"
    rendered = cli_reference.render("<!-- cli-help: scalevec-data info -->")
    assert rendered.startswith("```text\nusage: scalevec-data info ") and rendered.endswith("```")


def _strict_build(root: Path, site: Path, caplog) -> list[str] | None:
    """`mkdocs build --strict` of the project at `root` into `site` (in this process, whose imports the reference
    pages reuse): None when it built, else the warnings that stopped it."""
    from mkdocs.commands.build import build
    from mkdocs.config import load_config
    from mkdocs.exceptions import Abort

    caplog.clear()
    try:
        build(load_config(str(root / "mkdocs.yml"), strict=True, site_dir=str(site)))
    except Abort:
        return [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
    return None


@pytest.mark.slow
def test_the_site_builds_strict(tmp_path, caplog):
    warnings = _strict_build(ROOT, tmp_path / "site", caplog)
    assert warnings is None, "\n".join(warnings)
    page = (tmp_path / "site" / "reference" / "scalevec-convert" / "index.html").read_text()
    assert "usage: scalevec-convert export" in page and "cli-help" not in page  # the markers became the help
    assert (tmp_path / "site" / "pretraining" / "index.html").is_file()


@pytest.mark.slow
def test_a_broken_link_or_anchor_fails_the_build(tmp_path, caplog):
    copy = tmp_path / "project"
    shutil.copytree(ROOT / "docs", copy / "docs")
    for name in ("mkdocs.yml", "pyproject.toml"):
        shutil.copy(ROOT / name, copy / name)
    with (copy / "docs" / "index.md").open("a") as page:
        page.write("\nSee [the data](data.md#no-such-section) and [a page](no-such-page.md).\n")
    warnings = "\n".join(_strict_build(copy, tmp_path / "site", caplog) or ["it built"])
    assert "'no-such-page.md', but the target is not found" in warnings
    assert "does not contain an anchor '#no-such-section'" in warnings


def _python_snippet(page: Path) -> str:
    return re.search(r"```python\n(.*?)```", page.read_text(), re.S).group(1)


def test_getting_started_shows_the_quickstart_that_test_readme_runs():
    assert _python_snippet(ROOT / "docs" / "getting-started.md") == _python_snippet(ROOT / "README.md")


def test_the_documented_task_revisions_are_the_pinned_ones():
    """docs/evaluation.md's table of built-in tasks names each one's dataset, config and revision as BUILTIN_TASKS."""
    from scalevec.evaluation.tasks import BUILTIN_TASKS

    documented = {}
    for row in re.findall(
        r"^\| (`\w+`.*?) \| `([\w/]+)`(.*?) \| `([0-9a-f]{40})` \|$",
        (ROOT / "docs" / "evaluation.md").read_text(),
        re.M,
    ):
        cell, path, configs, revision = row
        names = re.findall(r"`(\w+)`", cell)
        for name, config in zip(names, re.findall(r"`([\w-]+)`", configs) or [None] * len(names)):
            documented[name] = (path, config, revision)
    assert documented == {name: (task.path, task.config, task.revision) for name, task in BUILTIN_TASKS.items()}
