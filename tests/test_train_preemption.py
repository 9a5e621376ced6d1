"""`scalevec-train` on preemptible machines, run as real processes: a restarted run continues from its newest
complete checkpoint with the uninterrupted run's losses, partial checkpoints are set aside (never deleted), a
finished run trains nothing, and a full or read-only disk ends in one line naming the path."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from scalevec import atomic, quickstart
from scalevec.atomic import remove_folder, rename_noreplace
from scalevec.convert import OutputOptions, export_checkpoint
from scalevec.convert.card import card_writer
from scalevec.run_records import RUN_CLOCK, duration_text
from scalevec.train.cli import main
from scalevec.train.resume import checkpoint_content
from scalevec.train.run_lock import LOCK_NAME, holding_output_dir

from ._helpers import SUBPROCESS_ENV, log_history, logged_losses, mounted_tmpfs, record_fsyncs, train_argv

pytestmark = pytest.mark.slow  # it starts processes or trains end to end

CHECKPOINTING = ["--save-strategy", "steps", "--save-steps", "4", "--eval-every", "0", "--scale-preset", "standard"]
STEPS = 8


def argv(output: Path, *flags: str) -> list[str]:
    return train_argv(output, *CHECKPOINTING, *flags, steps=STEPS)


def start_training(output: Path, *flags: str) -> subprocess.Popen:
    """`scalevec-train` as a process of its own, as a job scheduler starts it."""
    command = [sys.executable, "-m", "scalevec.train.cli", *argv(output, *flags)]
    return subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env={**os.environ, **SUBPROCESS_ENV},
    )


def messages(stream: str) -> list[str]:
    """What scalevec-train itself said (not the warnings of the libraries it imports); never a traceback."""
    assert "Traceback" not in stream, stream
    return [line for line in stream.splitlines() if line.startswith("scalevec-train:")]


def names_in(folder: Path) -> list[str]:
    return sorted(path.name for path in folder.iterdir())


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """The uninterrupted run: 8 steps, checkpoints at 4 and 8, written atomically (no staging folder left)."""
    output = tmp_path_factory.mktemp("straight") / "run"
    assert main(argv(output)) == 0
    assert [name for name in names_in(output) if "checkpoint" in name or name.startswith(".")] == [
        "checkpoint-4",
        "checkpoint-8",
    ]
    return output


def assert_same_run(resumed: Path, straight: Path) -> None:
    assert [entry["step"] for entry in log_history(resumed) if "loss" in entry] == list(range(1, STEPS + 1))
    assert logged_losses(resumed) == pytest.approx(logged_losses(straight), abs=1e-5)
    assert len(set(logged_losses(straight))) == STEPS  # the losses move: the comparison means something
    expected, got = load_file(straight / "model.safetensors"), load_file(resumed / "model.safetensors")
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-5, msg=name)


# Partial checkpoint-8 folders as a kill (or an older writer) leaves them, beside a complete checkpoint-4.
def _no_state(folder: Path) -> None:
    (folder / "trainer_state.json").unlink()


def _empty_state(folder: Path) -> None:
    (folder / "trainer_state.json").write_text("")


def _no_optimizer(folder: Path) -> None:
    (folder / "optimizer.pt").unlink()


def _half_weights(folder: Path) -> None:
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])


PARTIAL = {
    "no state": (_no_state, "trainer_state.json missing"),
    "empty state": (_empty_state, "trainer_state.json unreadable (empty or cut short)"),
    "no optimizer": (_no_optimizer, "optimizer.pt missing"),
    "weights half-written": (_half_weights, "model.safetensors unreadable (missing or cut short)"),
}


def run_with_partial_checkpoint(straight: Path, tmp_path: Path, case: str) -> Path:
    """A copy of the straight run as a kill while saving checkpoint-8 leaves it: checkpoint-4, a partial
    checkpoint-8, no final result."""
    output = tmp_path / "run"
    output.mkdir()
    for name in ("checkpoint-4", "checkpoint-8"):
        shutil.copytree(straight / name, output / name)
    PARTIAL[case][0](output / "checkpoint-8")
    return output


@pytest.mark.parametrize("case", PARTIAL)
def test_resume_sets_a_partial_checkpoint_aside_and_reproduces_the_straight_run(straight, tmp_path, case, capsys):
    output = run_with_partial_checkpoint(straight, tmp_path, case)
    partial_files = names_in(output / "checkpoint-8")
    assert main(argv(output, "--resume", "true")) == 0
    assert messages(capsys.readouterr().out) == [
        "scalevec-train: warning: set aside incomplete checkpoints, kept: "
        f"checkpoint-8 ({PARTIAL[case][1]}) -> incomplete-checkpoint-8"
    ]
    assert names_in(output / "incomplete-checkpoint-8") == partial_files  # kept as it was
    assert_same_run(output, straight)
    assert "checkpoint-8" in names_in(output)  # saved again, complete


def test_missing_optimizer_state_is_refused_unless_weights_only(straight, tmp_path, capsys):
    output = tmp_path / "run"
    shutil.copytree(straight / "checkpoint-4", output / "checkpoint-4")
    (output / "checkpoint-4" / "scheduler.pt").unlink()
    assert main(argv(output, "--resume", "true")) == 1
    assert messages(capsys.readouterr().err) == [
        f"scalevec-train: error: {output / 'checkpoint-4' / 'scheduler.pt'} is missing: resuming from checkpoint-4 "
        "would restart the optimizer and the learning-rate schedule, so the losses would differ from an "
        "uninterrupted run; pass --resume-weights-only to restart from its weights anyway"
    ]
    assert names_in(output) == ["checkpoint-4"]

    assert main(argv(output, "--resume", "true", "--resume-weights-only", "true")) == 0
    assert messages(capsys.readouterr().out) == [
        "scalevec-train: warning: checkpoint-4 lacks scheduler.pt: resuming from its weights with a fresh optimizer "
        "and learning-rate schedule"
    ]
    losses, reference = logged_losses(output), logged_losses(straight)
    assert losses[:5] == pytest.approx(reference[:5], abs=1e-5)  # step 5's loss comes before any new update
    assert max(abs(a - b) for a, b in zip(losses[5:], reference[5:], strict=True)) > 1e-3  # a fresh optimizer


def test_resume_of_a_finished_run_trains_nothing(straight, tmp_path, capsys):
    output = tmp_path / "run"
    shutil.copytree(straight, output)
    before = {path.name: path.read_bytes() for path in output.iterdir() if path.is_file()}
    assert main(argv(output, "--resume", "true")) == 0
    assert messages(capsys.readouterr().out) == [
        f"scalevec-train: the run in {output} already finished at step 8: nothing to train"
    ]
    assert {path.name: path.read_bytes() for path in output.iterdir() if path.is_file()} == before
    assert names_in(output) == names_in(straight)


def test_a_run_killed_after_its_last_checkpoint_saves_it_without_another_step(straight, tmp_path, capsys):
    output = tmp_path / "run"
    shutil.copytree(straight / "checkpoint-8", output / "checkpoint-8")
    assert main(argv(output, "--resume", "true")) == 0
    assert messages(capsys.readouterr().out) == [
        f"scalevec-train: {output / 'checkpoint-8'} holds the last step: nothing to train, saving it as the result"
    ]
    assert_same_run(output, straight)


def test_a_run_killed_during_a_save_resumes_as_if_never_stopped(straight, tmp_path):
    """A real process killed (SIGKILL) as soon as it starts writing checkpoint-4, restarted with the same command.
    Wherever the kill lands (the save takes milliseconds), every `checkpoint-N` it left is complete, and the
    restart gives the uninterrupted run."""
    output = tmp_path / "run"
    process = start_training(output)
    staging = output / ".checkpoint-4.staging"
    while not staging.exists() and process.poll() is None:
        time.sleep(0.0005)
    process.kill()
    process.communicate()
    assert process.returncode == -signal.SIGKILL
    left = [checkpoint_content(folder) for folder in output.glob("checkpoint-*")]
    assert all(checkpoint.complete for checkpoint in left), [c.problem() for c in left]
    restarted = start_training(output, "--resume", "true")
    _, err = restarted.communicate(timeout=300)
    assert restarted.returncode == 0, err[-3000:]
    assert messages(err) == []
    assert_same_run(output, straight)
    assert not staging.exists()


def recorded_clock(folder: Path) -> dict:
    """The run's clock as `folder/trainer_state.json` (a checkpoint's or a finished run's) recorded it."""
    state = json.loads((folder / "trainer_state.json").read_text())
    return state["stateful_callbacks"][RUN_CLOCK]["attributes"]["recorded_clock"]


