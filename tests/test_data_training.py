"""The data paths under `scalevec-train`, as real processes: a run killed and resumed gives the uninterrupted run's
losses on the streamed path and on a prepared mixture (whose card counts the passes the run made); two gloo ranks
read what one process reads, split between them (a stream before it is tokenised); and the training command refuses
impossible input before it builds anything, naming it."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from scalevec.convert import OutputOptions, export_checkpoint
from scalevec.convert.card import card_writer
from scalevec.data import default_tokenizer, find_source
from scalevec.data.streaming import streamed_blocks
from scalevec.train.cli import main

from ._helpers import (
    SUBPROCESS_ENV,
    corpus_texts,
    log_history,
    logged_losses,
    run_torchrun,
    train_argv,
    write_dataset,
    write_parts,
)

pytestmark = pytest.mark.slow  # it starts processes or trains end to end

STEPS = 12


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """Two sources of four jsonl files each: a main corpus and a smaller one to mix in."""
    folder = tmp_path_factory.mktemp("sources")
    texts = corpus_texts(400, seed=11)
    for index in range(4):
        write_dataset(folder / "main" / f"part-{index}", "jsonl", texts[index * 80 : (index + 1) * 80])
        write_dataset(folder / "extra" / f"part-{index}", "jsonl", [t.upper() for t in texts[320 + index * 20 :][:20]])
    return {"main": folder / "main", "extra": folder / "extra", "cache": folder / "cache"}


PATHS = {
    "streamed": lambda s: ["--dataset", str(s["main"]), "--streaming", "true", "--stream-window", "20"],
    "prepared mixture": lambda s: ["--dataset", f"{s['main']},{s['extra']}", "--dataset-weights", "0.6,0.4"],
}


def argv(output: Path, sources: dict, path: str, *flags: str) -> list[str]:
    data = [*PATHS[path](sources), "--prepared-cache", str(sources["cache"]), "--max-eval-documents", "8"]
    checkpoints = ["--save-strategy", "steps", "--save-steps", "4", "--scale-preset", "standard"]
    return train_argv(output, *data, *checkpoints, *flags, steps=STEPS, max_documents=None)


def run(arguments: list[str]) -> subprocess.Popen:
    command = [sys.executable, "-m", "scalevec.train.cli", *arguments]
    environment = {**os.environ, **SUBPROCESS_ENV}
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=environment)


@pytest.mark.parametrize("path", PATHS)
def test_a_killed_run_resumes_with_the_uninterrupted_losses(path, sources, tmp_path):
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    assert main(argv(straight, sources, path)) == 0
    process = run(argv(killed, sources, path))
    while not (killed / "checkpoint-8").exists() and process.poll() is None:
        time.sleep(0.01)
    process.send_signal(signal.SIGKILL)
    process.communicate()
    assert (killed / "checkpoint-8").exists() and not (killed / "model.safetensors").exists()
    resumed = run(argv(killed, sources, path, "--resume", "true"))
    _, err = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, err[-3000:]
    assert [entry["step"] for entry in log_history(killed) if "loss" in entry] == list(range(1, STEPS + 1))
    assert logged_losses(killed) == pytest.approx(logged_losses(straight), abs=1e-6)
    assert len(set(logged_losses(straight))) == STEPS
    record = json.loads((straight / "training_data.json").read_text())
    if path == "streamed":
        assert record["streaming"] and record["sources"][0]["kind"] == "streamed"
        assert (straight / "checkpoint-4" / "data_state_rank0.json").is_file()
    else:
        assert [source["share"] for source in record["sources"]] == pytest.approx([0.6, 0.4], abs=1e-3)
        export_checkpoint(straight, tmp_path / "export", "llama", OutputOptions(before_commit=card_writer(straight)))
        card = (tmp_path / "export" / "README.md").read_text()
        main_row = next(line for line in card.splitlines() if line.startswith(f"| `{sources['main']}` |"))
        seen = STEPS * 4 * 32  # steps x batch x --seq-len, 60 % of them from `main`
        passes = record["sources"][0]["share"] * seen / record["sources"][0]["tokens"]
        assert 0.01 < passes < 1 and main_row.endswith(
            f"| {record['sources'][0]['tokens']:,} | 60.0 % ({passes:.3g} passes over it) |"
        )
        assert "blocks of 32 tokens, tokenizer the embedded byte-level BPE (4,096 tokens)" in card


RECORDING_RUN = """
import json, os, sys
from scalevec.data.streaming import WindowPacker
from scalevec.train import ScaleVecTrainer
from scalevec.train.cli import main

record = {"batches": [], "packed": []}
step, pack = ScaleVecTrainer.training_step, WindowPacker.__call__


def recording_step(self, model, inputs, num_items_in_batch=None):
    record["batches"].append(inputs["input_ids"].tolist())
    return step(self, model, inputs, num_items_in_batch)


def recording_pack(self, batch):
    record["packed"] += batch["texts"][0]
    return pack(self, batch)


