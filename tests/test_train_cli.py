"""`scalevec-train` end to end on the embedded corpus, at a tiny size: the loss goes down,
diagnostics, resuming, two-process DDP, and bad inputs."""

import contextlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from scalevec import ScaleVecForCausalLM
from scalevec.train import DataArguments, default_tokenizer
from scalevec.train.cli import main
from scalevec.train.diagnostics import flat_log, scale_statistics

from ._helpers import SUBPROCESS_ENV, corpus_texts, log_history, logged_losses, run_torchrun, train_argv

pytestmark = pytest.mark.slow  # it starts processes or trains end to end

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
STATS = ("mean", "std", "min", "max", "anisotropy")


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    """36 steps of the default (unified, magnitude-direction) preset at a learning rate that learns quickly."""
    output = tmp_path_factory.mktemp("run") / "out"
    argv = train_argv(output, "--learning-rate", "3e-3", "--warmup-steps", "3", "--logging-steps", "3", steps=36)
    assert main(argv) == 0
    return output


def test_loss_goes_down_and_everything_is_saved(tiny_run):
    losses = logged_losses(tiny_run)
    assert len(losses) == 12 and all(math.isfinite(x) for x in losses)
    assert losses[0] > math.log(4096) - 0.3  # starts near uniform over the vocabulary
    assert losses[-1] < losses[0] - 0.5
    metrics = json.loads((tiny_run / "all_results.json").read_text())
    assert math.isfinite(metrics["eval_loss"]) and metrics["eval_perplexity"] == pytest.approx(
        math.exp(metrics["eval_loss"]), rel=1e-6
    )
    assert metrics["eval_bits_per_byte"] > 0 and metrics["num_input_tokens_seen"] == 36 * 4 * 32
    saved = AutoTokenizer.from_pretrained(tiny_run)
    reference = default_tokenizer()
    text = "def scale(vector): return vector * 2  # ünïcode"
    assert saved(text)["input_ids"] == reference(text)["input_ids"]
    assert (saved.eos_token, saved.pad_token) == (reference.eos_token, reference.pad_token)
    config = json.loads((tiny_run / "config.json").read_text())
    assert config["vocab_size"] == len(reference) and config["hidden_size"] == 32
    assert json.loads((tiny_run / "training_args.json").read_text())["learning_rate"] == 3e-3


