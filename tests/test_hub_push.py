"""`scalevec-convert push` against the loopback Hub: publish, then load over HTTP in a fresh process where `scalevec`
cannot be imported (fresh HF_HOME each), exactly as a Hub user would; refusals, dry runs and failures; and the token
never shows up in anything the command prints or writes."""

import hashlib
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from safetensors.torch import load_file, save_file

from scalevec.convert.card import write_model_card

from ._helpers import logits, random_ids, run_python, run_without_scalevec, saved_scalevec, saved_stock, tiny_config
from .hub_server import Repo

pytestmark = pytest.mark.slow  # it starts processes or trains end to end

PUSH_COMMAND = "import sys; from scalevec.convert.cli import main; sys.exit(main(['push', *sys.argv[1:]]))"


def push(hub, hf_home: Path, *args: str, token: str | None):
    return run_python(PUSH_COMMAND, *map(str, args), env=hub.env(hf_home, token=token))


def folder_digest(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() for p in folder.rglob("*")}


def assert_token_nowhere(token: str, outputs: list[str], folders: list[Path]) -> None:
    assert not any(token in text for text in outputs), "the token was printed"
    for folder in folders:
        for file in (p for p in folder.rglob("*") if p.is_file()):
            assert token.encode() not in file.read_bytes(), f"the token was written to {file}"


def load_over_http(
    hub, hf_home: Path, load: str, ids: torch.Tensor, tmp_path: Path, token: str | None = None
) -> tuple[torch.Tensor, str]:
    """Run `load` (an expression that builds the model from the Hub) where `scalevec` cannot be imported; return
    the logits for `ids` and the module of the model's class."""
    save_file({"ids": ids}, tmp_path / "ids.safetensors")
    module = run_without_scalevec(
        f"""
        import sys, torch
        from safetensors.torch import load_file, save_file
        import transformers
        model = {load}.eval()
        with torch.no_grad():
            save_file({{"logits": model(load_file(sys.argv[1])["ids"]).logits}}, sys.argv[2])
        print(type(model).__module__)
        """,
        str(tmp_path / "ids.safetensors"),
        str(tmp_path / "logits.safetensors"),
        env=hub.env(hf_home, token=token),
    )
    return load_file(tmp_path / "logits.safetensors")["logits"], module.strip()


def test_pushed_private_scalevec_folder_loads_with_remote_code_where_scalevec_is_missing(hub, tmp_path):
    model = saved_scalevec(tmp_path / "model", tiny_config())
    before = folder_digest(tmp_path / "model")
    result = push(hub, tmp_path / "push_home", tmp_path / "model", "tester/tiny", "--private", token=hub.token)
    assert result.returncode == 0, result.stderr
    assert f"Uploaded {len(before)} files" in result.stdout
    assert "modeling_scalevec.py" in result.stdout and "scaled_ops.py" in result.stdout
    assert folder_digest(tmp_path / "model") == before and hub.repos["tester/tiny"].private
    ids = random_ids(model.config)
    load = 'transformers.AutoModelForCausalLM.from_pretrained("tester/tiny", trust_remote_code=True)'
    actual, module = load_over_http(hub, tmp_path / "load_home", load, ids, tmp_path, token=hub.token)
    assert module.startswith("transformers_modules.")  # the code that came with the repo
    torch.testing.assert_close(actual, logits(model, ids), atol=0, rtol=0)
    assert_token_nowhere(hub.token, [result.stdout, result.stderr], [tmp_path])


def test_pushed_llama_folder_and_its_card_load_with_the_stock_class_from_a_branch(hub, tmp_path):
    model = saved_stock(tmp_path / "llama", "llama")
    write_model_card(
        tmp_path / "llama", export_target="llama", source_config=tiny_config(), repo_id="tester/tiny-llama"
    )
    options = ["--revision", "v1", "--commit-message", "Llama export"]
    result = push(hub, tmp_path / "push_home", tmp_path / "llama", "tester/tiny-llama", *options, token=hub.token)
    assert result.returncode == 0, result.stderr
    repo = hub.repos["tester/tiny-llama"]
    on_branch, on_main = (repo.commits[repo.branches[branch]] for branch in ("v1", "main"))
    assert "config.json" in on_branch and "config.json" not in on_main
    assert repo.messages[repo.branches["v1"]] == "Llama export"
    card = ModelCard(on_branch["README.md"].decode())
    assert card.data.library_name == "transformers" and "llama" in card.data.tags
    ids = random_ids(model.config)
    load = 'transformers.LlamaForCausalLM.from_pretrained("tester/tiny-llama", revision="v1")'
    actual, module = load_over_http(hub, tmp_path / "load_home", load, ids, tmp_path)  # anonymous: public repo
    assert module == "transformers.models.llama.modeling_llama"
    torch.testing.assert_close(actual, logits(model, ids), atol=0, rtol=0)


def test_private_push_without_token_is_refused_before_any_request(hub, tmp_path):
    saved_scalevec(tmp_path / "model", tiny_config())
    result = push(hub, tmp_path / "home", tmp_path / "model", "tester/secret", "--private", token=None)
    assert result.returncode == 1
    assert "No Hugging Face token found" in result.stderr and "Nothing was sent" in result.stderr
    assert hub.requests == []


def test_dry_run_lists_the_files_and_sends_nothing(hub, tmp_path):
    saved_scalevec(tmp_path / "model", tiny_config())
    (tmp_path / "model" / ".git").mkdir()
    (tmp_path / "model" / ".git" / "HEAD").write_text("ref: refs/heads/main")  # upload_folder leaves .git out
    result = push(hub, tmp_path / "home", tmp_path / "model", "tester/tiny", "--dry-run", token=hub.token)
    assert result.returncode == 0, result.stderr
    assert hub.requests == []
    files = sorted(p for p in (tmp_path / "model").iterdir() if p.is_file())
    assert f"Would upload {len(files)} files" in result.stdout
    for file in files:
        assert f"  {file.name}  ({file.stat().st_size} bytes)" in result.stdout
    assert ".git" not in result.stdout
    assert_token_nowhere(hub.token, [result.stdout, result.stderr], [tmp_path])


@pytest.mark.parametrize(
    "failure, token, options, message",
    [
        # 507: a server error that huggingface_hub does not retry (it retries 500 for half a minute)
        ({"commit": 507}, None, [], "Upload failed for tester/tiny (the Hub answered HTTP 507)"),
        ({}, "hf_SENTINELwrongToken", [], "Repository creation failed for tester/tiny (authentication failed"),
        ({}, None, ["--private"], "tester/tiny exists and is public, and --private does not change that"),
    ],
    ids=["server-error", "wrong-token", "private-onto-public"],
)
def test_failed_push_says_what_failed_leaves_the_folder_and_never_shows_the_token(
    hub, tmp_path, failure, token, options, message
):
    saved_scalevec(tmp_path / "model", tiny_config())
    before = folder_digest(tmp_path / "model")
    hub.repos["tester/tiny"] = Repo(private=False)
    first = hub.repos["tester/tiny"].add_commit({}, "main")
    hub.faults.update(failure)
    token = token or hub.token
    result = push(hub, tmp_path / "home", tmp_path / "model", "tester/tiny", *options, token=token)
    assert result.returncode == 1
    assert message in result.stderr, result.stderr
    assert hub.repos["tester/tiny"].branches == {"main": first}  # nothing committed
    assert folder_digest(tmp_path / "model") == before
    assert_token_nowhere(token, [result.stdout, result.stderr], [tmp_path])
