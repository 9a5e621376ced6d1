import re
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"


def test_quickstart_snippet_runs():
    snippet = re.search(r"## Quickstart\n\n```python\n(.*?)```", README.read_text(), re.S).group(1)
    namespace: dict = {}
    exec(compile(snippet, "README quickstart", "exec"), namespace)
    assert namespace["loss"].item() > 0
    assert namespace["model"].config.scale_preset == "unified"
