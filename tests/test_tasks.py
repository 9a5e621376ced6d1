"""Multiple-choice tasks (scalevec/train/tasks.py, task_scoring.py, scalevec/evaluate.py): items read from jsonl and
mapped from each built-in dataset's own columns as lm-eval's yamls map them, a fixed subset, scores equal to
one-request-at-a-time forwards and to lm-evaluation-harness's, the same on one and two processes, in the training
loop's logs, summary and card, and `scalevec-eval` scoring a ScaleVec folder and its Llama export alike."""

import contextlib
import io
import json
import math
import random
from pathlib import Path

import pytest
import torch
import yaml

from scalevec import ScaleVecConfig, ScaleVecForCausalLM
from scalevec.data import default_tokenizer
from scalevec.data.sources import PROBE_SECONDS
from scalevec.evaluation.cli import main as evaluate_main
from scalevec.evaluation.model import evaluate_model
from scalevec.evaluation.task_scoring import TaskEvaluation, check_requests, encode_pair, fed_tokens, item_scores
from scalevec.evaluation.tasks import (
    BUILTIN_TASKS,
    Task,
    TaskError,
    TaskItem,
    arc_item,
    hellaswag_item,
    load_tasks,
    piqa_item,
    sciq_item,
    winogrande_item,
)
from scalevec.train.cli import main as train_main

from ._helpers import (
    TINY_TRAIN_OVERRIDES,
    log_history,
    randomize_scales,
    run_python,
    run_torchrun,
    tiny_config,
    train_argv,
)

pytestmark = pytest.mark.slow  # torchrun, lm-eval, training runs

WORDS = [
    "the",
    "cat",
    "sat",
    "on",
    "a",
    "mat",
    "and",
    "dog",
    "ran",
    "far",
    "away",
    "quickly",
    "slowly",
    "under",
    "over",
]


