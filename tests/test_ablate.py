"""`scalevec-ablate`'s variants on the embedded corpus at a tiny size: variants of one seed start alike and read the
same batches, and the weight-decay variants set the decays. The study's grid end to end (shards, diverged runs,
selection, records, report) is tests/test_study.py's."""

import pytest
import torch
from safetensors.torch import load_file

from scalevec.run_records import read_run_records
from scalevec.train import ablate
from scalevec.train.study.arguments import AblationArguments
from scalevec.train.study.variants import VARIANT_GROUPS

from ._helpers import logged_losses, train_argv

pytestmark = pytest.mark.slow  # it starts processes or trains end to end


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
    chosen = AblationArguments(variants="standard,weight-decay,none").variant_names()
    assert chosen == ["standard", *VARIANT_GROUPS["weight-decay"][1:], "none"]
    assert AblationArguments().variant_names() == VARIANT_GROUPS["strategies"]
    assert VARIANT_GROUPS["strategies"] == ["none", "standard", "branch", "placement", "magdir", "unified"]
    assert AblationArguments(seeds="2,1,2").seed_list(default=42) == [2, 1]
    for argv, message in (
        (["--scale-preset", "standard"], "--scale-preset: scalevec-ablate sets the scale strategy per variant"),
        (["--variants", "standard,nonesuch"], "--variants: unknown 'nonesuch'"),
        (["--seeds", "1,x"], "--seeds must be comma-separated integers"),
    ):
        assert ablate.main([*argv, *train_argv(tmp_path / "refused", steps=4)]) == 1
        assert message in capsys.readouterr().err
    assert not (tmp_path / "refused").exists()
