"""The package's shape: no module over 500 lines but the model's, so that each file holds one concern."""

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