def test_a_run_resumed_twice_reports_the_whole_run(tmp_path, capsys):
    """An uninterrupted run with a checkpoint every 2 steps; the same run stopped after checkpoint-2, resumed,
    stopped again after checkpoint-6 and resumed again: the end block, run_summary.json and the model card give the
    uninterrupted run's steps, tokens and mean loss, and the time of all three segments (each up to its last
    checkpoint), not the last segment's figures under the whole run's labels."""
    straight, second, third = tmp_path / "straight", tmp_path / "second", tmp_path / "third"
    assert main(argv(straight, "--save-steps", "2")) == 0
    shutil.copytree(straight / "checkpoint-2", second / "checkpoint-2")
    assert main(argv(second, "--resume", "true", "--save-steps", "2")) == 0
    shutil.copytree(second / "checkpoint-6", third / "checkpoint-6")
    capsys.readouterr()
    assert main(argv(third, "--resume", "true", "--save-steps", "2")) == 0
    done = capsys.readouterr().out.split("== scalevec-train: done ==")[1]
    assert_same_run(third, straight)
    expected, summary = (json.loads((run / "run_summary.json").read_text()) for run in (straight, third))
    assert (summary["steps"], summary["tokens_seen"]) == (expected["steps"], expected["tokens_seen"]) == (8, 1024)
    assert expected["mean_train_loss"] == json.loads((straight / "all_results.json").read_text())["train_loss"]
    assert summary["mean_train_loss"] == pytest.approx(expected["mean_train_loss"], abs=1e-5)
    assert summary["mean_train_loss_steps"] == 8 and summary["segment_starts"] == [0, 2, 6]
    runtimes = [json.loads((run / "all_results.json").read_text())["train_runtime"] for run in (second, third)]
    walls = [recorded_clock(run)["wall_seconds"] for run in (straight / "checkpoint-2", second / "checkpoint-6")]
    walls.append(summary["wall_seconds"])
    assert 0 < walls[0] < walls[1] < walls[2]  # each segment adds its time ...
    assert walls[1] - walls[0] <= runtimes[0] + 1e-3 and walls[2] - walls[1] <= runtimes[1] + 1e-3  # ... and no more
    assert 0 < summary["training_seconds"] < summary["wall_seconds"]
    assert summary["tokens_per_second"] == pytest.approx(1024 / summary["training_seconds"], rel=1e-3)
    wall = f"{duration_text(summary['wall_seconds'])} over 3 segments (resumed at steps 2 and 6)"
    assert f"trained      8 steps, 1,024 tokens in {wall} on {summary['hardware']} (fp32): " in done
    assert f"(the last logged; the mean over all 8 steps was {summary['mean_train_loss']:.4f})" in done

    export_checkpoint(third, tmp_path / "export", "llama", OutputOptions(before_commit=card_writer(third)))
    card = (tmp_path / "export" / "README.md").read_text()
    assert "| optimizer steps | 8 |" in card and "| tokens seen | 1,024 |" in card
    assert f"| mean training loss | {summary['mean_train_loss']:.4f} (over all 8 steps) |" in card
    assert f"| training wall time | {wall} on {summary['hardware']} (fp32) |" in card
    speed = f"{summary['tokens_per_second']:,.0f} tokens/s over {duration_text(summary['training_seconds'])}"
    assert f"| throughput | {speed} of training |" in card


