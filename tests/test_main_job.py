"""The main job end to end at its smallest size (`scalevec-quickstart`: pretrain, export with cards, load back in
fresh processes), then `scalevec-convert` on the run it trained: cards from the run's records, `--no-model-card`,
and `--push-to-hub` against the loopback Hub."""

import json
import math
import re
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import LlamaForCausalLM

from scalevec import ScaleVecForCausalLM
from scalevec.data.corpus import corpus_name

from ._helpers import logits, random_ids, run_python

pytestmark = pytest.mark.slow  # it starts processes or trains end to end

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
    naming = ("--model-name", "tiny quickstart model")
    result = run_python(QUICKSTART, "--output-dir", str(output), *naming, *TINY_TRAINING, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    return output, result


def card_of(folder: Path) -> ModelCard:
    card = ModelCard.load(folder / "README.md")
    picture = folder / "scale_vectors.png"
    assert "](scale_vectors.png)" in card.text and picture.read_bytes().startswith(PNG_SIGNATURE)
    return card


def test_main_job_trains_exports_with_cards_and_loads_each_export_in_a_fresh_process(quickstart):
    output, result = quickstart
    assert "  scalevec (ScaleVecForCausalLM): " in result.stdout and "  llama (LlamaForCausalLM): " in result.stdout
    assert "The exports generate the same text." in result.stdout
    eval_loss = json.loads((output / "run" / "all_results.json").read_text())["eval_loss"]
    for target, load in (("scalevec", "trust_remote_code=True"), ("llama", "LlamaForCausalLM.from_pretrained")):
        card = card_of(output / target)
        assert card.data.library_name == "transformers" and "scalevec-unified" in card.data.tags
        assert ("loss", eval_loss) in [(r.metric_type, r.metric_value) for r in card.data.eval_results]
        assert load in card.text and "| optimizer steps | 4 |" in card.text
        assert card.data.model_name == "tiny quickstart model" and "\n# tiny quickstart model\n" in card.text
        assert f"| `{corpus_name()}` |" in card.text and " on 1 × CPU (" in card.text  # its data and hardware
    trained = ScaleVecForCausalLM.from_pretrained(output / "run").eval()
    ids = random_ids(trained.config)
    exported = LlamaForCausalLM.from_pretrained(output / "llama").eval()
    torch.testing.assert_close(logits(exported, ids), logits(trained, ids), atol=1e-5, rtol=1e-5)


def test_main_job_explains_its_numbers_and_says_what_to_do_next(quickstart):
    output, result = quickstart
    summary = result.stdout[result.stdout.index("== ScaleVec quickstart: what happened ==") :]
    metrics = json.loads((output / "run" / "all_results.json").read_text())
    assert f"Held-out loss {metrics['eval_loss']:.3f} nats per token: perplexity {metrics['eval_perplexity']:.0f}" in (
        summary
    )
    assert f"guessing uniformly scores {math.log(4096):.3f} nats (perplexity 4,096)" in summary
    frequency = float(re.search(r"by its frequency in the training data scores (\d+\.\d+): ", summary).group(1))
    assert 3 < frequency < math.log(4096) - 1  # text is far from uniform
    assert "the model has not learned even that much yet" in summary  # four steps learn less than frequencies
    assert f" tokens of {corpus_name()}, in " in summary  # what the data is, and its size
    assert "scalevec-ablate --max-steps 300 --seeds 0,1,2 " in summary  # 3 seeds: the fewest that can resolve a claim
    assert re.search(r"where zlib -9 compresses the same text to \d\.\d\d\.", summary)
    assert "repeats itself" in summary
    for line in (
        f"{output / 'scalevec' / 'README.md'}",
        "scale_vectors.png",
        "scalevec-convert push",
        "scalevec-train",
    ):
        assert line in summary


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
    assert re.search(r"\n# ScaleVec unified dense language model, \d\.\d M parameters\n", card.text)  # no folder name
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