def write_task(path: Path, count: int, seed: int = 0) -> Path:
    """`count` items of 2 to 4 choices; every fifth context ends in a space (moved into the continuation)."""
    rng = random.Random(seed)
    phrase = lambda low, high: " ".join(rng.choice(WORDS) for _ in range(rng.randint(low, high)))  # noqa: E731
    with open(path, "w") as lines:
        for index in range(count):
            choices = [phrase(1, 5) for _ in range(rng.randint(2, 4))]
            context = phrase(3, 12) + (" " if index % 5 == 0 else "")
            lines.write(json.dumps({"context": context, "choices": choices, "gold": rng.randrange(len(choices))}))
            lines.write("\n")
    return path


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny ScaleVec model with moved scales and the embedded tokenizer, saved; a task file and held-out text."""
    folder = tmp_path_factory.mktemp("tasks")
    tokenizer = default_tokenizer()
    torch.manual_seed(0)
    config = tiny_config(vocab_size=len(tokenizer), max_position_embeddings=128, eos_token_id=tokenizer.eos_token_id)
    model = ScaleVecForCausalLM(config).eval()
    randomize_scales(model)
    model.save_pretrained(folder / "model")
    tokenizer.save_pretrained(folder / "model")
    write_task(folder / "mc.jsonl", 30)
    rng = random.Random(1)
    texts = [" ".join(rng.choice(WORDS) for _ in range(40)) for _ in range(30)]
    (folder / "held.jsonl").write_text("".join(json.dumps({"text": text}) + "\n" for text in texts))
    return folder


# --- items ---------------------------------------------------------------------------------------------------


BUILTIN_ROWS = {
    "hellaswag": {
        "activity_label": "Removing ice from car",
        "ctx_a": "Then, the man writes over the snow covering the window of a car.",
        "ctx_b": "a woman wearing winter clothes",
        "endings": [" [header] smiles.", "stands.  [step] Walks.", "drives off.", "laughs."],
        "label": "3",
    },
    "arc_easy": {
        "question": "Which is a gas?",
        "choices": {"text": ["ice", "steam", "rock"], "label": ["A", "B", "C"]},
        "answerKey": "B",
    },
    "piqa": {"goal": "dry wet hair", "sol1": "use a towel", "sol2": "use a rock", "label": 0},
    "winogrande": {"sentence": "The cup fell off the table because _ was tilted.", "option1": "the cup",
                   "option2": "the table", "answer": "2"},
    "sciq": {"support": "  Water boils at 100 C.", "question": "When does water boil?", "distractor1": "0 C",
             "distractor2": "50 C", "distractor3": "20 C", "correct_answer": "100 C"},
}  # fmt: skip


def test_each_builtin_row_maps_to_the_requests_lm_eval_builds():
    """Hand-written expectations of each layout, and lm-eval's own preprocessing where it has code for it."""
    from lm_eval.tasks.hellaswag.utils import process_docs
    from lm_eval.tasks.winogrande import preprocess_winogrande as winogrande

    hellaswag = hellaswag_item(BUILTIN_ROWS["hellaswag"])
    assert hellaswag.context == (
        "Removing ice from car: Then, the man writes over the snow covering the window of a car. A woman wearing "
        "winter clothes"
    )
    assert hellaswag.choices[2:] == ("drives off.", "laughs.") and "[" not in "".join(hellaswag.choices)
    assert hellaswag.gold == 3
    import datasets

    (reference,) = process_docs(datasets.Dataset.from_list([BUILTIN_ROWS["hellaswag"]]))
    assert (hellaswag.context, list(hellaswag.choices), hellaswag.gold) == (
        reference["query"],
        reference["choices"],
        reference["gold"],
    )

    assert arc_item(BUILTIN_ROWS["arc_easy"]) == TaskItem(
        "Question: Which is a gas?\nAnswer:", ("ice", "steam", "rock"), 1
    )
    assert piqa_item(BUILTIN_ROWS["piqa"]) == TaskItem(
        "Question: dry wet hair\nAnswer:", ("use a towel", "use a rock"), 0
    )
    sciq = sciq_item(BUILTIN_ROWS["sciq"])
    assert sciq.context == "Water boils at 100 C.\nQuestion: When does water boil?\nAnswer:"
    assert sciq.choices == ("0 C", "50 C", "20 C", "100 C") and sciq.gold == 3

    row = BUILTIN_ROWS["winogrande"]
    item = winogrande_item(row)
    contexts = winogrande.doc_to_choice(row)  # lm-eval's choices are the contexts, its target the continuation
    assert item.requests() == [(context, " " + winogrande.doc_to_target(row)) for context in contexts]
    assert item.gold == winogrande.doc_to_text(row) == 1
    assert item.normalizers() == [len(context) for context in contexts]
    assert set(BUILTIN_TASKS) >= {"hellaswag", "arc_easy", "arc_challenge", "piqa", "winogrande", "sciq"}


def test_each_builtin_scores_the_dataset_and_split_lm_eval_scores():
    """lm-eval's `ConfigurableTask.eval_docs`: the yaml's test_split where it names one, else its validation_split,
    read from the installed lm-eval's task yamls (includes resolved)."""
    from lm_eval.tasks import TaskManager

    index = TaskManager().task_index
    for name, task in BUILTIN_TASKS.items():
        yaml = index[name].cfg
        assert (task.path, task.config) == (yaml["dataset_path"], yaml.get("dataset_name")), name
        assert task.split == (yaml.get("test_split") or yaml["validation_split"]), name
    assert {name for name, task in BUILTIN_TASKS.items() if task.split == "test"} == {
        "arc_easy",
        "arc_challenge",
        "sciq",
    }


BAD_LINES = {
    "not json": ('{"context": "a", "choices": ["b"], "gold": 0', "not a JSON object"),
    "missing field": ('{"context": "a", "choices": ["b"]}', 'missing "gold"'),
    "gold out of range": ('{"context": "a", "choices": ["b", "c"], "gold": 2}', '"gold" must be an index into the 2'),
    "empty choices": ('{"context": "a", "choices": [], "gold": 0}', '"choices" must be a non-empty list'),
    "a list": ('["a", "b"]', "not a JSON object but a list"),
    "not UTF-8": (b'{"context": "\xe9", "choices": ["b"], "gold": 0}', "not UTF-8 text"),
    "whitespace context": ('{"context": " \\n ", "choices": ["b"], "gold": 0}', '"context" is only whitespace'),
    "source line later": ('{"dataset": "a/b"}', 'missing "context"'),
}