@pytest.mark.parametrize("kind", ["a folder of someone's files", "a file"])
def test_resume_refuses_a_checkpoint_folder_no_run_wrote(tmp_path, capsys, kind):
    """`checkpoint-7` holding only the user's data.csv (or a file of that name) is not an incomplete checkpoint to
    set aside: the folder is refused, named, and left as it was."""
    output, foreign = tmp_path / "mine", tmp_path / "mine" / "checkpoint-7"
    if kind == "a file":
        output.mkdir()
        foreign.write_text("notes")
        content = "a file, not a folder"
    else:
        foreign.mkdir(parents=True)
        (foreign / "data.csv").write_text("x,y\n1,2\n")
        content = "it holds data.csv, and no trainer state, weights or optimizer state"
    assert main(argv(output, "--resume", "true")) == 1
    assert messages(capsys.readouterr().err) == [
        f"scalevec-train: error: --resume: {foreign} is not a checkpoint ({content}): move it out of {output}, or "
        "choose another --output-dir"
    ]
    assert names_in(output) == ["checkpoint-7"]
    assert names_in(foreign) == ["data.csv"] if kind != "a file" else foreign.read_text() == "notes"


def test_a_kill_before_the_first_complete_save_restarts_from_scratch(straight, tmp_path, capsys):
    """What an atomic save killed midway leaves: a hidden staging folder, which is no checkpoint."""
    output = tmp_path / "run"
    shutil.copytree(straight / "checkpoint-4", output / ".checkpoint-4.staging" / "checkpoint-4")
    assert main(argv(output, "--resume", "true")) == 0
    assert messages(capsys.readouterr().out) == [
        f"scalevec-train: no checkpoint in {output} yet: training from step 0"
    ]
    assert_same_run(output, straight)
    assert not (output / ".checkpoint-4.staging").exists()


