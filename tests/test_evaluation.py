"""Evaluation at pretraining scale: a token budget of held-out blocks, the same ones at every evaluation and on any
number of processes, reduced as sums (loss equal to a brute-force mean on 1 and 2 gloo processes), during training
as well as at the end, per source for a mixture; and the training sampler, whose memory does not grow with the
corpus, resuming exactly and dealing one process's batches out to two."""

import contextlib
import io
import json
import math
import tracemalloc

import numpy as np
import pytest
import torch
from accelerate.data_loader import prepare_data_loader

from scalevec import ScaleVecForCausalLM
from scalevec.data import DataArguments, PackedBlockCollator, default_tokenizer
from scalevec.data.held_out import parse_token_budget, recorded_evaluation, split_budget
from scalevec.data.sampler import BlockPermutation, ShuffledBlockSampler, evaluation_blocks
from scalevec.evaluation.held_out import HeldOutSums, held_out_metrics, token_byte_lengths
from scalevec.train.cli import main

from ._helpers import (
    corpus_texts,
    log_history,
    run_python,
    run_torchrun,
    tiny_config,
    tiny_trainer,
    train_argv,
    write_dataset,
)

pytestmark = pytest.mark.slow  # it starts processes or trains end to end

STEPS, EVAL_STEPS, EVAL_BLOCKS, SEQ_LEN = 4, 2, 23, 32


@pytest.fixture(scope="module")
def mixture_run(tmp_path_factory) -> dict:
    """A 4-step run on a two-source mixture (0.6 / 0.4), evaluated every 2 steps on 23 blocks in batches of 3."""
    folder = tmp_path_factory.mktemp("mixture")
    texts = corpus_texts(300, seed=5)
    write_dataset(folder / "main", "jsonl", texts[:200])
    write_dataset(folder / "extra", "jsonl", [f"{i} " + "vector " * (i % 40 + 3) for i in range(100)])
    flags = ["--dataset", f"{folder / 'main'},{folder / 'extra'}", "--dataset-weights", "0.6,0.4"]
    flags += ["--prepared-cache", str(folder / "cache"), "--eval-every", "3", "--max-eval-documents", "40"]
    flags += ["--max-eval-tokens", str(EVAL_BLOCKS * SEQ_LEN), "--eval-steps", str(EVAL_STEPS)]
    flags += ["--per-device-eval-batch-size", "3", "--learning-rate", "1e-2"]
    run_dir = folder / "run"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert main(train_argv(run_dir, *flags, steps=STEPS, max_documents=None)) == 0
    return {"dir": run_dir, "printed": printed.getvalue()}


def test_periodic_evaluation_logs_at_every_eval_step_and_once_at_the_end(mixture_run):
    evaluations = [entry for entry in log_history(mixture_run["dir"]) if "eval_loss" in entry]
    assert [entry["step"] for entry in evaluations] == [2, 4]  # the one at the last step is the final one
    assert evaluations[0]["eval_loss"] > evaluations[1]["eval_loss"]
    final = json.loads((mixture_run["dir"] / "all_results.json").read_text())
    assert final["eval_loss"] == evaluations[-1]["eval_loss"]
    summary = json.loads((mixture_run["dir"] / "run_summary.json").read_text())["eval"]
    assert summary["eval_tokens"] == EVAL_BLOCKS * (SEQ_LEN - 1) and summary["eval_runtime"] > 0
    plan = next(line for line in mixture_run["printed"].splitlines() if line.startswith("held out"))
    assert f"each evaluation reads {EVAL_BLOCKS * SEQ_LEN:,} tokens ({EVAL_BLOCKS} blocks (main 14, extra 9)" in plan
    assert "2 times: every 2 steps and at the end" in plan
    done = mixture_run["printed"].split("== scalevec-train: done ==")[1]
    assert f"{EVAL_BLOCKS * (SEQ_LEN - 1):,} tokens predicted in " in done and "  main " in done and "  extra " in done


