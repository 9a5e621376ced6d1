"""What a new user trips on, said as what it is: `scalevec-eval` on a folder that holds no model, or writing its
results where nothing can be written (refused before any scoring); `scalevec-convert` on a folder that is not there,
or on a checkpoint the run never saved (the ones it holds named)."""

import json

import pytest

import scalevec.evaluation.cli
from scalevec.convert.cli import main as convert_main
from scalevec.data import default_tokenizer
from scalevec.evaluation.cli import main as evaluate_main

from ._helpers import saved_scalevec, tiny_config


@pytest.fixture
def model_and_task(tmp_path):
    model = tmp_path / "model"
    tokenizer = default_tokenizer()
    saved_scalevec(model, tiny_config(vocab_size=len(tokenizer)))
    tokenizer.save_pretrained(model)
    task = tmp_path / "task.jsonl"
    task.write_text('{"context": "a b", "choices": [" c", " d"], "gold": 0}\n')
    return model, task


def test_a_folder_without_a_model_is_said_to_hold_none(tmp_path, model_and_task, capsys):
    _, task = model_and_task
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.txt").write_text("not a model")
    assert evaluate_main([str(tmp_path / "notes"), "--tasks", str(task)]) == 1
    error = capsys.readouterr().err
    assert error == (
        f"scalevec-eval: error: model {tmp_path / 'notes'}: this folder holds no model (no config.json or "
        "adapter_config.json)\n"
    )
    (tmp_path / "config-only").mkdir()
    (tmp_path / "config-only" / "config.json").write_text(json.dumps(tiny_config().to_dict()))
    assert evaluate_main([str(tmp_path / "config-only"), "--tasks", str(task)]) == 1
    error = capsys.readouterr().err
    assert error.endswith("this folder holds no weights (none of model.safetensors, pytorch_model.bin)\n")


def test_an_unwritable_output_is_refused_before_scoring_naming_it(tmp_path, model_and_task, capsys, monkeypatch):
    model, task = model_and_task
    scored = []
    monkeypatch.setattr(scalevec.evaluation.cli, "evaluate_model", lambda *args, **kwargs: scored.append(args))
    blocker = tmp_path / "results"
    blocker.write_text("a file where a folder should be")
    output = blocker / "run.json"
    assert evaluate_main([str(model), "--tasks", str(task), "--output", str(output)]) == 1
    assert capsys.readouterr().err == f"scalevec-eval: error: {output}: a part of the path is not a folder\n"
    assert evaluate_main([str(model), "--tasks", str(task), "--output", str(tmp_path)]) == 1
    assert (
        capsys.readouterr().err
        == f"scalevec-eval: error: --output {tmp_path}: a folder; give the name of the file to write\n"
    )  # noqa: E501
    assert scored == [] and blocker.read_text() == "a file where a folder should be"


def test_convert_names_a_missing_folder_and_the_checkpoints_a_run_holds(tmp_path, capsys):
    run = tmp_path / "run"
    for step in (2, 4):
        saved_scalevec(run / f"checkpoint-{step}", tiny_config())
        (run / f"checkpoint-{step}" / "trainer_state.json").write_text(
            json.dumps({"global_step": step, "save_steps": 2})
        )
    destination = tmp_path / "out"
    capsys.readouterr()  # the saves' progress bars

    def refusal(source) -> str:
        assert convert_main(["export", str(source), str(destination), "--to", "llama"]) == 1
        return capsys.readouterr().err.removeprefix("scalevec-convert: error: ").removesuffix("\n")

    assert refusal(tmp_path / "nothere") == f"{tmp_path / 'nothere'}: no such folder"
    holds = f"the run in {run} holds checkpoint-2, checkpoint-4"
    for never in ("checkpoint-5", "checkpoint-6", "checkpoint-40"):  # never saved: off the cadence, or not yet
        assert refusal(run / never) == f"{run / never}: no such checkpoint; {holds}"
    (run / "checkpoint-4" / "trainer_state.json").write_text("{}")  # the cadence unrecorded
    assert refusal(run / "checkpoint-1").startswith(f"{run / 'checkpoint-1'} no longer exists: {holds} now (a run")
    assert not destination.exists()