ScaleVecTrainer.training_step, WindowPacker.__call__ = recording_step, recording_pack
code = main(sys.argv[2:])
with open(os.path.join(sys.argv[1], f"record-rank{os.environ.get('RANK', '0')}.json"), "w") as file:
    json.dump(record, file)
sys.exit(code)
"""


def recorded_run(tmp_path: Path, name: str, nproc: int, *flags: str, max_documents: int | None = 300) -> list:
    """Each rank's training batches and the documents it packed (streaming in the training process), from a real
    run (under torchrun for several processes)."""
    script = tmp_path / "recording_run.py"
    script.write_text(RECORDING_RUN)
    records = tmp_path / name
    records.mkdir()
    arguments = [str(records), *train_argv(records / "run", *flags, steps=6, max_documents=max_documents)]
    if nproc == 1:
        environment = {**os.environ, **SUBPROCESS_ENV}
        command = [sys.executable, str(script), *arguments]
        result = subprocess.run(command, capture_output=True, text=True, env=environment, timeout=300)
    else:
        result = run_torchrun(str(script), *arguments, nproc=nproc)
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads((records / f"record-rank{rank}.json").read_text()) for rank in range(nproc)]


def test_two_ranks_take_one_global_batch_between_them_on_the_prepared_path(tmp_path):
    flags = ["--eval-every", "0", "--scale-stats", "false"]  # read by two worker processes each (the default)
    (one,) = recorded_run(tmp_path, "one", 1, *flags, "--per-device-train-batch-size", "4")
    two = recorded_run(tmp_path, "two", 2, *flags, "--per-device-train-batch-size", "2")
    assert len(one["batches"]) == len(two[0]["batches"]) == len(two[1]["batches"]) == 6
    for step in range(6):  # rank 0's rows, then rank 1's, are the one process's batch of the same step
        assert two[0]["batches"][step] + two[1]["batches"][step] == one["batches"][step]
    losses = {name: logged_losses(tmp_path / name / "run") for name in ("one", "two")}
    assert losses["two"] == pytest.approx(losses["one"], abs=1e-5)


def test_two_ranks_stream_and_tokenise_their_own_shares_of_17_files(tmp_path):
    write_parts(tmp_path / "data", corpus_texts(17 * 30, seed=13), [30] * 17)
    flags = ["--dataset", str(tmp_path / "data"), "--streaming", "true", "--stream-window", "20"]
    flags += ["--eval-every", "0", "--scale-stats", "false", "--per-device-train-batch-size", "2"]
    ranks = recorded_run(tmp_path, "two", 2, *flags, "--dataloader-num-workers", "0", max_documents=None)
    tokenizer, source = default_tokenizer(), find_source(str(tmp_path / "data"))
    for rank, record in enumerate(ranks):  # exactly this rank's share of the stream, in order
        blocks = [row for batch in record["batches"] for row in batch]
        stream = iter(streamed_blocks([source], [1.0], tokenizer, 32, 42, 20, [frozenset()], rank, 2))
        assert blocks == [next(stream)["input_ids"].tolist() for _ in blocks]
    assert ranks[0]["packed"] and ranks[1]["packed"] and not set(ranks[0]["packed"]) & set(ranks[1]["packed"])
    everything = list(streamed_blocks([source], [1.0], tokenizer, 32, 42, 20, [frozenset()], endless=False))
    rows = [tuple(row) for record in ranks for batch in record["batches"] for row in batch]
    assert len(set(rows)) == len(rows) == 24 and set(rows) <= {tuple(row["input_ids"]) for row in everything}


WAITING_RANKS = """
import sys, time
from scalevec.train import ScaleVecTrainingArguments

args = ScaleVecTrainingArguments(output_dir=sys.argv[1], ddp_timeout=2, report_to="none")
start = time.monotonic()
try:
    with args.main_process_first(desc="dataset"):  # as scalevec-train builds its data: rank 0 first
        if args.process_index == 0:
            time.sleep(8)  # preparing
    outcome = "waited"
except RuntimeError:
    outcome = "gave up"