def test_a_mixture_reports_each_source_and_their_token_weighted_combination(mixture_run):
    metrics = json.loads((mixture_run["dir"] / "all_results.json").read_text())
    main_loss, extra_loss = metrics["eval_main_loss"], metrics["eval_extra_loss"]
    assert abs(main_loss - extra_loss) > 0.05  # a repeated word is learned first
    main_tokens, extra_tokens = metrics["eval_main_tokens"], metrics["eval_extra_tokens"]
    assert (main_tokens, extra_tokens) == (14 * (SEQ_LEN - 1), 9 * (SEQ_LEN - 1))  # the budget split 0.6 / 0.4
    combined = (main_loss * main_tokens + extra_loss * extra_tokens) / (main_tokens + extra_tokens)
    assert metrics["eval_loss"] == pytest.approx(combined, rel=1e-9)
    assert metrics["eval_perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]), rel=1e-9)
    assert metrics["eval_extra_bits_per_byte"] > 0 and metrics["eval_bits_per_byte"] > 0


EVALUATE = """
import json, sys
from scalevec import ScaleVecForCausalLM
from scalevec.data import PackedBlockCollator
from scalevec.data.held_out import recorded_evaluation
from scalevec.train import ScaleVecTrainer, ScaleVecTrainingArguments
from transformers import AutoTokenizer
run_dir, output = sys.argv[1], sys.argv[2]
record = json.load(open(run_dir + "/training_data.json"))["eval"]
tokenizer = AutoTokenizer.from_pretrained(run_dir)
args = ScaleVecTrainingArguments(output_dir=output, per_device_eval_batch_size=3, report_to="none")
trainer = ScaleVecTrainer(
    model=ScaleVecForCausalLM.from_pretrained(run_dir), args=args, eval_dataset=recorded_evaluation(record),
    data_collator=PackedBlockCollator(tokenizer.eos_token_id), processing_class=tokenizer,
)
metrics = trainer.evaluate()
if trainer.is_world_process_zero():
    print(json.dumps(metrics))
"""


def brute_force(run_dir) -> dict[str, tuple[float, int]]:
    """Per set: (mean next-token loss, predicted tokens) over the evaluated blocks, one block at a time."""
    record = json.loads((run_dir / "training_data.json").read_text())["eval"]
    model = ScaleVecForCausalLM.from_pretrained(run_dir).eval()
    means = {}
    for name, blocks in recorded_evaluation(record).items():
        losses = []
        for block in blocks:
            ids = torch.from_numpy(block["input_ids"].astype(np.int64))[None]
            with torch.no_grad():
                logits = model(ids).logits[0, :-1].double()
            losses.append(torch.nn.functional.cross_entropy(logits, ids[0, 1:], reduction="none"))
        means[name] = (torch.cat(losses).mean().item(), sum(len(loss) for loss in losses))
    return means


def test_the_loss_is_the_brute_force_mean_on_one_and_two_processes(mixture_run, tmp_path):
    run_dir = mixture_run["dir"]
    script = tmp_path / "evaluate.py"
    script.write_text(EVALUATE)
    one = run_python(EVALUATE, str(run_dir), str(tmp_path / "one"))
    two = run_torchrun(str(script), str(run_dir), str(tmp_path / "two"))
    assert one.returncode == 0, one.stderr[-3000:]
    assert two.returncode == 0, two.stderr[-3000:]
    expected = brute_force(run_dir)
    assert sum(tokens for _, tokens in expected.values()) == EVAL_BLOCKS * (SEQ_LEN - 1)
    for result in (one, two):
        metrics = json.loads(result.stdout.strip().splitlines()[-1])
        for name, (loss, tokens) in expected.items():
            assert metrics[f"eval_{name}_loss"] == pytest.approx(loss, abs=1e-5)
            assert metrics[f"eval_{name}_tokens"] == tokens  # every block exactly once: no padded duplicates
    run_metrics = json.loads((run_dir / "all_results.json").read_text())
    assert json.loads(one.stdout.strip().splitlines()[-1])["eval_loss"] == pytest.approx(run_metrics["eval_loss"])


def test_sums_give_loss_perplexity_and_bits_per_byte():
    sums = {"a": HeldOutSums(nll=30.0, tokens=10, bytes=40), "b": HeldOutSums(nll=10.0, tokens=10, bytes=0)}
    metrics = held_out_metrics(sums)
    assert metrics["eval_loss"] == pytest.approx(2.0) and metrics["eval_tokens"] == 20
    assert metrics["eval_perplexity"] == pytest.approx(math.exp(2.0))
    assert metrics["eval_bits_per_byte"] == pytest.approx(40.0 / (math.log(2) * 40))
    assert metrics["eval_a_loss"] == pytest.approx(3.0) and metrics["eval_b_loss"] == pytest.approx(1.0)
    assert "eval_b_bits_per_byte" not in metrics  # no bytes known: no bits per byte
    assert "eval_a_loss" not in held_out_metrics(sums, per_set=False)
    with pytest.raises(ValueError, match="no held-out token"):
        HeldOutSums().metrics("eval")


def test_token_byte_lengths_add_up_to_the_text():
    tokenizer = default_tokenizer()
    lengths = token_byte_lengths(tokenizer)
    for text in ["def f(x):\n    return x ** 2  # squared", "Ünïcødé — 日本語 🙂", "  spaces\t\ttabs\r\n"]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        assert lengths[ids].sum() == len(text.encode("utf-8"))
    assert lengths[tokenizer.eos_token_id] == 0 and lengths[tokenizer.pad_token_id] == 0


def test_the_budget_picks_the_same_blocks_whatever_the_run():
    assert parse_token_budget("all") is None and parse_token_budget("1_048_576") == 1 << 20
    for bad in ("0", "-5", "many"):
        with pytest.raises(ValueError, match="--max-eval-tokens must be a positive number of tokens or 'all'"):
            DataArguments(max_eval_tokens=bad)
    small, large = evaluation_blocks(1000, 40), evaluation_blocks(1000, 400)
    assert set(small) <= set(large) and len(set(large)) == 400 and list(large) == sorted(large)
    assert list(evaluation_blocks(1000, 40)) == list(small)  # a fixed key: not the run's seed
    assert list(evaluation_blocks(7, 100)) == list(range(7))
    assert split_budget(100, [1000, 1000], [0.75, 0.25]) == [75, 25]
    assert split_budget(100, [10, 1000], [0.5, 0.5]) == [10, 90]  # a small set whole, the rest to the other
    assert split_budget(100, [10, 20], [0.5, 0.5]) == [10, 20]


def test_the_permutation_is_a_bijection_keyed_by_seed_and_epoch():
    for size in (1, 2, 3, 31, 1000):
        assert sorted(BlockPermutation(size, 3)(np.arange(size))) == list(range(size))
    orders = [list(BlockPermutation(50, seed, epoch)(np.arange(50))) for seed, epoch in ((0, 0), (1, 0), (0, 1))]
    assert orders[0] != orders[1] and orders[0] != orders[2]


class CountedBlocks(torch.utils.data.Dataset):
    """`size` blocks whose content is their index: enough to see which blocks a batch holds."""

    def __init__(self, size: int):
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> dict:
        return {"input_ids": np.array([index, index], dtype=np.int64)}


def batches(loader, count: int) -> list[list[int]]:
    iterator = iter(loader)
    return [next(iterator)["input_ids"][:, 0].tolist() for _ in range(count)]


def test_the_sampler_resumes_exactly_in_constant_memory(tmp_path):
    size = 3_000_000  # the stock sampler's stored permutation: > 100 MB
    trainer = tiny_trainer(ScaleVecForCausalLM(tiny_config()), tmp_path, per_device_train_batch_size=4)
    trainer.train_dataset, trainer.data_collator = CountedBlocks(size), PackedBlockCollator(0)
    tracemalloc.start()
    straight = batches(trainer.get_train_dataloader(), 6)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak < 20 << 20  # the first batches cost what a chunk of the order costs
    resumed = batches(trainer.get_resumed_dataloader(trainer.get_train_dataloader(), 4), 2)
    assert resumed == straight[4:]
    assert len({block for batch in straight for block in batch}) == 24  # distinct blocks


def test_two_ranks_read_the_batches_of_one_process():
    size, seed = 1000, 9
    one = batches(torch.utils.data.DataLoader(CountedBlocks(size), 8, sampler=ShuffledBlockSampler(size, seed, 8)), 5)
    ranks = []
    for rank in range(2):
        loader = torch.utils.data.DataLoader(CountedBlocks(size), 4, sampler=ShuffledBlockSampler(size, seed, 8))
        ranks.append(batches(prepare_data_loader(loader, num_processes=2, process_index=rank, put_on_device=False), 5))
    assert [a + b for a, b in zip(*ranks)] == one
    assert len(ShuffledBlockSampler(size, seed, 8 * 3)) == size - size % 24  # whole global batches per epoch


def test_the_card_says_what_each_evaluation_read(mixture_run):
    from scalevec.convert.card import _data_note

    record = json.loads((mixture_run["dir"] / "training_data.json").read_text())
    note = _data_note(record)
    held_out = record["eval"]
    assert f"{held_out['tokens']:,} tokens ({held_out['blocks']:,} blocks)" in note
    assert f"each evaluation read a fixed subset of {EVAL_BLOCKS * SEQ_LEN:,} tokens" in note