@pytest.mark.parametrize("case", list(BAD_LINES))
def test_a_bad_task_file_fails_in_one_line_naming_file_and_line(tmp_path, case):
    line, reason = BAD_LINES[case]
    path = tmp_path / "bad.jsonl"
    line = line if isinstance(line, bytes) else line.encode()
    path.write_bytes(b'{"context": "x", "choices": ["y", "z"], "gold": 1}\n\n' + line + b"\n")
    with pytest.raises(TaskError) as raised:
        load_tasks([str(path)])
    message = str(raised.value)
    assert message.startswith(f"{path}:3: ") and reason in message and "\n" not in message


def test_the_command_prints_the_bad_line_in_one_line(model_dir, tmp_path, capsys):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"context": "x", "choices": ["y"], "gold": 3}\n')
    assert evaluate_main([str(model_dir / "model"), "--tasks", str(path)]) == 1
    error = capsys.readouterr().err
    assert error == f'scalevec-eval: error: {path}:1: "gold" must be an index into the 1 choices; got 3\n'


def test_an_offline_builtin_name_fails_in_one_line_naming_the_file_to_pass(model_dir, tmp_path):
    script = (
        "import sys\nfrom scalevec.evaluation.cli import main\nsys.exit(main([sys.argv[1], '--tasks', 'arc_easy']))"
    )
    env = {"HF_DATASETS_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")}
    result = run_python(script, str(model_dir / "model"), env=env)
    assert result.returncode == 1
    errors = [line for line in result.stderr.splitlines() if "scalevec-eval" in line]
    assert len(errors) == 1 and errors[0] == result.stderr.rstrip("\n").splitlines()[-1]
    assert errors[0].startswith("scalevec-eval: error: task arc_easy: allenai/ai2_arc (ARC-Easy) at 210d026")
    assert "pass arc_easy.jsonl instead" in errors[0] and "--export-task arc_easy arc_easy.jsonl" in errors[0]


def serve_hub(monkeypatch, load_dataset) -> None:
    """The public Hub, which cannot be reached here: its answer to the repository question, and the rows that
    `load_dataset` gives."""
    import datasets
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.HfApi, "repo_info", lambda self, *args, **kwargs: None)
    monkeypatch.setattr(datasets, "load_dataset", load_dataset)


def test_an_unreachable_hub_is_known_before_datasets_is_asked(tmp_path, monkeypatch):
    """Where no local cache holds a built-in task's dataset, one question of `PROBE_SECONDS` to the Hub comes
    first (offline, `datasets` retries for most of a minute); where a cache holds it, `datasets` loads it."""
    import datasets
    import huggingface_hub
    from huggingface_hub import constants

    asked = []

    def unreachable(self, repo_id, repo_type=None, timeout=None, **kwargs):
        asked.append((repo_id, repo_type, timeout))
        raise ConnectionError("[Errno -2] Name or service not known")

    monkeypatch.setattr(huggingface_hub.HfApi, "repo_info", unreachable)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets"))
    rows = [dict(BUILTIN_ROWS["sciq"], question=f"Q{i}?") for i in range(6)]
    loaded = []
    monkeypatch.setattr(
        datasets, "load_dataset", lambda *args, **kwargs: loaded.append(args) or datasets.Dataset.from_list(rows)
    )
    with pytest.raises(TaskError) as raised:
        load_tasks(["sciq"], 4)
    assert asked == [("allenai/sciq", "dataset", PROBE_SECONDS)] and loaded == []
    message = str(raised.value)
    revision = BUILTIN_TASKS["sciq"].revision
    assert message.startswith(f"task sciq: allenai/sciq at {revision} is in no local cache, and the Hub (") and (
        "cannot be reached to look for it: [Errno -2] Name or service not known; offline, pass sciq.jsonl" in message
    )
    (tmp_path / "datasets" / "allenai___sciq").mkdir(parents=True)  # prepared on an earlier, online day
    (task,) = load_tasks(["sciq"], 4)
    assert len(task.items) == 4 and task.available == 6 and loaded == [("allenai/sciq", None)]


