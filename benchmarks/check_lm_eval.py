"""How closely scalevec's task scores agree with lm-evaluation-harness's on the same items and model.

A 4x128 ScaleVec model (random weights, scales moved away from 1, the embedded tokenizer) saved to a folder;
ITEMS multiple-choice items of 2 to 4 choices cut from the embedded corpus (every fifth context ending in a space),
written as jsonl. lm-eval's HFLM scores the folder through a local task over that jsonl (`output_type:
multiple_choice`, offline); scalevec scores the same items (`evaluate_model`, `TaskEvaluation`). Reported: both
accuracies and length-normalised accuracies, and the largest difference of a choice's log-likelihood.

    python benchmarks/check_lm_eval.py [--items 200] [--workdir /tmp/check-lm-eval]
"""

import argparse
import json
import random
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def write_items(path: Path, count: int) -> None:
    from scalevec.data.corpus import default_corpus_file

    words = " ".join(json.loads(line)["text"] for line in default_corpus_file().read_text().splitlines()).split()
    rng = random.Random(0)

    def phrase(length: int) -> str:
        start = rng.randrange(len(words) - length)
        return " ".join(words[start : start + length])

    with open(path, "w") as lines:
        for index in range(count):
            choices = [phrase(rng.randint(1, 12)) for _ in range(rng.randint(2, 4))]
            context = phrase(rng.randint(5, 60)) + (" " if index % 5 == 0 else "")
            record = {"context": context, "choices": choices, "gold": rng.randrange(len(choices))}
            lines.write(json.dumps(record) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--items", type=int, default=200)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/check-lm-eval"))
    args = parser.parse_args()
    import lm_eval
    from _common import machine, today
    from lm_eval.tasks import TaskManager

    from scalevec import ScaleVecConfig, ScaleVecForCausalLM
    from scalevec.data import default_tokenizer
    from scalevec.evaluation.model import evaluate_model
    from scalevec.evaluation.task_scoring import TaskEvaluation
    from scalevec.evaluation.tasks import load_tasks
    from scalevec.train.presets import size_fields

    args.workdir.mkdir(parents=True, exist_ok=True)
    tokenizer = default_tokenizer()
    torch.manual_seed(0)
    config = ScaleVecConfig(**size_fields("tiny"), vocab_size=len(tokenizer), eos_token_id=tokenizer.eos_token_id)
    model = ScaleVecForCausalLM(config).eval()
    with torch.no_grad():
        for names in model.scale_vector_roles().values():
            for name in names:
                model.get_parameter(name).uniform_(0.7, 1.3)
    model.save_pretrained(args.workdir / "model")
    tokenizer.save_pretrained(args.workdir / "model")
    task_file = args.workdir / "items.jsonl"
    write_items(task_file, args.items)
    (args.workdir / "items_task.yaml").write_text(
        f"task: items_task\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {task_file}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: context\ndoc_to_choice: choices\n"
        "doc_to_target: gold\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n"
    )
    reference = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={args.workdir / 'model'},dtype=float32",
        tasks=["items_task"],
        task_manager=TaskManager(include_path=str(args.workdir)),
        log_samples=True,
        batch_size=8,
        device="cpu",
    )
    (task,) = load_tasks([str(task_file)], args.items)
    ours = evaluate_model(model, tokenizer, [task]).tasks["items"]
    scored = dict(TaskEvaluation(tokenizer).loglikelihoods(model, task.items))
    largest = max(
        abs(ll - theirs)
        for sample in reference["samples"]["items_task"]
        for ll, (theirs, _) in zip(scored[sample["doc_id"]], sample["filtered_resps"])
    )
    results = reference["results"]["items_task"]
    print(
        f"{today()}, {machine()}, lm_eval {lm_eval.__version__}: {args.items} items "
        f"({sum(len(item.choices) for item in task.items)} choices), 4x128 model: acc {ours['acc']:.4f} "
        f"(lm-eval {results['acc,none']:.4f}), acc_norm {ours['acc_norm']:.4f} (lm-eval "
        f"{results['acc_norm,none']:.4f}), largest log-likelihood difference {largest:.2e}"
    )


if __name__ == "__main__":
    main()
