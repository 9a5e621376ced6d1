"""`scalevec-ablate` end to end on the embedded corpus at a tiny size: the table over seeds agrees with what each run
recorded, variants of one seed start alike and read the same batches, and the weight-decay variants set the decays."""

import json
import math
import statistics

import pytest
import torch
from safetensors.torch import load_file

from scalevec.run_records import read_run_records
from scalevec.train import ablate

from ._helpers import log_history, logged_losses, train_argv

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def final_eval_loss(run_dir) -> float:
    """The eval loss of the evaluation after training, as `trainer_state.json` recorded it."""
    return [entry["eval_loss"] for entry in log_history(run_dir) if "eval_loss" in entry][-1]


def test_mean_std_and_paired_differences_over_two_seeds(tmp_path, capsys):
    root = tmp_path / "ablation"
    argv = ["--variants", "none,standard", "--seeds", "3,4", *train_argv(root, "--max-eval-documents", "2", steps=4)]
    assert ablate.main(argv) == 0
    evals = {
        (v, s): final_eval_loss(root / "tiny" / f"{v}-lr0.001-seed{s}") for v in ("none", "standard") for s in (3, 4)
    }
    summary = {entry["variant"]: entry for entry in json.loads((root / "results.json").read_text())["summary"]}

    none, standard = summary["none"], summary["standard"]
    assert none["eval_loss_mean"] == pytest.approx(statistics.mean([evals["none", 3], evals["none", 4]]), abs=1e-12)
    assert none["eval_loss_std"] == pytest.approx(abs(evals["none", 3] - evals["none", 4]) / math.sqrt(2), abs=1e-12)
    assert none["eval_loss_std"] > 0  # another seed is another initialisation and data order
    differences = {s: evals["none", s] - evals["standard", s] for s in (3, 4)}
    assert none["differences"] == pytest.approx({str(s): d for s, d in differences.items()}, abs=1e-12)
    assert (none["reference"], none["expected"]) == ("standard", "higher")
    assert none["holds"] == sum(d > 0 for d in differences.values())
    assert (standard["reference"], standard["differences"]) == (None, {})

    table = (root / "results.md").read_text()
    mean_difference = statistics.mean(differences.values())
    row = next(line for line in table.splitlines() if line.startswith("| none |"))
    assert f"| 0.001 | {none['eval_loss_mean']:.4f} ± {none['eval_loss_std']:.4f} | standard (lr 0.001) |" in row
    assert f"| {differences[3]:+.4f}, {differences[4]:+.4f} | {mean_difference:+.4f} ± " in row
    assert f"| Δ > 0 | {none['holds']}/2 |" in row
    assert any(line.startswith("- seed 3: ") for line in table.splitlines())
    assert table in capsys.readouterr().out

    runs = json.loads((root / "results.json").read_text())["runs"]
    assert [(r["variant"], r["seed"]) for r in runs] == [("none", 3), ("standard", 3), ("none", 4), ("standard", 4)]
    for run in runs:
        assert run["train_loss"] == logged_losses(run["output_dir"])[-1]
        assert run["tokens"] == 4 * 4 * 32
    assert runs[0]["scale_parameters"] == 0 < runs[1]["scale_parameters"]
    assert (root / "loss_curves.png").read_bytes().startswith(PNG_SIGNATURE)


def test_variants_of_a_seed_start_alike_and_read_the_same_batches(tmp_path):
    """At learning rate 0 nothing moves: the saved weights are the initial ones, and every variant whose scales
    start at 1 computes the function of `none`, so it logs the same loss on the same batch at every step."""
    variants = ["none", "unified", "standard-input-exempt", "unified-output-norm-decayed", "standard-decay-to-one"]
    root = tmp_path / "frozen"
    argv = ["--variants", ",".join(variants), *train_argv(root, "--learning-rate", "0", "--seed", "7", steps=3)]
    assert ablate.main(argv) == 0
    runs = {name: root / "tiny" / f"{name}-lr0-seed7" for name in variants}
    reference = load_file(runs["none"] / "model.safetensors")
    for name, run in runs.items():
        weights = load_file(run / "model.safetensors")
        assert all(torch.equal(weights[key], matrix) for key, matrix in reference.items()), name
    for name in ("unified", "standard-input-exempt"):  # output norms change the function, not the batches
        assert logged_losses(runs[name]) == pytest.approx(logged_losses(runs["none"]), abs=1e-5)
    assert len(set(logged_losses(runs["none"]))) == 3  # three different batches

    decays = {name: read_run_records(run).training_args for name, run in runs.items()}
    assert decays["unified"]["input_scale_weight_decay"] is None  # the flags' rule: --weight-decay
    assert decays["standard-input-exempt"]["input_scale_weight_decay"] == 0.0
    assert decays["unified"]["output_scale_weight_decay"] == 0.0
    assert decays["unified-output-norm-decayed"]["output_scale_weight_decay"] == 0.1  # --weight-decay
    assert (
        decays["standard-decay-to-one"]["scale_decay_target"] == 1.0 and decays["unified"]["scale_decay_target"] == 0
    )


def test_variant_groups_and_refusals(tmp_path, capsys):
    chosen = ablate.AblationArguments(variants="standard,weight-decay,none").variant_names()
    assert chosen == ["standard", *ablate.VARIANT_GROUPS["weight-decay"][1:], "none"]
    assert ablate.AblationArguments().variant_names() == ablate.VARIANT_GROUPS["strategies"]
    assert ablate.VARIANT_GROUPS["strategies"] == ["none", "standard", "branch", "placement", "magdir", "unified"]
    assert ablate.AblationArguments(seeds="2,1,2").seed_list(default=42) == [2, 1]
    for argv, message in (
        (["--scale-preset", "standard"], "--scale-preset: scalevec-ablate sets the scale strategy per variant"),
        (["--variants", "standard,nonesuch"], "--variants: unknown 'nonesuch'"),
        (["--seeds", "1,x"], "--seeds must be comma-separated integers"),
    ):
        assert ablate.main([*argv, *train_argv(tmp_path / "refused", steps=4)]) == 1
        assert message in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()