def test_a_builtin_task_and_its_exported_file_score_the_same_items(tmp_path, monkeypatch, capsys):
    """The offline route: `--export-task` writes the whole split, and the file gives the built-in's subset."""
    import datasets

    rows = [dict(BUILTIN_ROWS["hellaswag"], ctx_a=f"Step {i}.", label=str(i % 4)) for i in range(40)]
    asked = []

    def hub(path, name, split, revision):
        asked.append((path, name, split, revision))
        return datasets.Dataset.from_list(rows)

    serve_hub(monkeypatch, hub)
    exported = tmp_path / "hellaswag.jsonl"
    assert evaluate_main(["--export-task", "hellaswag", str(exported)]) == 0
    assert "wrote the 40 items of Rowan/hellaswag at 218ec52" in capsys.readouterr().out
    source, *lines = exported.read_text().splitlines()
    assert len(lines) == 40 and json.loads(source) == {
        "dataset": "Rowan/hellaswag",
        "config": None,
        "split": "validation",
        "revision": BUILTIN_TASKS["hellaswag"].revision,
    }
    builtin, from_file = load_tasks(["hellaswag"], 10)[0], load_tasks([str(exported)], 10)[0]
    assert builtin.name == from_file.name == "hellaswag" and builtin.available == from_file.available == 40
    assert builtin.items == from_file.items and len(builtin.items) == 10
    assert builtin.items[0] == hellaswag_item(rows[int(builtin.items[0].context.split("Step ")[1].split(".")[0])])
    assert asked[0] == ("Rowan/hellaswag", None, "validation", BUILTIN_TASKS["hellaswag"].revision)
    # the exported file names the built-in's Hub source, so offline scores are filed where online ones are
    assert (
        builtin.provenance()
        == from_file.provenance()
        == {
            "dataset": "Rowan/hellaswag",
            "split": "validation",
            "revision": BUILTIN_TASKS["hellaswag"].revision,
            "available": 40,
            "subset_seed": 0,
        }
    )
    assert load_tasks([str(write_task(tmp_path / "own.jsonl", 3))], 10)[0].provenance() == {
        "available": 3,
        "subset_seed": 0,
    }


def test_an_exported_builtin_gives_the_card_the_online_builtin_gives(model_dir, tmp_path, monkeypatch):
    """Offline and online, ARC-Challenge's scores are filed under its dataset, config, test split and revision."""
    import datasets

    from scalevec.convert.task_results import task_model_index, write_eval_result_files

    rows = [dict(BUILTIN_ROWS["arc_easy"], question=f"Which is gas {i}?", answerKey="ABC"[i % 3]) for i in range(30)]
    serve_hub(monkeypatch, lambda path, name, split, revision: datasets.Dataset.from_list(rows))
    exported = tmp_path / "arc_challenge.jsonl"
    assert evaluate_main(["--export-task", "arc_challenge", str(exported)]) == 0
    model = ScaleVecForCausalLM.from_pretrained(model_dir / "model")
    scored = {}
    for place, entry in (("online", "arc_challenge"), ("offline", str(exported))):
        results = {"tasks": evaluate_model(model, default_tokenizer(), load_tasks([entry], 12)).tasks}
        (tmp_path / place).mkdir()
        (file,) = write_eval_result_files(tmp_path / place, results)
        scored[place] = (results, task_model_index(results), file.read_text())
    assert scored["online"] == scored["offline"]
    results, model_index, eval_result = scored["online"]
    expected = ("allenai/ai2_arc", "ARC-Challenge", "test", BUILTIN_TASKS["arc_challenge"].revision)
    assert {(r.dataset_type, r.dataset_config, r.dataset_split, r.dataset_revision) for r in model_index} == {expected}
    assert model_index[0].dataset_args == {"items": 12, "available": 30, "subset_seed": 0}
    notes = yaml.safe_load(eval_result)[0]["notes"]
    assert notes.startswith("acc over 12 of the 30 items of the test split, drawn with seed 0 (config ARC-Challenge)")