print(f"rank {args.process_index} {outcome} after {time.monotonic() - start:.0f} s", flush=True)
"""


def test_ranks_waiting_for_rank_0_give_up_after_the_ddp_timeout_on_gloo(tmp_path):
    script = tmp_path / "waiting.py"
    script.write_text(WAITING_RANKS)
    result = run_torchrun(str(script), str(tmp_path / "run"), nproc=2)
    waited = [line for line in result.stdout.splitlines() if line.startswith("rank 1 ")]
    assert waited and waited[0].startswith("rank 1 gave up after ") and int(waited[0].split()[-2]) < 6, result.stdout


# --- what the training command refuses ---------------------------------------------------------------------


def error_of(capsys) -> list[str]:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return [line for line in err.splitlines() if line.startswith("scalevec-train:")]


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-steps", "-5"], "--max-steps must be a positive number of steps, or -1 to train for"),
        (["--max-steps", "0"], "--max-steps must be a positive number of steps"),
        (["--per-device-train-batch-size", "0"], "--per-device-train-batch-size must be at least 1; got 0"),
        (["--learning-rate", "-1"], "--learning-rate must be at least 0; got -1.0"),
        (["--adam-beta2", "1.5"], "--adam-beta2 must be at least 0 and below 1; got 1.5"),
        (["--seq-len", "1"], "--seq-len must be at least 2; got 1"),
        (["--eval-every", "-1"], "--eval-every must be at least 0; got -1"),
        (["--dataset-weights", "1,2"], "--dataset-weights gives 2 weights for 1 --dataset entries"),
        (["--config-overrides", "{oops"], "--config-overrides '{oops': not JSON"),
        (["--tokenizer", "./no/such/folder"], "--tokenizer ./no/such/folder: no such folder"),
        (["--streaming", "true", "--max-steps", "-1", "--max-documents", "0"], "--max-documents must be at least 1"),
    ],
)
def test_impossible_values_are_refused_before_anything_is_built(flags, message, tmp_path, capsys):
    output = tmp_path / "run"
    assert main(train_argv(output, *flags)) == 1
    errors = error_of(capsys)
    assert len(errors) == 1 and errors[0].startswith(f"scalevec-train: error: {message}"), errors
    assert not output.exists()


def test_a_tokenizer_larger_than_the_vocabulary_is_refused_before_step_one(tmp_path, capsys):
    assert main(train_argv(tmp_path / "run", "--config-overrides", '{"vocab_size": 100}')) == 1
    assert error_of(capsys) == [
        f"scalevec-train: error: the tokenizer {default_tokenizer().name_or_path} has 4096 tokens but the model's "
        "vocab_size is 100: ids from 100 on would have no embedding. Use a model with vocab_size >= 4096 "
        """(--config-overrides '{"vocab_size": 4096}') or another tokenizer"""
    ]


def test_a_tokenizer_folder_that_is_no_tokenizer_is_named(tmp_path, capsys):
    (tmp_path / "not-a-tokenizer").mkdir()
    (tmp_path / "not-a-tokenizer" / "notes.txt").write_text("hello")
    assert main(train_argv(tmp_path / "run", "--tokenizer", str(tmp_path / "not-a-tokenizer"))) == 1
    assert error_of(capsys) == [
        f"scalevec-train: error: --tokenizer {tmp_path / 'not-a-tokenizer'}: not a tokenizer folder (none of "
        "tokenizer.json, tokenizer_config.json, tokenizer.model, vocab.json, vocab.txt)"
    ]


@pytest.mark.parametrize(
    "content, message",
    [
        ("learning_rat: 0.01\n", "unknown option 'learning_rat' (did you mean 'learning_rate'?)"),
        ("max_steps: ten\n", "max_steps: 'ten' is not a valid int"),
        ("max_steps: 2.5\n", "max_steps: 2.5 is not a valid int"),
        ("use_cpu: maybe\n", "use_cpu: 'maybe' is not a valid boolean"),
        ("save_strategy: sometimes\n", "save_strategy: 'sometimes' is not"),
        ("- a list\n", "expected a mapping of option names to values, got a list"),
        ("max_steps: [\n", "not valid YAML"),
    ],
)
def test_an_options_file_names_the_bad_key(content, message, tmp_path, capsys):
    options = tmp_path / "options.yaml"
    options.write_text(content)
    assert main([str(options), *train_argv(tmp_path / "run")]) == 1
    errors = error_of(capsys)
    assert len(errors) == 1 and errors[0].startswith(f"scalevec-train: error: {options}: {message}"), errors
    assert not (tmp_path / "run").exists()


def test_an_options_file_with_good_values_trains(tmp_path):
    options = tmp_path / "options.json"
    options.write_text(json.dumps({"learning_rate": 0.002, "report_to": ["none"], "scale_stats": False}))
    assert main([str(options), *train_argv(tmp_path / "run", steps=2)]) == 0
    assert json.loads((tmp_path / "run" / "training_args.json").read_text())["learning_rate"] == 0.002


def test_a_second_run_on_a_live_output_folder_is_refused_at_once(tmp_path):
    output = tmp_path / "run"
    first = run(train_argv(output, steps=200))
    while not (output / ".scalevec-train.lock").exists() and first.poll() is None:
        time.sleep(0.01)
    started = time.monotonic()
    second = run(train_argv(output, "--resume", "true", steps=200))
    _, err = second.communicate(timeout=120)
    first.kill()
    first.communicate()
    assert second.returncode == 1 and time.monotonic() - started < 60
    lines = [line for line in err.splitlines() if line.startswith("scalevec-train:")]
    assert lines == [
        f"scalevec-train: error: --output-dir {output} is in use by another scalevec-train run (process "
        f"{first.pid}); wait for it to end, or choose another folder"
    ]
    assert not list(output.glob("checkpoint-*"))  # the refused run wrote nothing
