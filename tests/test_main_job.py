"""The main job end to end at its smallest size (`scalevec-quickstart`: pretrain, export with cards, load back in
fresh processes), then `scalevec-convert` on the run it trained: cards from the run's records, `--no-model-card`,
and `--push-to-hub` against the loopback Hub."""

import json
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import LlamaForCausalLM

from scalevec import ScaleVecForCausalLM

from ._helpers import logits, random_ids, run_python

TINY_TRAINING = [
    "--max-steps", "4",
    "--per-device-train-batch-size", "4",
    "--seq-len", "32",
    "--max-documents", "300",
    "--config-overrides",
    '{"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, '
    '"num_key_value_heads": 2}',
]  # fmt: skip
QUICKSTART = "import sys; from scalevec.quickstart import main; sys.exit(main(sys.argv[1:]))"
CONVERT = "import sys; from scalevec.convert.cli import main; sys.exit(main(sys.argv[1:]))"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def quickstart(tmp_path_factory):
    """(output folder, finished process) of one smallest-size run of the main job, offline."""
    output = tmp_path_factory.mktemp("quickstart") / "out"
    result = run_python(QUICKSTART, "--output-dir", str(output), *TINY_TRAINING, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return output, result


def card_of(folder: Path) -> ModelCard:
    card = ModelCard.load(folder / "README.md")
    picture = folder / "scale_vectors.png"
    assert "](scale_vectors.png)" in card.text and picture.read_bytes().startswith(PNG_SIGNATURE)
    return card


def test_main_job_trains_exports_with_cards_and_loads_each_export_in_a_fresh_process(quickstart):
    output, result = quickstart
    assert "loads as ScaleVecForCausalLM in a fresh process" in result.stdout
    assert "loads as LlamaForCausalLM in a fresh process" in result.stdout
    eval_loss = json.loads((output / "run" / "all_results.json").read_text())["eval_loss"]
    for target, load in (("scalevec", "trust_remote_code=True"), ("llama", "LlamaForCausalLM.from_pretrained")):
        card = card_of(output / target)
        assert card.data.library_name == "transformers" and "scalevec-unified" in card.data.tags
        assert ("loss", eval_loss) in [(r.metric_type, r.metric_value) for r in card.data.eval_results]
        assert load in card.text and "| optimizer steps | 4 |" in card.text
        assert card.data.model_name == target  # the folder's name, not the staging folder's
    trained = ScaleVecForCausalLM.from_pretrained(output / "run").eval()
    ids = random_ids(trained.config)
    exported = LlamaForCausalLM.from_pretrained(output / "llama").eval()
    torch.testing.assert_close(logits(exported, ids), logits(trained, ids), atol=1e-5, rtol=1e-5)


def test_main_job_refuses_a_folder_that_is_not_empty_and_leaves_it_alone(quickstart):
    output, _ = quickstart
    before = sorted(p.relative_to(output) for p in output.rglob("*"))
    result = run_python(QUICKSTART, "--output-dir", str(output), *TINY_TRAINING)
    assert result.returncode == 1 and "is not empty" in result.stderr
    assert sorted(p.relative_to(output) for p in output.rglob("*")) == before


def test_export_writes_a_card_from_the_run_records_unless_told_not_to(quickstart, tmp_path):
    run_dir = quickstart[0] / "run"
    result = run_python(CONVERT, "fold", str(run_dir), str(tmp_path / "folded"), "-q")
    assert result.returncode == 0, result.stderr
    card = card_of(tmp_path / "folded")
    assert "What folding did" in card.text and "within the bound" in card.text
    result = run_python(CONVERT, "export", str(run_dir), str(tmp_path / "bare"), "--to", "llama", "--no-model-card")
    assert result.returncode == 0, result.stderr
    assert not (tmp_path / "bare" / "README.md").exists() and (tmp_path / "bare" / "model.safetensors").is_file()


def test_export_pushes_to_the_hub_and_a_failed_push_keeps_the_export(quickstart, hub, tmp_path):
    run_dir = quickstart[0] / "run"
    command = ["export", str(run_dir), str(tmp_path / "llama"), "--to", "llama", "--push-to-hub", "tester/tiny"]
    result = run_python(CONVERT, *command, "--private", env=hub.env(tmp_path / "home", token=hub.token))
    assert result.returncode == 0, result.stderr
    repo = hub.repos["tester/tiny"]
    files = dict(repo.commits[repo.branches["main"]])
    files.pop(".gitattributes")  # the repository's own, from its creation
    local = {p.name: p.read_bytes() for p in (tmp_path / "llama").iterdir()}
    assert repo.private and files == local
    assert 'from_pretrained("tester/tiny")' in files["README.md"].decode()  # the card names the repo

    command[2], command[-1] = str(tmp_path / "second"), "tester/other"
    result = run_python(CONVERT, *command, "--private", env=hub.env(tmp_path / "home", token=None))
    assert result.returncode == 1 and "No Hugging Face token found" in result.stderr
    assert "was written and is kept" in result.stderr and (tmp_path / "second" / "model.safetensors").is_file()
    assert "tester/other" not in hub.repos


def test_push_is_a_subcommand_of_scalevec_convert():
    result = run_python(CONVERT, "push", "--help")
    assert result.returncode == 0 and "--dry-run" in result.stdout and "--private" in result.stdout
