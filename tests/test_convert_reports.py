"""What a conversion and a run say about themselves: the converter's report lines, the model card's training
rows, and the run picture that the card shows."""

import json
import logging
from pathlib import Path
from types import SimpleNamespace

import pytest
from huggingface_hub import ModelCard

from scalevec import ScaleVecForCausalLM
from scalevec.run_records import RUN_PICTURE
from scalevec.train import diagnostics
from scalevec.train.diagnostics import ScaleStatsCallback, run_figure, scale_statistics

from ._helpers import saved_scalevec, tiny_config

PNG = b"\x89PNG\r\n\x1a\n"


def training_folder(path: Path, warmup_steps: float) -> None:
    """A ScaleVec checkpoint with the records and picture that `scalevec-train` leaves beside it."""
    saved_scalevec(path, tiny_config())
    (path / RUN_PICTURE).write_bytes(PNG)
    state = {"global_step": 300, "max_steps": 300, "log_history": [{"loss": 2.5, "step": 300}]}
    (path / "trainer_state.json").write_text(json.dumps(state))
    (path / "training_args.json").write_text(json.dumps({"warmup_steps": warmup_steps, "seed": 0}))


def test_fold_reports_verification_once_and_lists_every_file_it_wrote(tmp_path, capsys, caplog):
    from scalevec.convert.cli import main

    caplog.set_level(logging.INFO, logger="scalevec.convert")  # what the command logs on a terminal
    training_folder(tmp_path / "run", warmup_steps=0.05)
    assert main(["fold", str(tmp_path / "run"), str(tmp_path / "out")]) == 0
    printed = capsys.readouterr().out + caplog.text
    assert "converting" in printed and printed.count("verification:") == 1, printed
    files_line = next(line for line in printed.splitlines() if line.startswith("files: "))
    listed = files_line.removeprefix("files: ").split(", ")
    assert listed == sorted(p.name for p in (tmp_path / "out").iterdir())
    assert {"README.md", RUN_PICTURE, "model.safetensors"} <= set(listed)


@pytest.mark.parametrize(
    "warmup_steps, row",
    [
        (0.05, "| warmup | 15 steps (5 % of the 300 optimizer steps) |"),
        (3, "| warmup | 3 steps |"),
    ],
)
def test_card_tells_a_warmup_ratio_from_a_number_of_steps(tmp_path, warmup_steps, row):
    from scalevec.convert.card import write_model_card

    training_folder(tmp_path / "run", warmup_steps)
    readme = write_model_card(
        tmp_path / "run", export_target="scalevec", source_config=tiny_config(), run_dir=tmp_path / "run"
    )
    text = ModelCard.load(readme).text
    assert row in text and "warmup steps" not in text


def test_run_figure_shows_the_eval_loss_and_whole_layer_numbers():
    model = ScaleVecForCausalLM(tiny_config(num_hidden_layers=3))
    history = [{"loss": 4.0, "step": 1}, {"loss": 3.0, "step": 2}, {"eval_loss": 3.2, "step": 2}]
    figure = run_figure(history, scale_statistics(model))
    losses, means, anisotropy = figure.axes[:3]
    curves = {line.get_label(): line.get_xydata().tolist() for line in losses.lines}
    assert curves == {"train": [[1, 4.0], [2, 3.0]], "eval": [[2, 3.2]]}
    for axis in (means, anisotropy):
        ticks = [tick for tick in axis.get_xticks() if axis.get_xlim()[0] <= tick <= axis.get_xlim()[1]]
        assert len(ticks) >= 2 and all(float(tick).is_integer() for tick in ticks), ticks


def test_the_picture_is_drawn_again_after_the_final_evaluation(tmp_path, monkeypatch):
    drawn = []
    monkeypatch.setattr(diagnostics, "plot_run", lambda history, stats, path: drawn.append(list(history)))
    model = ScaleVecForCausalLM(tiny_config())
    args = SimpleNamespace(output_dir=str(tmp_path))
    state = SimpleNamespace(is_world_process_zero=True, log_history=[{"loss": 3.0, "step": 4}])
    callback = ScaleStatsCallback()
    callback.on_evaluate(args, state, None, model=model)  # an evaluation during training: no picture yet
    assert drawn == []
    callback.on_train_end(args, state, None, model=model)
    state.log_history.append({"eval_loss": 3.1, "step": 4})
    callback.on_evaluate(args, state, None, model=model)
    assert [[entry.get("eval_loss") for entry in history] for history in drawn] == [[None], [None, 3.1]]