def test_scale_statistics_are_logged_and_plotted(tiny_run):
    model = ScaleVecForCausalLM.from_pretrained(tiny_run)
    assert model.config.scale_param == "magdir"
    final = flat_log(scale_statistics(model))
    sites = {key.split("/")[1] for key in final}
    assert {"norm", "self_attn.q_proj.in_scale", "mlp.down_proj.out_scale"} <= sites
    train_logs = [entry for entry in log_history(tiny_run) if "loss" in entry]
    for entry in train_logs:
        for site in sites:
            for stat in (*STATS, "magnitude"):
                assert math.isfinite(entry[f"scale/{site}/{stat}"]), (entry["step"], site, stat)
    last = train_logs[-1]
    assert last["step"] == 36  # logged after the last update: the statistics of the saved model
    for key, value in final.items():
        assert last[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert train_logs[0]["scale/norm/std"] != last["scale/norm/std"]  # the scales moved
    picture = (tiny_run / "scale_vectors.png").read_bytes()
    assert picture.startswith(PNG_SIGNATURE)
    from PIL import Image

    with Image.open(tiny_run / "scale_vectors.png") as image:
        image.verify()
        assert image.format == "PNG" and image.size[0] > 800 and image.size[1] > 200


def test_resume_reproduces_the_straight_run(tmp_path):
    """8 steps straight, checkpointing at 4; then a run that holds only checkpoint-4 (what a run killed after
    step 4 leaves) resumed with --resume: same losses and same final weights, on CPU up to float noise."""
    argv = ["--save-strategy", "steps", "--save-steps", "4", "--eval-every", "0", "--scale-preset", "standard"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(train_argv(straight, *argv, steps=8)) == 0
    checkpoint = straight / "checkpoint-4"
    assert (checkpoint / "model.safetensors").is_file() and (checkpoint / "optimizer.pt").is_file()
    shutil.copytree(checkpoint, resumed / "checkpoint-4")
    assert main(train_argv(resumed, *argv, "--resume", "true", steps=8)) == 0
    first, second = log_history(straight), log_history(resumed)
    assert [e["step"] for e in second if "loss" in e] == list(range(1, 9))
    assert logged_losses(resumed) == pytest.approx(logged_losses(straight), abs=1e-6)
    assert [e.get("grad_norm") for e in second] == pytest.approx([e.get("grad_norm") for e in first], abs=1e-6)
    a, b = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    assert a.keys() == b.keys()
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=0, atol=1e-6, msg=key)
    direct = [key for key in first[0] if key.startswith("scale/")]  # direct scales: no magnitude statistic
    assert direct and all(key.rsplit("/", 1)[1] in STATS for key in direct)


def test_resume_takes_the_runs_model_unless_a_flag_given_contradicts_it(tmp_path, capsys):
    """The docs' shorthand `--output-dir RUN --resume` on a run of another size and strategy than the defaults:
    the run's model, as its checkpoint records it (the same losses as the straight run); a model flag given that
    contradicts it is refused in one line naming it, before anything is built or changed."""
    argv = ["--save-strategy", "steps", "--save-steps", "2", "--eval-every", "0", "--scale-preset", "standard"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    assert main(train_argv(straight, *argv, steps=4)) == 0
    shutil.copytree(straight / "checkpoint-2", resumed / "checkpoint-2")
    bare = ["--seq-len", "32", "--max-documents", "300", "--max-eval-documents", "4", "--eval-every", "0"]
    bare += ["--per-device-train-batch-size", "4", "--max-steps", "4", "--logging-steps", "1", "--save-steps", "2"]
    bare += ["--report-to", "none", "--disable-tqdm", "true", "--output-dir", str(resumed), "--resume", "true"]
    capsys.readouterr()
    assert main([*bare, "--model-size", "2x64", "--scale-preset", "none"]) == 1
    record = resumed / "checkpoint-2" / "config.json"
    error = capsys.readouterr().err
    assert error.startswith("scalevec-train: error: --resume: --model-size 2x64 sets hidden_size 64 (the run's 32), ")
    assert "; --scale-preset none sets scale_preset none (the run's standard), norm_scale none (the run's " in error
    assert error.endswith(
        f": they contradict the run's model ({record}); leave them out to resume the run as it was, or choose "
        "another --output-dir\n"
    )
    assert error.count("\n") == 1
    assert sorted(path.name for path in resumed.iterdir()) == ["checkpoint-2"]
    assert main(bare) == 0
    printed = capsys.readouterr().out
    assert f"resuming the run's model as {record} records it: hidden_size 32 (not 128), " in printed
    assert "scale_preset standard (not unified)" in printed
    assert logged_losses(resumed) == pytest.approx(logged_losses(straight), abs=1e-6)


def test_two_process_ddp_matches_one_process(tmp_path):
    """torchrun with 2 CPU processes (gloo), 2 blocks each, against one process with 4 blocks per step: the same
    blocks per step (the seeded sampler, split across ranks), so the same losses up to the order of the float
    reductions (gloo's all-reduce sums two half-batch gradients; ~1e-7 relative per step over 4 Adam steps)."""
    common = ["--eval-every", "0", "--scale-stats", "false", "--max-documents", "200"]
    ddp, single = tmp_path / "ddp", tmp_path / "single"
    module = ["-m", "scalevec.train.cli", *train_argv(ddp, *common, "--per-device-train-batch-size", "2", steps=4)]
    result = run_torchrun(*module)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "unpredictable behaviour" not in result.stderr  # runpy's warning when `-m` finds its module imported
    assert main(train_argv(single, *common, steps=4)) == 0  # 4 blocks per device, one device
    parallel, alone = log_history(ddp), log_history(single)
    tokens = [e["num_input_tokens_seen"] for e in parallel if "loss" in e]
    assert tokens == [128, 256, 384, 512]  # counted over both ranks: the run really was distributed
    assert tokens == [e["num_input_tokens_seen"] for e in alone if "loss" in e]
    assert logged_losses(ddp) == pytest.approx(logged_losses(single), rel=1e-5)
    grad_norms = [[e["grad_norm"] for e in history if "loss" in e] for history in (parallel, alone)]
    assert grad_norms[0] == pytest.approx(grad_norms[1], rel=1e-4)
    assert len(set(logged_losses(single))) == 4  # the losses differ step to step: the comparison means something


# --- bad inputs ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bad_data(tmp_path_factory):
    folder = tmp_path_factory.mktemp("bad")
    (folder / "empty.jsonl").write_text("")
    (folder / "body.jsonl").write_text("".join(json.dumps({"body": f"text {i} " * 30}) + "\n" for i in range(40)))
    return folder


BAD_INPUTS = {
    "missing dataset": (["--dataset", "{data}/nowhere.txt"], "--dataset {data}/nowhere.txt: no such file or folder"),
    "empty dataset": (["--dataset", "{data}/empty.jsonl"], "the dataset is empty"),
    "unknown size": (["--model-size", "huge"], "--model-size: size 'huge' is neither a preset (tiny, tiny-moe"),
    "unknown preset": (["--scale-preset", "bogus"], "`scale_preset` must be one of 'none', 'standard', 'unified'"),
    "seq len": (["--seq-len", "2048"], "--seq-len 2048 exceeds the model's max_position_embeddings (1024)"),
    "text column": (["--dataset", "{data}/body.jsonl"], "{data}/body.jsonl line 1: no 'text' field (it has"),
    "output dir": ([], "already holds files; pass --resume"),
    "resume without checkpoint": (["--resume", "true"], "--resume: no checkpoint-* folder"),
    "missing eval dataset": (
        ["--eval-dataset", "{data}/held.txt", "--eval-every", "0"],
        "--eval-dataset {data}/held.txt: no such file or folder",
    ),
}


@pytest.mark.parametrize("case", BAD_INPUTS)
def test_bad_inputs_fail_before_training(case, bad_data, tmp_path, capsys):
    flags, message = BAD_INPUTS[case]
    output = tmp_path / "out"
    if case in ("output dir", "resume without checkpoint"):
        output.mkdir()
        (output / "notes.txt").write_text("keep me")
    flags = [flag.format(data=bad_data) for flag in flags]
    assert main(train_argv(output, *flags)) == 1
    error = capsys.readouterr().err
    assert "scalevec-train: error: " in error and message.format(data=bad_data) in error
    assert "Traceback" not in error
    written = sorted(p.name for p in output.iterdir()) if output.exists() else []
    assert written in ([], ["notes.txt"])  # nothing trained, nothing saved
    if written:
        assert (output / "notes.txt").read_text() == "keep me"


MISTAKES = {  # (flags, the one line that names the problem); "{data}": a folder with two jsonl files
    "negative weight": (
        ["--dataset", "{data}/a.jsonl,{data}/b.jsonl", "--dataset-weights", "-0.3,1"],
        "--dataset-weights must all be positive; got -0.3,1",
    ),
    "missing value": (
        ["--max-steps"],
        "argument --max_steps/--max-steps: expected one argument (--help lists the options)",
    ),
    "list for one value": (["{data}/run.yaml"], "{data}/run.yaml: seq_len: expected one value, got a list ([64])"),
}


@pytest.mark.parametrize("case", MISTAKES)
def test_a_mistake_on_the_command_line_is_one_line_naming_it(case, tmp_path, capsys):
    """Not argparse's "expected one argument" for a negative value, nor its 140-line usage, nor a traceback."""
    (tmp_path / "run.yaml").write_text("seq_len: [64]\n")
    flags, message = MISTAKES[case]
    flags = [flag.format(data=tmp_path) for flag in flags]
    argv = flags if case == "list for one value" else train_argv(tmp_path / "out", *flags)
    assert main(argv) == 1
    assert capsys.readouterr().err.splitlines() == [f"scalevec-train: error: {message.format(data=tmp_path)}"]


def test_a_comma_inside_an_existing_path_does_not_split_it(tmp_path):
    """`--dataset` splits at commas except inside a path that exists: `my,notes.txt` is one source, and beside
    another source the weights count two."""
    commas, plain = tmp_path / "my,notes.txt", tmp_path / "plain.txt"
    for path in (commas, plain):
        path.write_text("".join(f"{text}\n" for text in corpus_texts(60)))
    mixture = DataArguments(dataset=f"{commas},{plain}", dataset_weights="1,3")
    assert mixture.entries() == [str(commas), str(plain)] and mixture.weights() == [1.0, 3.0]
    assert DataArguments(dataset=f"{plain},{plain}").entries() == [str(plain)] * 2
    output, cache = tmp_path / "out", tmp_path / "cache"
    assert main(train_argv(output, "--dataset", str(commas), "--prepared-cache", str(cache), steps=1)) == 0
    sources = json.loads((output / "training_data.json").read_text())["sources"]
    assert [(source["name"], source["documents"]) for source in sources] == [(str(commas), 57)]  # 3 held out


@contextlib.contextmanager
def made_unwritable(folder: Path):
    """`folder` read-only for this user: a read-only bind mount over it for root (whom permissions do not stop),
    else its write permission taken away. Skips the test where neither is possible."""
    if os.geteuid() != 0:
        folder.chmod(0o555)
        try:
            yield "permission denied"
        finally:
            folder.chmod(0o755)
        return
    for command in (["mount", "--bind", folder, folder], ["mount", "-o", "remount,bind,ro", folder]):
        if (result := subprocess.run(command, capture_output=True)).returncode:
            subprocess.run(["umount", folder], capture_output=True)
            pytest.skip(f"cannot bind-mount a folder read-only here: {result.stderr.decode().strip()}")
    try:
        yield "read-only file system"
    finally:
        subprocess.run(["umount", folder], check=True)


def test_an_output_folder_made_unwritable_mid_run_is_named_on_a_line_of_its_own(tmp_path):
    """The next checkpoint fails: the error names it and its cause on a line of its own (after the progress bar,
    not on its line), not the lock file that the run could not remove afterwards."""
    output = tmp_path / "out"
    flags = ["--save-strategy", "steps", "--save-steps", "4", "--eval-every", "0", "--disable-tqdm", "false"]
    command = [sys.executable, "-m", "scalevec.train.cli", *train_argv(output, *flags, steps=400)]
    environment = {**os.environ, **SUBPROCESS_ENV}
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=environment)
    try:
        while not (output / "checkpoint-4").exists() and process.poll() is None:
            time.sleep(0.001)
        assert process.poll() is None, process.communicate()[1][-3000:]
        with made_unwritable(output) as cause:
            _, err = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 1
    errors = [line for line in err.split("\n") if "scalevec-train" in line]
    assert len(errors) == 1 and re.fullmatch(rf"scalevec-train: error: {output}/checkpoint-\d+: {cause}", errors[0])


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, capsys):
    """At a learning rate of 1e30 the weights overflow in the second update (the loss before it still finite) and
    the loss is NaN at step 3: with a checkpoint every step, the overflowed weights are refused and checkpoint-1
    is the last (good) one; without checkpoints the NaN loss stops the run."""
    output = tmp_path / "out"
    flags = ["--learning-rate", "1e30", "--warmup-steps", "0", "--eval-every", "0"]
    assert main(train_argv(output, *flags, "--save-strategy", "steps", "--save-steps", "1", steps=6)) == 1
    error = capsys.readouterr().err
    assert "scalevec-train: error: the weights became non-finite in the update of step 2" in error
    assert f"the last good checkpoint is {output / 'checkpoint-1'}. Lower the learning rate" in error
    assert sorted(p.name for p in output.glob("checkpoint-*")) == ["checkpoint-1"]
    weights = load_file(output / "checkpoint-1" / "model.safetensors")
    assert all(torch.isfinite(t).all() for t in weights.values())
    assert not (output / "model.safetensors").exists()  # the diverged model was not saved as the result

    unsaved = tmp_path / "unsaved"
    assert main(train_argv(unsaved, *flags, "--save-strategy", "no", steps=6)) == 1
    error = capsys.readouterr().err
    assert (
        "scalevec-train: error: the training loss became nan at step 3; training stopped before the optimizer" in error
    )
    assert "no checkpoint was saved yet" in error and not (unsaved / "model.safetensors").exists()


def test_model_size_takes_layers_x_hidden_by_the_study_rule():
    from scalevec.train.cli import ModelArguments, build_model_config

    config = build_model_config(ModelArguments(model_size="3x96"), default_tokenizer())
    shape = (config.num_hidden_layers, config.hidden_size, config.num_attention_heads, config.num_key_value_heads)
    assert shape == (3, 96, 3, 1) and config.intermediate_size == 256  # 8/3 x 96, a multiple of 16
    assert build_model_config(ModelArguments(model_size="4x128"), default_tokenizer()).to_diff_dict() == (
        build_model_config(ModelArguments(model_size="tiny"), default_tokenizer()).to_diff_dict()
    )
