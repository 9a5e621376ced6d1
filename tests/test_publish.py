"""The publishing path (docs/evaluation.md, docs/converting.md): `scalevec-eval ... --quantize --output
results.json`, then `scalevec-convert export ... --eval-results results.json`, with and without a held-out set, the
card loaded back with huggingface_hub; the results file checked in full as it is read; two configs of one Hub
dataset (ARC-Easy, ARC-Challenge) kept apart in the card's model-index."""

import json
import math
import random
import sys

import pytest
import yaml
from huggingface_hub import ModelCard

from scalevec.convert.card import write_model_card
from scalevec.convert.cli import main as convert_main
from scalevec.convert.task_results import read_task_results
from scalevec.data import default_tokenizer
from scalevec.evaluation.cli import main as evaluate_main

from ._helpers import saved_scalevec, saved_stock, tiny_config

WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "far", "away", "quickly", "under", "over"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A tiny ScaleVec model with the embedded tokenizer, a task file naming its Hub source, held-out text."""
    folder = tmp_path_factory.mktemp("publish")
    tokenizer = default_tokenizer()
    config = tiny_config(vocab_size=len(tokenizer), max_position_embeddings=128, eos_token_id=tokenizer.eos_token_id)
    saved_scalevec(folder / "model", config)
    tokenizer.save_pretrained(folder / "model")
    rng = random.Random(0)
    phrase = lambda count: " ".join(rng.choice(WORDS) for _ in range(count))  # noqa: E731
    source = {"dataset": "tester/mc", "config": "easy", "split": "test", "revision": "a" * 40}
    items = [{"context": phrase(6), "choices": [phrase(2), phrase(3)], "gold": i % 2} for i in range(20)]
    (folder / "mc.jsonl").write_text("".join(json.dumps(line) + "\n" for line in [source, *items]))
    texts = [phrase(40) for _ in range(20)]
    (folder / "held.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return folder


@pytest.mark.parametrize("held_out", [False, True], ids=["tasks only", "with a held-out set"])
def test_the_documented_publish_flow_writes_a_card_that_loads_back(trained, tmp_path, held_out):
    results = tmp_path / "results.json"
    flags = ["--eval-dataset", str(trained / "held.jsonl"), "--seq-len", "32"] if held_out else []
    evaluate = [str(trained / "model"), "--tasks", str(trained / "mc.jsonl"), "--task-examples", "12", *flags]
    assert evaluate_main([*evaluate, "--quantize", "int8,int4", "--output", str(results)]) == 0
    scores = json.loads(results.read_text())
    assert (scores["held_out"] is None) is not held_out
    export = ["export", str(trained / "model"), str(tmp_path / "llama"), "--to", "llama", "-q"]
    assert convert_main([*export, "--eval-results", str(results)]) == 0

    card = ModelCard.load(tmp_path / "llama" / "README.md")
    mc = scores["tasks"]["mc"]
    entries = {r.metric_type: r for r in card.data.eval_results}
    assert {key: entries[key].metric_value for key in ("acc", "acc_norm", "bpb")} == {
        key: mc[key] for key in ("acc", "acc_norm", "bpb")
    }
    assert (entries["acc"].dataset_type, entries["acc"].dataset_config, entries["acc"].dataset_split) == (
        "tester/mc",
        "easy",
        "test",
    )
    assert entries["acc"].dataset_args == {"items": 12, "available": 20, "subset_seed": 0}
    subset = "12 of the 20 items of the test split, drawn with seed 0"
    assert f"| `mc` | `tester/mc` (`easy`) at `aaaaaaa` | {subset} | {mc['acc']:.4f} |" in card.text
    header = "| weights | held-out loss | `mc` acc |" if held_out else "| weights | `mc` acc |"
    assert header in card.text
    int4 = scores["quantized"]["int4"]["tasks"]["mc"]["acc"]
    row = next(line for line in card.text.splitlines() if line.startswith("| `int4` |"))
    assert row.endswith(f"| {int4:.4f} ({int4 - mc['acc']:+.4f}) |") and row.count("|") == (4 if held_out else 3)
    if held_out:
        assert f"over {scores['held_out']['tokens']:,} predicted tokens" in card.text
    else:
        assert "Held-out loss" not in card.text and "held-out loss" not in card.text
    [entry] = yaml.safe_load((tmp_path / "llama" / ".eval_results" / "mc.yaml").read_text())
    assert (entry["dataset"]["id"], entry["dataset"]["revision"], entry["value"]) == ("tester/mc", "a" * 40, mc["acc"])


def test_quantize_without_torchao_fails_before_the_first_forward(trained, monkeypatch, capsys):
    import scalevec.evaluation.cli

    scored = []
    monkeypatch.setattr(scalevec.evaluation.cli, "evaluate_model", lambda *args, **kwargs: scored.append(args))
    monkeypatch.setitem(sys.modules, "torchao.quantization", None)  # as if torchao were not installed
    argv = [str(trained / "model"), "--tasks", str(trained / "mc.jsonl"), "--quantize", "int8"]
    assert evaluate_main(argv) == 1
    error = capsys.readouterr().err
    assert error.startswith("scalevec-eval: error: Quantizing weights needs torchao") and error.count("\n") == 1
    assert scored == []


def test_two_arc_sets_read_back_apart(tmp_path):
    """ARC-Easy and ARC-Challenge share dataset id and revision: their config keeps huggingface_hub from merging
    them (`EvalResult.unique_identifier`), so each metric stays under its own task."""
    saved_stock(tmp_path / "llama", "llama")
    arc = {"dataset": "allenai/ai2_arc", "split": "test", "revision": "210d026faf9955653af8916fad021475a3f00453"}
    tasks = {
        "arc_easy": {"acc": 0.4, "acc_norm": 0.38, "bpb": 1.5, "items": 500, "available": 2376, **arc},
        "arc_challenge": {"acc": 0.2, "acc_norm": 0.24, "bpb": 1.9, "items": 500, "available": 1172, **arc},
    }
    tasks["arc_easy"]["config"], tasks["arc_challenge"]["config"] = "ARC-Easy", "ARC-Challenge"
    (tmp_path / "results.json").write_text(json.dumps({"model": "m", "tasks": tasks, "held_out": None}))
    results = read_task_results(tmp_path / "results.json")
    readme = write_model_card(
        tmp_path / "llama", export_target="llama", source_config=tiny_config(), task_results=results
    )
    entries = ModelCard.load(readme).data.eval_results
    assert len(entries) == 6
    for entry in entries:
        task = entry.metric_name.split()[0]
        assert entry.task_name == task and entry.dataset_config == tasks[task]["config"]
        assert entry.metric_value == tasks[task][entry.metric_type]
    files = sorted(path.name for path in (tmp_path / "llama" / ".eval_results").iterdir())
    assert files == ["arc_challenge.yaml", "arc_easy.yaml"]


GOOD_TASK = {"acc": 0.5, "acc_norm": 0.5, "bpb": 1.0, "items": 10}
GOOD_HELD_OUT = {"loss": 3.0, "perplexity": math.exp(3.0), "tokens": 100}
BAD_FIELDS = {
    "accuracy above 1": (
        {"tasks": {"t": {**GOOD_TASK, "acc": 1.5}}},
        "tasks.t.acc must be a fraction between 0 and 1; got 1.5.",
    ),
    "missing score": ({"tasks": {"t": {"acc": 0.3, "bpb": 1.0, "items": 5}}}, "tasks.t.acc_norm is missing"),
    "fractional count": (
        {"tasks": {"t": {**GOOD_TASK, "items": 2.5}}},
        "tasks.t.items must be a whole number of items",
    ),
    "subset above source": (
        {"tasks": {"t": {**GOOD_TASK, "available": 4}}},
        "tasks.t.available must be at least the 10",
    ),
    "split not a name": (
        {"tasks": {"t": {**GOOD_TASK, "split": 3}}},
        "tasks.t.split must be a non-empty string; got 3.",
    ),
    "loss a string": (
        {"held_out": {**GOOD_HELD_OUT, "loss": "3.0"}},
        'held_out.loss must be a finite loss in nats, not negative; got "3.0".',
    ),
    "infinite loss": (
        '{"held_out": {"loss": Infinity, "perplexity": 1, "tokens": 5}}',
        "held_out.loss must be a finite",
    ),
    "tasks a list": ({"tasks": [1]}, "tasks must be an object of tasks; got [1]."),
    "quantized task": (
        {"tasks": {"t": GOOD_TASK}, "quantized": {"int8": {"tasks": {"t": {**GOOD_TASK, "bpb": -1}}}}},
        "quantized.int8.tasks.t.bpb must be a finite number of bits, not negative; got -1.",
    ),
    "quantized without a task": (
        {"tasks": {"t": GOOD_TASK}, "quantized": {"int8": {"tasks": {}}}},
        "quantized.int8.tasks has no results for t.",
    ),
    "quantized without held-out": (
        {"held_out": GOOD_HELD_OUT, "quantized": {"int4": {"held_out": None}}},
        "quantized.int4.held_out is missing: the unquantized model has a held-out loss.",
    ),
    "nothing": ({"tasks": {}}, "no 'tasks' or 'held_out' results"),
    "not an object": ([1, 2], "not a scalevec-eval results file"),
}


@pytest.mark.parametrize("case", list(BAD_FIELDS))
def test_a_bad_field_of_the_results_file_is_refused_by_name(tmp_path, capsys, case):
    results, message = BAD_FIELDS[case]
    path = tmp_path / "results.json"
    path.write_text(results if isinstance(results, str) else json.dumps(results))
    with pytest.raises(ValueError) as raised:
        read_task_results(path)
    assert str(raised.value).startswith(f"{path}: ") and message in str(raised.value) and "\n" not in str(raised.value)
    with pytest.raises(SystemExit):  # the command line: one line naming the file and the field
        convert_main(["export", "a", "b", "--to", "llama", "--eval-results", str(path)])
    error = capsys.readouterr().err.rstrip("\n").splitlines()[-1]
    assert error.endswith(f"--eval-results: {path}: {str(raised.value).removeprefix(f'{path}: ')}")
