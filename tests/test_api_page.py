"""The Python API page (docs/api.md, rendered by mkdocstrings in the strict build of tests/test_docs.py) documents
every public name of the package and of `scalevec.convert`, and each name it documents exists."""

import importlib
import re
from pathlib import Path

import scalevec
import scalevec.convert

PAGE = Path(__file__).resolve().parents[1] / "docs" / "api.md"


def _documented() -> set[str]:
    text = PAGE.read_text()
    names = set(re.findall(r"^::: (\S+)$", text, re.M))
    members = re.findall(r"^::: scalevec\.convert\n    options:\n      members:\n((?:        - \S+\n)+)", text, re.M)
    names |= {f"scalevec.convert.{name}" for block in members for name in re.findall(r"- (\S+)", block)}
    return names


def test_every_public_name_is_on_the_api_page():
    documented = _documented()
    public = {f"scalevec.{name}" for name in scalevec.__all__} | {
        f"scalevec.convert.{name}" for name in scalevec.convert.__all__
    }
    assert public - documented == set(), f"public names missing from docs/api.md: {sorted(public - documented)}"


def test_every_documented_name_exists():
    for dotted in _documented() - {"scalevec.convert"}:
        module, _, attribute = dotted.rpartition(".")
        assert hasattr(importlib.import_module(module), attribute), f"docs/api.md documents {dotted}: no such name"
