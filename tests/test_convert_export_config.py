"""What an export says about itself: its config.json is an inference config, its refusals read as sentences, and
its report lists every file it wrote."""

import json

import pytest

from scalevec.convert import OutputOptions, TargetError, export_checkpoint
from scalevec.run_records import RUN_PICTURE

from ._helpers import saved_scalevec, tiny_config, tiny_moe_config
from .test_convert_reports import training_folder


@pytest.mark.parametrize(
    "target, config",
    [("llama", tiny_config()), ("mixtral", tiny_moe_config()), ("scalevec", tiny_config())],
    ids=["llama", "mixtral", "scalevec"],
)
def test_an_export_is_configured_for_inference(tmp_path, target, config):
    config.use_cache = False  # what a training run saves: the Trainer turns the cache off
    saved_scalevec(tmp_path / "run", config)
    assert json.loads((tmp_path / "run" / "config.json").read_text())["use_cache"] is False
    export_checkpoint(tmp_path / "run", tmp_path / "out", target, OutputOptions(verify=False))
    assert json.loads((tmp_path / "out" / "config.json").read_text())["use_cache"] is True


def test_a_dense_model_refused_by_an_moe_target_is_described_in_a_sentence(tmp_path):
    saved_scalevec(tmp_path / "dense", tiny_config())
    with pytest.raises(TargetError) as error:
        export_checkpoint(tmp_path / "dense", tmp_path / "out", "mixtral")
    assert str(error.value).startswith(
        "cannot export to mixtral: the model has no experts (num_experts=0: a dense model); use llama or qwen3."
    )


def test_export_lists_the_model_card_and_picture_it_wrote(tmp_path, capsys):
    from scalevec.convert.cli import main

    training_folder(tmp_path / "run", warmup_steps=0.05)
    assert main(["export", str(tmp_path / "run"), str(tmp_path / "out"), "--to", "llama"]) == 0
    files_line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("files: "))
    listed = files_line.removeprefix("files: ").split(", ")
    assert listed == sorted(p.name for p in (tmp_path / "out").iterdir())
    assert {"README.md", RUN_PICTURE, "config.json", "model.safetensors"} <= set(listed)
