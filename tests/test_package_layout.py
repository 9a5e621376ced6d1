"""The package's shape: no module over 500 lines but the model's, so that each file holds one concern; the
evaluation package stands beside the training one, importing nothing from it."""

import ast
import importlib.util
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "scalevec"
MAX_LINES = 500
EXEMPT = {"modeling_scalevec.py"}  # the model in one file, as transformers keeps each architecture's


def test_no_package_file_is_over_500_lines_but_the_model_file():
    lengths = {
        path.relative_to(PACKAGE).as_posix(): len(path.read_text().splitlines())
        for path in PACKAGE.rglob("*.py")
        if path.name not in EXEMPT
    }
    assert len(lengths) > 50  # the whole package was read
    assert {name: lines for name, lines in lengths.items() if lines > MAX_LINES} == {}


def _module_file(name: str) -> Path | None:
    """The file of the package's module `name` (`scalevec.x.y`), or None outside the package."""
    if name != "scalevec" and not name.startswith("scalevec."):
        return None
    path = PACKAGE.parent.joinpath(*name.split("."))
    for candidate in (path / "__init__.py", path.with_suffix(".py")):
        if candidate.is_file():
            return candidate
    return None


def _imports(path: Path) -> set[str]:
    """Every module an import statement of `path` names, at the top or inside a function (loaded on first use)."""
    name = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = importlib.util.resolve_name("." * node.level + (node.module or ""), package)
            found |= {base, *(f"{base}.{alias.name}" for alias in node.names)}  # `from . import x`: a module
    return found


def package_modules_reached(start: list[str]) -> set[str]:
    """The package's modules that importing `start` can load, each with its parent packages."""
    reached, todo = set(), list(start)
    while todo:
        name = todo.pop()
        parts = name.split(".")
        for parent in (".".join(parts[:k]) for k in range(1, len(parts) + 1)):
            if parent not in reached and (path := _module_file(parent)) is not None:
                reached.add(parent)
                todo += _imports(path)
    return reached


def test_the_evaluation_package_imports_nothing_from_train():
    evaluation = [f"scalevec.evaluation.{path.stem}" for path in (PACKAGE / "evaluation").glob("*.py")]
    reached = package_modules_reached(evaluation)
    assert {"scalevec.evaluation.cli", "scalevec.data.build", "scalevec.run_records"} <= reached
    assert sorted(name for name in reached if name.startswith("scalevec.train")) == []
    # the check sees what it must: the Trainer's module reaches train/ and evaluation/ alike
    trainer = package_modules_reached(["scalevec.train.trainer"])
    assert {"scalevec.train.arguments", "scalevec.evaluation.held_out"} <= trainer
