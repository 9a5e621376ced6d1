"""The model card written by `write_model_card`: parsed back with huggingface_hub's `ModelCard.load`, its numbers
taken from the records of a real (tiny) `transformers.Trainer` run, and nothing claimed when there are no records."""

import json
from pathlib import Path

import pytest
import torch
from huggingface_hub import ModelCard
from transformers import Trainer, TrainingArguments

from scalevec import ScaleVecForCausalLM
from scalevec.convert.card import TEMPLATE, write_model_card

from ._helpers import random_ids, saved_scalevec, saved_stock, tiny_config, tiny_moe_config

REPO_ROOT = Path(__file__).parents[1]


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> tuple[ScaleVecForCausalLM, Path, Path]:
    """(model, run folder, loss picture) of a few real Trainer steps with evaluation on a tiny ScaleVec model."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot

    run_dir = tmp_path_factory.mktemp("run")
    torch.manual_seed(0)
    model = ScaleVecForCausalLM(tiny_config())
    rows = [{"input_ids": ids, "labels": ids} for ids in random_ids(model.config, batch=16, length=16)]
    args = TrainingArguments(
        output_dir=str(run_dir),
        max_steps=4,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        lr_scheduler_type="cosine",
        logging_steps=1,
        eval_strategy="steps",
        eval_steps=2,
        save_strategy="no",
        include_num_input_tokens_seen=True,
        report_to="none",
        use_cpu=True,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=rows[:12], eval_dataset=rows[12:])
    trainer.train()
    trainer.save_state()
    trainer.save_metrics("eval", trainer.evaluate())
    (run_dir / "training_args.json").write_text(args.to_json_string())
    losses = [entry for entry in trainer.state.log_history if "loss" in entry]
    pyplot.plot([entry["step"] for entry in losses], [entry["loss"] for entry in losses])
    pyplot.savefig(run_dir / "loss.png")
    pyplot.close("all")
    return model.eval(), run_dir, run_dir / "loss.png"


def test_card_from_a_real_run_parses_back_with_its_metadata_numbers_and_picture(trained, tmp_path):
    model, run_dir, picture = trained
    model.save_pretrained(tmp_path / "export")
    readme = write_model_card(
        tmp_path / "export",
        export_target="scalevec",
        source_config=model.config,
        run_dir=run_dir,
        picture=picture,
        folding_summary="Folded every input-role scale into its matrix.",
        datasets=["tester/corpus"],
        repo_id="tester/tiny-scalevec",
    )
    card = ModelCard.load(readme)
    data = card.data
    assert (data.library_name, data.pipeline_tag, data.license) == ("transformers", "text-generation", "apache-2.0")
    assert {"scalevec", "scalevec-unified"} <= set(data.tags) and data.datasets == ["tester/corpus"]
    eval_loss = json.loads((run_dir / "eval_results.json").read_text())["eval_loss"]
    assert [(r.metric_type, r.metric_value) for r in data.eval_results] == [("loss", eval_loss)]
    assert data.model_name == "tester/tiny-scalevec"
    state = json.loads((run_dir / "trainer_state.json").read_text())
    last_loss = [entry for entry in state["log_history"] if "loss" in entry][-1]["loss"]
    for row in (
        f"| optimizer steps | {state['global_step']} |",
        f"| tokens seen | {state['num_input_tokens_seen']} |",
        f"| final training loss | {last_loss:.4f} (logged at step 4) |",
        f"| eval loss | {eval_loss:.4f} |",
        "| schedule | `cosine` |",
    ):
        assert row in card.text
    assert "![Training loss and scale-vector statistics](loss.png)" in card.text
    assert (tmp_path / "export" / "loss.png").read_bytes() == picture.read_bytes()
    assert 'from_pretrained("tester/tiny-scalevec", trust_remote_code=True)' in card.text
    assert "Folded every input-role scale into its matrix." in card.text and "arXiv" in card.text
    assert "2605.26895" in card.text and "Wang, Mingze and Zhu, Shuchen" in card.text
    assert sorted(p.name for p in (tmp_path / "export").iterdir() if p.name.startswith(".")) == []  # no temp file


@pytest.mark.parametrize("with_empty_run_dir", [False, True])
def test_card_without_records_is_minimal_and_claims_no_numbers(tmp_path, with_empty_run_dir):
    saved_stock(tmp_path / "llama", "llama")
    (tmp_path / "run").mkdir()
    readme = write_model_card(
        tmp_path / "llama",
        export_target="llama",
        source_config=tiny_config(scale_preset="standard"),
        run_dir=tmp_path / "run" if with_empty_run_dir else None,
        base_model="tester/base-llama",
    )
    card = ModelCard.load(readme)
    assert card.data.eval_results is None and card.data.base_model == "tester/base-llama"
    assert {"scalevec", "scalevec-standard", "llama"} <= set(card.data.tags)
    assert "No training records" in card.text and "loss |" not in card.text and "![" not in card.text
    assert 'LlamaForCausalLM.from_pretrained("path/to/this/checkpoint")' in card.text
    assert "trust_remote_code" not in card.text


def test_moe_card_describes_the_experts_and_keeps_a_picture_already_in_the_folder(tmp_path):
    config = tiny_moe_config(mlp_only_layers=[0])
    saved_scalevec(tmp_path / "moe", config)
    (tmp_path / "moe" / "plots").mkdir()
    (tmp_path / "moe" / "plots" / "scales.png").write_bytes(b"\x89PNG")
    readme = write_model_card(
        tmp_path / "moe",
        export_target="scalevec",
        source_config=config,
        picture=tmp_path / "moe" / "plots" / "scales.png",
    )
    text = ModelCard.load(readme).text
    assert "| experts | 4, top-2, top-k renormalised: True |" in text and "| MoE layers | 1 |" in text
    assert "| published format | ScaleVec (remote code), scales not folded: training form |" in text
    assert "![Training loss and scale-vector statistics](plots/scales.png)" in text
    assert sorted(p.name for p in (tmp_path / "moe").iterdir() if p.suffix == ".png") == []


def test_card_is_replaced_whole_when_written_again(trained, tmp_path):
    model, run_dir, _ = trained
    model.save_pretrained(tmp_path / "export")
    (tmp_path / "export" / "README.md").write_text("an old card")
    write_model_card(tmp_path / "export", export_target="scalevec", source_config=model.config)
    readme = write_model_card(
        tmp_path / "export", export_target="scalevec", source_config=model.config, run_dir=run_dir
    )
    assert "| optimizer steps | 4 |" in readme.read_text() and ModelCard.load(readme).data.eval_results
    assert sorted(p.name for p in (tmp_path / "export").iterdir() if p.name.startswith(".")) == []


def test_template_in_model_cards_is_the_one_the_package_ships():
    """The package carries the canonical template (so an installed scalevec finds it); `model_cards/` a copy."""
    assert (REPO_ROOT / "model_cards" / "scalevec.md").read_bytes() == TEMPLATE.read_bytes(), (
        "model_cards/scalevec.md differs from scalevec/convert/templates/model_card.md: copy the package's template"
    )


def test_a_count_in_the_model_index_is_an_integer(tmp_path):
    """Run records keep every eval figure as a float (`25245.0`); the card's YAML writes a count as one."""
    saved_stock(tmp_path / "llama", "llama")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "eval_results.json").write_text(json.dumps({"eval_loss": 3.25, "eval_tokens": 25245.0}))
    readme = write_model_card(
        tmp_path / "llama", export_target="llama", source_config=tiny_config(), run_dir=tmp_path / "run"
    )
    values = {r.metric_type: r.metric_value for r in ModelCard.load(readme).data.eval_results}
    assert values == {"loss": 3.25, "tokens": 25245} and isinstance(values["tokens"], int)
    assert "value: 25245\n" in readme.read_text() and "25245.0" not in readme.read_text()