def test_the_subset_is_fixed_spread_and_nested(tmp_path):
    path = write_task(tmp_path / "many.jsonl", 200)
    everything = load_tasks([str(path)], 10_000)[0].items
    thirty = load_tasks([str(path)], 30)[0]
    assert thirty.name == "many" and thirty.available == 200 and len(thirty.items) == 30
    assert thirty.items == load_tasks([str(path)], 30)[0].items  # the same at every evaluation
    assert thirty.items != everything[:30]  # spread over the file, not its head
    positions = [everything.index(item) for item in thirty.items]
    assert positions == sorted(positions)
    assert set(load_tasks([str(path)], 10)[0].items) <= set(thirty.items)


# --- scores --------------------------------------------------------------------------------------------------


def test_batched_scores_equal_one_request_at_a_time(model_dir):
    tokenizer = default_tokenizer()
    model = ScaleVecForCausalLM.from_pretrained(model_dir / "model").eval()
    items = load_tasks([str(model_dir / "mc.jsonl")])[0].items
    items.append(TaskItem("The cup fell because ", ("the cup", "the table"), 1, suffix="was tilted."))
    scored = dict(TaskEvaluation(tokenizer, batch_size=3).loglikelihoods(model, items))
    assert sorted(scored) == list(range(len(items)))
    for index, item in enumerate(items):
        expected = []
        for context, continuation in item.requests():
            context_ids, continuation_ids = encode_pair(tokenizer, context, continuation)
            with torch.no_grad():
                logits = model(torch.tensor([context_ids + continuation_ids])).logits[0].log_softmax(-1)
            positions = range(len(context_ids) - 1, len(context_ids) + len(continuation_ids) - 1)
            expected.append(sum(logits[p, t].item() for p, t in zip(positions, continuation_ids)))
        assert scored[index] == pytest.approx(expected, abs=1e-4)


def test_a_continuation_longer_than_the_model_is_refused(model_dir):
    model = ScaleVecForCausalLM.from_pretrained(model_dir / "model")
    item = TaskItem("Q:", ("short", " ".join(["cat"] * 200)), 0, origin="long.jsonl:7")
    expected = r"^long.jsonl:7: a continuation of 400 tokens exceeds the model.s 128 positions: . cat cat"
    (task,) = load_tasks([str(model_dir / "mc.jsonl")])
    with pytest.raises(TaskError, match=expected):
        check_requests(default_tokenizer(), [Task("long", "long.jsonl", [*task.items, item], 31)], 128)
    with pytest.raises(TaskError, match=expected):
        dict(TaskEvaluation(default_tokenizer()).loglikelihoods(model, [item]))


@pytest.mark.parametrize("world_size", [1, 2])
def test_fed_tokens_count_every_batch_the_scorer_runs(model_dir, world_size):
    """The plan's task cost: the tokens of the forwards themselves (padding, one-token fillers), fewer than one
    input per choice as each item's context is fed once."""
    model = ScaleVecForCausalLM.from_pretrained(model_dir / "model").eval()
    tasks = load_tasks([str(model_dir / "mc.jsonl")], 25)
    fed = []
    model.register_forward_hook(lambda module, args, kwargs, output: fed.append(kwargs["input_ids"].numel()),
                                with_kwargs=True)  # fmt: skip
    for rank in range(world_size):
        scorer = TaskEvaluation(default_tokenizer(), rank, world_size, batch_size=4)
        scorer.sums(model, tasks)
    tokenizer = default_tokenizer()
    one_input_per_choice = sum(
        len(context) + len(continuation) - 1
        for item in tasks[0].items
        for context, continuation in (encode_pair(tokenizer, *request) for request in item.requests())
    )
    assert fed_tokens(tokenizer, tasks, model, 4, world_size) == sum(fed) < one_input_per_choice