def test_rotation_keeps_the_best_and_the_newest_checkpoint_under_their_final_names(tmp_path):
    """`save_total_limit` and `best_model_checkpoint` see the checkpoints where they end up, not where they were
    staged: the best one survives rotation and is the one loaded at the end."""
    output = tmp_path / "run"
    flags = ["--save-strategy", "steps", "--save-steps", "2", "--eval-strategy", "steps", "--eval-steps", "2"]
    flags += ["--save-total-limit", "1", "--load-best-model-at-end", "true", "--metric-for-best-model", "loss"]
    flags += ["--greater-is-better", "true"]  # the "best" is the first checkpoint: it must outlive three rotations
    assert main(train_argv(output, *flags, steps=STEPS)) == 0
    state = json.loads((output / "trainer_state.json").read_text())
    evals = {entry["step"]: entry["eval_loss"] for entry in state["log_history"] if "eval_loss" in entry}
    best_step = max(evals, key=evals.get)
    assert best_step == 2
    assert state["best_model_checkpoint"] == str(output / f"checkpoint-{best_step}")
    assert [name for name in names_in(output) if "checkpoint" in name] == [f"checkpoint-{best_step}"]
    assert not [name for name in names_in(output) if name.startswith(".")]
    best = load_file(output / f"checkpoint-{best_step}" / "model.safetensors")
    final = load_file(output / "model.safetensors")
    assert all(torch.equal(final[name], best[name]) for name in best)  # loaded from its final path at the end


def test_a_checkpoint_is_flushed_to_disk_before_it_is_renamed_into_place(tmp_path, monkeypatch):
    output = tmp_path / "run"
    flushed = record_fsyncs(monkeypatch)
    assert main(train_argv(output, *CHECKPOINTING, steps=4)) == 0
    staged = str(output / ".checkpoint-4.staging" / "checkpoint-4")
    staged_files = [path for path in flushed if path.startswith(staged + "/")]
    assert {Path(path).name for path in staged_files} == set(names_in(output / "checkpoint-4"))
    renamed = flushed.index(str(output))  # the parent, after the rename
    assert renamed > flushed.index(staged) > max(flushed.index(path) for path in staged_files)


