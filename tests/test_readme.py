import re
from pathlib import Path

README = Path(__file__).parents[1] / "README.md"


def test_quickstart_snippet_runs():
    snippet = re.search(r"## Quickstart\n\n```python\n(.*?)```", README.read_text(), re.S).group(1)
    namespace: dict = {}
    exec(compile(snippet, "README quickstart", "exec"), namespace)
    assert namespace["loss"].item() > 0
    assert namespace["model"].config.scale_preset == "unified"


def test_every_command_the_readme_names_is_a_console_script_of_the_package():
    import tomllib

    scripts = tomllib.loads((README.parent / "pyproject.toml").read_text())["project"]["scripts"]
    named = set(re.findall(r"\b(scalevec-[a-z]+)\b", README.read_text()))
    assert {"scalevec-quickstart", "scalevec-train", "scalevec-convert", "scalevec-ablate"} <= named
    assert named <= set(scripts), f"not console scripts: {named - set(scripts)}"
    main_job = re.search(r"## Main job\n.*?```bash\n(.*?)```", README.read_text(), re.S).group(1)
    install, run = main_job.strip().split(" && ")
    extra = re.fullmatch(r'python -m pip install -e "\.\[(\w+)\]"', install).group(1)
    assert extra in tomllib.loads((README.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert run.split()[0] == "scalevec-quickstart"


def test_readme_is_a_short_front_door_with_a_link_for_each_task():
    text = README.read_text()
    assert len(text.splitlines()) < 200  # the details live in docs/, one page a task
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    missing = [link for link in links if not link.startswith("http") and not (README.parent / link).exists()]
    assert not missing, f"README links to files that do not exist: {missing}"
    tasks = {"pretraining", "data", "evaluation", "study", "converting", "serving"}
    assert {f"docs/{task}.md" for task in tasks} <= set(links)
    assert "benchmarks/RESULTS.md" in links