def test_acc_acc_norm_and_bits_per_byte_of_an_item():
    item = TaskItem("Q:", ("a", "bbbb", "cc"), gold=1)
    acc, acc_norm, bpb, count = item_scores(item, [-2.0, -4.0, -3.0])
    assert (acc, acc_norm, count) == (0.0, 1.0, 1.0)  # -4/4 beats -2/1 and -3/2
    assert bpb == pytest.approx(4.0 / (math.log(2) * len(" bbbb")))
    with_space = TaskItem("Q: ", ("é",), gold=0)  # the context's space is scored with the choice: 1 + 1 + 2 bytes
    assert item_scores(with_space, [-1.0])[2] == pytest.approx(1 / (math.log(2) * 4))


def test_scores_agree_with_lm_evaluation_harness(model_dir, tmp_path):
    """lm-eval's HFLM on the same folder, a local task over the same jsonl: equal accuracies, and each choice's
    log-likelihood within 1e-4."""
    import lm_eval
    from lm_eval.tasks import TaskManager

    task_file = model_dir / "mc.jsonl"
    (tmp_path / "mc_task.yaml").write_text(
        f"task: mc_task\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {task_file}\ntest_split: test\n"
        "output_type: multiple_choice\ndoc_to_text: context\ndoc_to_choice: choices\ndoc_to_target: gold\n"
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    reference = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={model_dir / 'model'},dtype=float32",
        tasks=["mc_task"],
        task_manager=TaskManager(include_path=str(tmp_path)),
        log_samples=True,
        batch_size=4,
        device="cpu",
    )
    (task,) = load_tasks([str(task_file)])
    model = ScaleVecForCausalLM.from_pretrained(model_dir / "model")
    ours = evaluate_model(model, default_tokenizer(), [task]).tasks["mc"]
    results = reference["results"]["mc_task"]
    assert (ours["acc"], ours["acc_norm"]) == (results["acc,none"], results["acc_norm,none"])
    scored = dict(TaskEvaluation(default_tokenizer()).loglikelihoods(model, task.items))
    for sample in reference["samples"]["mc_task"]:
        theirs = [loglikelihood for loglikelihood, _ in sample["filtered_resps"]]
        assert scored[sample["doc_id"]] == pytest.approx(theirs, abs=1e-4)


def _scores(path: Path) -> dict:
    return json.loads(path.read_text())


def test_two_processes_score_what_one_does(model_dir, tmp_path):
    flags = ["--tasks", f"{model_dir / 'mc.jsonl'}", "--eval-dataset", str(model_dir / "held.jsonl")]
    flags += ["--seq-len", "32", "--batch-size", "3"]
    assert evaluate_main([str(model_dir / "model"), *flags, "--output", str(tmp_path / "one.json")]) == 0
    two = run_torchrun(
        "-m", "scalevec.evaluation.cli", str(model_dir / "model"), *flags, "--output", str(tmp_path / "two.json")
    )
    assert two.returncode == 0, two.stderr[-3000:]
    one, two = _scores(tmp_path / "one.json"), _scores(tmp_path / "two.json")
    assert one["tasks"]["mc"]["items"] == two["tasks"]["mc"]["items"] == 30
    assert (one["tasks"]["mc"]["acc"], one["tasks"]["mc"]["acc_norm"]) == (
        two["tasks"]["mc"]["acc"],
        two["tasks"]["mc"]["acc_norm"],
    )
    assert one["tasks"]["mc"]["bpb"] == pytest.approx(two["tasks"]["mc"]["bpb"], rel=1e-6)
    assert one["held_out"]["tokens"] == two["held_out"]["tokens"] > 0
    assert one["held_out"]["loss"] == pytest.approx(two["held_out"]["loss"], rel=1e-6)