# --- OS errors ----------------------------------------------------------------------------------------------


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 2 MiB tmpfs: a checkpoint's weights fit, its optimizer state (2.2 MB) does not."""
    with mounted_tmpfs(tmp_path / "small", "2m") as mount_point:
        yield mount_point


def test_a_full_disk_during_a_checkpoint_says_no_space_and_leaves_nothing(small_tmpfs):
    """torch.save reports a full disk as "unexpected pos ..."; the user reads the path and "no space"."""
    output = small_tmpfs / "run"
    process = start_training(output)
    _, err = process.communicate(timeout=300)
    assert process.returncode == 1
    assert messages(err) == [f"scalevec-train: error: {output / 'checkpoint-4'}: no space left on the device"]
    assert names_in(small_tmpfs) == []


def test_a_read_only_output_folder_is_named(small_tmpfs, capsys):
    subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], check=True)
    output = small_tmpfs / "run"
    assert main(argv(output)) == 1
    assert messages(capsys.readouterr().err) == [f"scalevec-train: error: {output}: read-only file system"]

    assert quickstart.main(argv(output)) == 1  # its --output-dir is the same folder
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert [line for line in err.splitlines() if line.startswith("scalevec-quickstart:")] == [
        f"scalevec-quickstart: error: {output}: read-only file system"
    ]


# --- the primitives under it ------------------------------------------------------------------------------


@pytest.mark.parametrize("way", ["renameat2", "lock on the parent"])
def test_rename_noreplace_never_replaces(tmp_path, monkeypatch, way):
    if way != "renameat2":  # as on a system without renameat2(RENAME_NOREPLACE)
        monkeypatch.setattr(atomic, "_renameat2_noreplace", lambda source, destination: False)
    (tmp_path / "new").mkdir()
    (tmp_path / "existing").mkdir()  # empty: a plain rename would replace it silently
    with pytest.raises(FileExistsError):
        rename_noreplace(tmp_path / "new", tmp_path / "existing")
    assert names_in(tmp_path) == ["existing", "new"]
    rename_noreplace(tmp_path / "new", tmp_path / "fresh")
    assert names_in(tmp_path) == ["existing", "fresh"]


def test_remove_folder_leaves_no_half_checkpoint(tmp_path):
    folder = tmp_path / "checkpoint-4"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"x")
    (tmp_path / ".checkpoint-4.deleting").mkdir()  # left by a process killed while deleting
    remove_folder(folder)
    assert names_in(tmp_path) == []


HOLD_AND_FORK = """
import multiprocessing, sys, time
from pathlib import Path
from scalevec.train.run_lock import holding_output_dir
with holding_output_dir(Path(sys.argv[1])):
    worker = multiprocessing.get_context("fork").Process(target=time.sleep, args=(120,))  # as a DataLoader's
    worker.start()
    print(worker.pid, flush=True)
    time.sleep(120)
"""


def test_the_run_lock_ends_with_the_runs_process_not_with_its_forked_workers(tmp_path):
    """A run killed with SIGKILL while a forked worker of its DataLoader lives on: the next run takes the folder at
    once (a preemption wrapper restarts straight away), not when the orphaned worker notices and exits."""
    run = subprocess.Popen(
        [sys.executable, "-c", HOLD_AND_FORK, str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **SUBPROCESS_ENV},
    )
    worker = int(run.stdout.readline())
    try:
        run.kill()
        run.wait(timeout=60)
        os.kill(worker, 0)  # the worker is still there, holding its copy of the run's descriptors
        with holding_output_dir(tmp_path):
            assert (tmp_path / LOCK_NAME).read_text() == f"{os.getpid()}\n"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(worker, signal.SIGKILL)
