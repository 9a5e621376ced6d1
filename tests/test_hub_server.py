"""The loopback Hub server on its own, driven by the real huggingface_hub client in a subprocess (HF_ENDPOINT is
read at import, so the client cannot run in the test process): the server is the only fake, so check it first."""

import json

import pytest

from ._helpers import run_python
from .hub_server import Repo

pytestmark = pytest.mark.slow  # it starts processes or trains end to end


def run_client(hub, tmp_path, script: str, *args: str, token: str | None = None) -> dict:
    """Run a huggingface_hub script against `hub` that prints one JSON line as its result."""
    result = run_python(script, *args, env=hub.env(tmp_path / "hf_home", token=token))
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.strip().splitlines()[-1])


def test_upload_then_list_and_download_round_trip(hub, tmp_path):
    folder = tmp_path / "folder"
    (folder / "nested").mkdir(parents=True)
    (folder / "config.json").write_text('{"a": 1}')
    (folder / "nested" / "weights.bin").write_bytes(bytes(range(256)) * 40)
    result = run_client(
        hub,
        tmp_path,
        """
        import json, sys
        from pathlib import Path
        from huggingface_hub import HfApi, snapshot_download
        api = HfApi()
        api.create_repo("tester/round-trip")
        api.create_repo("tester/round-trip", exist_ok=True)
        first = api.upload_folder(folder_path=sys.argv[1], repo_id="tester/round-trip", commit_message="first")
        (Path(sys.argv[1]) / "config.json").write_text('{"a": 2}')
        second = api.upload_folder(folder_path=sys.argv[1], repo_id="tester/round-trip", commit_message="second")
        api.create_branch("tester/round-trip", branch="dev", revision=first.oid)
        snapshot = Path(snapshot_download("tester/round-trip"))
        print(json.dumps(dict(
            commits=[first.oid, second.oid],
            main=api.model_info("tester/round-trip").sha,
            dev=api.model_info("tester/round-trip", revision="dev").sha,
            files=api.list_repo_files("tester/round-trip"),
            top=sorted(entry.path for entry in api.list_repo_tree("tester/round-trip")),
            nested=[entry.path for entry in api.list_repo_tree("tester/round-trip", "nested")],
            config=(snapshot / "config.json").read_text(),
            weights=(snapshot / "nested" / "weights.bin").read_bytes().hex(),
        )))
        """,
        str(folder),
        token=hub.token,
    )
    first, second = result["commits"]
    assert len(first) == len(second) == 40 and first != second
    assert (result["main"], result["dev"]) == (second, first)  # refs/main moved; the branch kept its start
    assert sorted(result["files"]) == [".gitattributes", "config.json", "nested/weights.bin"]
    assert result["top"] == [".gitattributes", "config.json", "nested"]
    assert result["nested"] == ["nested/weights.bin"]
    assert result["config"] == '{"a": 2}'
    assert bytes.fromhex(result["weights"]) == (folder / "nested" / "weights.bin").read_bytes()


def test_private_repos_are_invisible_and_writes_refused_without_valid_token(hub, tmp_path):
    hub.repos["tester/secret"] = Repo(private=True)
    hub.repos["tester/secret"].add_commit({"a.txt": b"secret"}, "main")
    hub.repos["tester/open"] = Repo(private=False)
    hub.repos["tester/open"].add_commit({"a.txt": b"open"}, "main")
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "b.txt").write_text("b")
    script = """
        import json, sys
        from huggingface_hub import HfApi, hf_hub_download
        api = HfApi()
        attempts = {
            "read private": lambda: api.model_info("tester/secret"),
            "download private": lambda: hf_hub_download("tester/secret", "a.txt"),
            "create repo": lambda: api.create_repo("tester/new"),
            "upload": lambda: api.upload_folder(folder_path=sys.argv[1], repo_id="tester/open"),
            "read public": lambda: api.model_info("tester/open").sha,
        }
        outcome = {}
        for name, attempt in attempts.items():
            try:
                outcome[name] = ["ok", str(attempt())]
            except Exception as error:
                outcome[name] = [type(error).__name__, getattr(error.response, "status_code", None)]
        print(json.dumps(outcome))
    """
    anonymous = run_client(hub, tmp_path, script, str(tmp_path / "folder"))
    assert anonymous["read private"] == ["RepositoryNotFoundError", 401]
    assert anonymous["download private"] == ["RepositoryNotFoundError", 401]
    assert anonymous["create repo"] == ["HfHubHTTPError", 401]
    assert anonymous["upload"] == ["RepositoryNotFoundError", 401]
    assert anonymous["read public"] == ["ok", hub.repos["tester/open"].branches["main"]]
    wrong = run_client(hub, tmp_path, script, str(tmp_path / "folder"), token="hf_SENTINELwrongToken")
    assert all(outcome == ["HfHubHTTPError", 401] for outcome in wrong.values()), wrong
    assert set(hub.repos) == {"tester/secret", "tester/open"} and hub.repos["tester/open"].commits.keys() == {
        hub.repos["tester/open"].branches["main"]
    }