@pytest.mark.parametrize("target", ["llama", "qwen3"])
def test_a_scalevec_folder_and_its_stock_export_score_equal(model_dir, tmp_path, target):
    """Qwen3 normalises q and k: its source model has QK-norm (the fixture's has none, for Llama)."""
    from scalevec.convert.cli import main as convert_main

    source = model_dir / "model"
    if target == "qwen3":
        source = tmp_path / "source"
        config = ScaleVecConfig.from_pretrained(model_dir / "model", qk_norm=True)
        model = ScaleVecForCausalLM(config)
        randomize_scales(model, seed=1)
        model.save_pretrained(source)
        default_tokenizer().save_pretrained(source)
    assert convert_main(["export", str(source), str(tmp_path / target), "--to", target, "-q"]) == 0
    assert json.loads((tmp_path / target / "config.json").read_text())["model_type"] == target
    flags = ["--tasks", str(model_dir / "mc.jsonl"), "--eval-dataset", str(model_dir / "held.jsonl")]
    for name, folder in (("scalevec", source), ("export", tmp_path / target)):
        assert evaluate_main([str(folder), *flags, "--seq-len", "32", "--output", str(tmp_path / f"{name}.json")]) == 0
    scalevec, export = _scores(tmp_path / "scalevec.json"), _scores(tmp_path / "export.json")
    assert scalevec["tasks"]["mc"]["acc"] == export["tasks"]["mc"]["acc"]
    assert scalevec["tasks"]["mc"]["acc_norm"] == export["tasks"]["mc"]["acc_norm"]
    assert scalevec["tasks"]["mc"]["bpb"] == pytest.approx(export["tasks"]["mc"]["bpb"], rel=1e-5)
    assert scalevec["held_out"]["loss"] == pytest.approx(export["held_out"]["loss"], rel=1e-5)


def test_quantize_scores_each_scheme_beside_the_unquantized_model(model_dir, tmp_path, capsys):
    flags = [
        "--tasks",
        str(model_dir / "mc.jsonl"),
        "--eval-dataset",
        str(model_dir / "held.jsonl"),
        "--seq-len",
        "32",
    ]
    plain, both = tmp_path / "plain.json", tmp_path / "quantized.json"
    assert evaluate_main([str(model_dir / "model"), *flags, "--output", str(plain)]) == 0
    assert evaluate_main([str(model_dir / "model"), *flags, "--quantize", "int8,int4", "--output", str(both)]) == 0
    plain, both = _scores(plain), _scores(both)
    assert (both["tasks"], both["held_out"]) == (plain["tasks"], plain["held_out"])  # quantizing copies, in turn
    changes = {}
    for scheme in ("int8", "int4"):
        quantized, differences = both["quantized"][scheme], both["differences"][scheme]
        assert (
            quantized["tasks"]["mc"]["items"] == 30 and quantized["held_out"]["tokens"] == plain["held_out"]["tokens"]
        )
        changes[scheme] = quantized["held_out"]["loss"] - plain["held_out"]["loss"]
        assert differences["held_out"]["loss"] == pytest.approx(changes[scheme], abs=1e-12)
        assert differences["tasks"]["mc"]["bpb"] == pytest.approx(
            quantized["tasks"]["mc"]["bpb"] - plain["tasks"]["mc"]["bpb"], abs=1e-12
        )
    assert 0 < abs(changes["int8"]) < abs(changes["int4"])
    assert "int4 minus unquantized: held-out loss" in capsys.readouterr().out
    assert evaluate_main([str(model_dir / "model"), *flags, "--quantize", "int3"]) != 0
    assert "Unknown quantization scheme 'int3'; choose from int8, int4" in capsys.readouterr().err


# --- the training loop ---------------------------------------------------------------------------------------


