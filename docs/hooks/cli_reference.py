"""MkDocs hook: the command-line reference pages show what each console script prints for `--help`.

A page writes `<!-- cli-help: scalevec-data prepare -->` where the help of `scalevec-data prepare --help` belongs;
at build time the marker becomes that text, produced by calling the script's `main` (as `pyproject.toml` names it)
with `--help`. The reference therefore cannot drift from the parsers. `tests/test_docs.py` reads the same help
texts to check that every flag the documentation uses exists.
"""

import contextlib
import functools
import importlib
import io
import os
import re
import sys
from pathlib import Path
from unittest import mock

import tomllib

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"<!-- cli-help: (scalevec-[a-z]+(?: [a-z]+)?) -->")
HELP_WIDTH = "100"  # argparse wraps to $COLUMNS: a fixed width keeps the pages the same on every machine


def console_scripts() -> dict[str, str]:
    """Every console script of the package and its entry point (`"scalevec.data.cli:main"`)."""
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]


@functools.cache
def help_text(command: str) -> str:
    """What `command --help` prints, e.g. `help_text("scalevec-convert export")`."""
    script, *subcommand = command.split()
    module, _, function = console_scripts()[script].partition(":")
    main = getattr(importlib.import_module(module), function)
    printed = io.StringIO()
    with (
        mock.patch.dict(os.environ, {"COLUMNS": HELP_WIDTH}),
        mock.patch.object(sys, "argv", [script]),  # the program name that HfArgumentParser's usage line shows
        contextlib.redirect_stdout(printed),
        contextlib.suppress(SystemExit),
    ):
        main([*subcommand, "--help"])
    if not printed.getvalue().startswith("usage:"):
        raise RuntimeError(f"`{command} --help` printed no usage: {printed.getvalue()[:200]!r}")
    return printed.getvalue()


def options(command: str) -> set[str]:
    """The option strings (`--seq-len`, `-q`) that `command --help` lists."""
    found = set()
    for line in help_text(command).splitlines():
        invocation = re.match(r"^ {2}(-\S.*?)(?: {2,}|$)", line)  # `  --seq-len SEQ_LEN    help text`
        if invocation:
            found.update(re.findall(r"(?<![\w-])--?[A-Za-z][\w-]*", invocation.group(1)))
    return found


def subcommands(script: str) -> list[str]:
    """The subcommands that `script --help` lists (none for a script without any)."""
    text = help_text(script)
    listing = re.search(r"\npositional arguments:\n {2}\S+\n((?: {4}\S.*\n)+)", text)
    return re.findall(r"^ {4}([a-z]+) ", listing.group(1), re.M) if listing else []


def render(markdown: str) -> str:
    """`markdown` with every marker replaced by its command's help, in a text block."""
    return MARKER.sub(lambda match: f"```text\n{help_text(match.group(1))}```", markdown)


def on_page_markdown(markdown: str, page, config, files) -> str:
    return render(markdown)