def test_training_scores_the_tasks_at_each_evaluation(model_dir, tmp_path):
    """Logged at steps 3 and 6 with the held-out loss, in the run's summary, plan and card, and what the final
    model scores under scalevec-eval."""
    from scalevec.convert.card import write_model_card

    run = tmp_path / "run"
    tasks = f"{model_dir / 'mc.jsonl'},{write_task(tmp_path / 'other.jsonl', 20, seed=3)}"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        flags = ["--eval-tasks", tasks, "--task-examples", "12", "--eval-steps", "3"]
        assert train_main(train_argv(run, *flags, "--per-device-eval-batch-size", "5")) == 0
    evaluations = [entry for entry in log_history(run) if "eval_loss" in entry]
    assert [entry["step"] for entry in evaluations] == [3, 6]
    for entry in evaluations:
        assert entry["eval_mc_items"] == entry["eval_other_items"] == 12
        assert entry["eval_tasks_acc"] == pytest.approx((entry["eval_mc_acc"] + entry["eval_other_acc"]) / 2)
        assert entry["eval_mc_bpb"] > 0 and 0 <= entry["eval_other_acc_norm"] <= 1
    summary = json.loads((run / "run_summary.json").read_text())["eval"]
    assert summary["eval_mc_acc"] == evaluations[-1]["eval_mc_acc"]
    plan = next(line for line in printed.getvalue().splitlines() if line.startswith("tasks "))
    assert "mc 12 of 30 items, other 12 of 20 items" in plan and "% of the training compute" in plan
    trained = ScaleVecForCausalLM.from_pretrained(run)
    fed = fed_tokens(default_tokenizer(), load_tasks(tasks.split(","), 12), trained, batch_size=5)
    assert f"each evaluation feeds {fed:,} tokens (each item's context once, with its choices)" in plan
    assert f"  mc         acc {evaluations[-1]['eval_mc_acc']:.4f}, acc_norm" in printed.getvalue()  # the end

    tokenizer = default_tokenizer()
    (mc,) = load_tasks([str(model_dir / "mc.jsonl")], 12)
    final = evaluate_model(trained, tokenizer, [mc]).tasks["mc"]
    assert final["acc"] == evaluations[-1]["eval_mc_acc"]
    assert final["bpb"] == pytest.approx(evaluations[-1]["eval_mc_bpb"], rel=1e-5)

    card = write_model_card(
        run, export_target="scalevec", source_config=ScaleVecConfig.from_pretrained(run), run_dir=run
    )
    text = card.read_text()
    assert f"mc (12 of the 30 items, drawn with seed 0) | accuracy {evaluations[-1]['eval_mc_acc']:.4f}" in text
    assert "mean of the 2 tasks" in text and "eval mc acc" not in text


@pytest.mark.parametrize(
    "line, reason",
    [
        ('{"context": "\\n  ", "choices": ["a", "b"], "gold": 0}', '"context" is only whitespace'),
        (
            '{"context": "Q:", "choices": ["a", "' + " ".join(["cat"] * 100) + '"], "gold": 0}',
            "a continuation of 200 tokens",
        ),
    ],
)
def test_an_unscorable_item_stops_the_run_before_its_first_step(tmp_path, capsys, line, reason):
    """A whitespace-only context (refused as the file is read) or a choice longer than the model's 64 positions
    (refused by the Trainer as it is built): one line naming the file and line, before any training step."""
    path = tmp_path / "bad.jsonl"
    path.write_text('{"context": "Q:", "choices": ["a", "b"], "gold": 1}\n' + line + "\n")
    overrides = json.dumps({**json.loads(TINY_TRAIN_OVERRIDES), "max_position_embeddings": 64})
    argv = train_argv(tmp_path / "run", "--eval-tasks", str(path), "--config-overrides", overrides)
    assert train_main(argv) == 1
    captured = capsys.readouterr()
    error = captured.err.rstrip("\n").splitlines()[-1]
    assert error.startswith(f"scalevec-train: error: {path}:2: ") and reason in error, captured.err[-2000:]
    assert "'loss'" not in captured.out and not (tmp_path / "run" / "trainer_state.json").exists()


def test_two_training_processes_log_what_one_process_scores_on_the_saved_model(model_dir, tmp_path):
    run = tmp_path / "run"
    flags = ["--eval-tasks", str(model_dir / "mc.jsonl"), "--task-examples", "20", "--dataloader-num-workers", "0"]
    result = run_torchrun("-m", "scalevec.train.cli", *train_argv(run, *flags, steps=2))
    assert result.returncode == 0, result.stderr[-3000:]
    (logged,) = [entry for entry in log_history(run) if "eval_loss" in entry]
    (task,) = load_tasks([str(model_dir / "mc.jsonl")], 20)
    alone = evaluate_model(ScaleVecForCausalLM.from_pretrained(run), default_tokenizer(), [task]).tasks["mc"]
    assert logged["eval_mc_items"] == alone["items"] == 20
    assert (logged["eval_mc_acc"], logged["eval_mc_acc_norm"]) == (alone["acc"], alone["acc_norm"])
    assert logged["eval_mc_bpb"] == pytest.approx(alone["bpb"], rel=1e-5)
