"""The task scorer's batching (scalevec/evaluation/task_scoring.py): each item's context fed once and shared by its
choices, in length-sorted batches sized in tokens, equals one plain forward per choice; results come back in the
items' order, and processes with uneven shares score every item once and run as many forwards each."""

from types import SimpleNamespace

import pytest
import torch

from scalevec import ScaleVecForCausalLM
from scalevec.data import default_tokenizer
from scalevec.evaluation import task_scoring
from scalevec.evaluation.task_scoring import TaskEvaluation, encode_pair
from scalevec.evaluation.tasks import Task, TaskItem

from ._helpers import randomize_scales, tiny_config

LONG = "dog ran far away quickly under the old bridge and over the green hill while the sun went down slowly " * 2


def items() -> list[TaskItem]:
    return [
        TaskItem("The cat sat on the", ("mat", LONG.strip()), 1),  # choices of 1 and 40 tokens
        TaskItem("Q: what is it? ", ("a",), 0),  # one choice, the context's space moved into it
        TaskItem("The cup fell because ", ("the cup", "the table"), 1, suffix="was tilted."),  # two contexts
        TaskItem("The cat sa", ("t", "ndwich ate", "ve"), 0),  # the context's last token merges with a choice
        TaskItem("A", ("b", "c d", "e f g", "h i j k"), 3),
        TaskItem("Once upon a time there was a " + LONG, ("king", "queen", "frog"), 2),
    ]


@pytest.fixture(scope="module")
def tokenizer():
    return default_tokenizer()


def model(tokenizer, attention: str = "sdpa") -> ScaleVecForCausalLM:
    torch.manual_seed(0)
    config = tiny_config(vocab_size=len(tokenizer), max_position_embeddings=128, eos_token_id=tokenizer.eos_token_id)
    scorer = ScaleVecForCausalLM._from_config(config, attn_implementation=attention).eval()
    randomize_scales(scorer)
    return scorer


def plain(model, tokenizer, item: TaskItem) -> list[float]:
    """One forward per choice, of its whole input, the log-likelihood computed as lm-eval's (float32)."""
    loglikelihoods = []
    for context, continuation in item.requests():
        context_ids, continuation_ids = encode_pair(tokenizer, context, continuation)
        with torch.no_grad():
            logits = model(torch.tensor([context_ids + continuation_ids[:-1]])).logits[0]
        positions = torch.arange(len(context_ids) - 1, len(context_ids) + len(continuation_ids) - 1)
        loglikelihoods.append(logits.log_softmax(-1)[positions, continuation_ids].sum().item())
    return loglikelihoods


def forwards(model) -> list[dict]:
    """The inputs of each forward `model` runs from now on."""
    seen = []
    model.register_forward_hook(lambda module, args, kwargs, output: seen.append(kwargs), with_kwargs=True)
    return seen


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_shared_contexts_score_what_one_forward_per_choice_scores(tokenizer, attention):
    scorer, scored = model(tokenizer, attention), items()
    context_ids, _ = encode_pair(tokenizer, "The cat sa", "t")
    assert tokenizer.encode("The cat sat")[: len(context_ids)] != context_ids  # the merge the item is there for
    lengths = [len(encode_pair(tokenizer, "The cat sat on the", f" {choice}")[1]) for choice in scored[0].choices]
    assert lengths[1] >= 10 * lengths[0]
    expected = [plain(scorer, tokenizer, item) for item in scored]
    seen = forwards(scorer)
    results = TaskEvaluation(tokenizer, batch_size=2).loglikelihoods(scorer, scored)
    assert [index for index, _ in results] == list(range(len(scored)))  # the items' order, not the batches'
    for index, loglikelihoods in results:
        assert loglikelihoods == pytest.approx(expected[index], abs=1e-4), index
    # the contexts were shared (a 4-D mask), the widest batch first, and a batch held rows of different widths
    assert any(inputs.get("attention_mask") is not None and inputs["attention_mask"].dim() == 4 for inputs in seen)
    widths = [inputs["input_ids"].shape[1] for inputs in seen]
    assert widths == sorted(widths, reverse=True)
    (batches,) = task_scoring._schedule(tokenizer, scored, scorer, 2, 1)
    assert any(len({row.width for row in batch}) > 1 for batch in batches)


def test_batches_are_sized_in_tokens_and_feed_each_context_once(tokenizer):
    """A forward takes at most batch_size x the longest request (padding included), and the tokens fed are each
    item's prefix once and the rest of each choice: fewer than one input per choice."""
    scorer, scored = model(tokenizer), items()
    seen = forwards(scorer)
    TaskEvaluation(tokenizer, batch_size=3).loglikelihoods(scorer, scored)
    inputs = [encode_pair(tokenizer, *request) for item in scored for request in item.requests()]
    longest = max(len(context) + len(continuation) - 1 for context, continuation in inputs)
    fed = [forward["input_ids"].numel() for forward in seen]
    assert max(fed) <= 3 * longest and len(seen) < len(scored)
    assert sum(fed) < sum(len(context) + len(continuation) - 1 for context, continuation in inputs)
    assert sum(fed) == task_scoring.fed_tokens(tokenizer, [Task("t", "t", scored, 6)], scorer, 3)


def test_an_item_wider_than_the_budget_is_split_over_rows(tokenizer):
    """batch_size 1: the budget is the longest request, so an item whose prefix and choices exceed it is split over
    rows (each with the prefix again), no forward exceeds it, and the scores are still the plain forwards'."""
    scorer, scored = model(tokenizer), items()
    expected = [plain(scorer, tokenizer, item) for item in scored]
    seen = forwards(scorer)
    results = dict(TaskEvaluation(tokenizer, batch_size=1).loglikelihoods(scorer, scored))
    assert [results[index] for index in range(len(scored))] == [pytest.approx(e, abs=1e-4) for e in expected]
    (batches,) = task_scoring._schedule(tokenizer, scored, scorer, 1, 1)
    rows = [row.item for batch in batches for row in batch]
    assert len(rows) > len(set(rows)) == len(scored)
    longest = max(
        len(a) + len(b) - 1 for item in scored for a, b in (encode_pair(tokenizer, *r) for r in item.requests())
    )
    assert max(forward["input_ids"].numel() for forward in seen) <= longest


def test_a_model_whose_attention_takes_no_4d_mask_gets_a_row_per_choice(tokenizer):
    """Flash attention reads a mask as padding only, and a given mask would replace a sliding window: such a model
    is fed each choice's input whole, without a mask, and scores the same."""
    flash = torch.nn.Module()
    flash.config = SimpleNamespace(_attn_implementation="flash_attention_2")
    scorer, scored = model(tokenizer), items()
    assert not task_scoring.shares_prefixes(flash) and task_scoring.shares_prefixes(scorer)
    scorer.config.sliding_window = 4096  # read by the scorer alone: the tiny model's attention has no window
    assert not task_scoring.shares_prefixes(scorer)
    expected = [plain(scorer, tokenizer, item) for item in scored]
    seen = forwards(scorer)
    results = dict(TaskEvaluation(tokenizer, batch_size=4).loglikelihoods(scorer, scored))
    assert [results[index] for index in range(len(scored))] == [pytest.approx(e, abs=1e-4) for e in expected]
    assert all("attention_mask" not in forward for forward in seen)


@pytest.mark.parametrize("world_size", [2, 4])
def test_uneven_shares_score_every_item_once_in_as_many_forwards(tokenizer, world_size):
    """Six items over 2 and 4 processes: every item scored by exactly one, as on one; every process runs as many
    forwards as the busiest (one-token fillers), and the task sums add up to one process's."""
    scorer, scored = model(tokenizer), items()
    alone = dict(TaskEvaluation(tokenizer, batch_size=2).loglikelihoods(scorer, scored))
    seen = forwards(scorer)
    counts, shares = [], {}
    for rank in range(world_size):
        before = len(seen)
        for index, loglikelihoods in TaskEvaluation(tokenizer, rank, world_size, 2).loglikelihoods(scorer, scored):
            assert index not in shares
            shares[index] = loglikelihoods
        counts.append(len(seen) - before)
    assert sorted(shares) == list(range(len(scored))) and len(set(counts)) == 1
    for index in alone:
        assert shares[index] == pytest.approx(alone[index], abs=1e-4)
    task = [Task("t", "t", scored, 6)]
    sums = sum(TaskEvaluation(tokenizer, rank, world_size, 2).sums(scorer, task) for rank in range(world_size))
    assert sums[0].tolist() == pytest.approx(TaskEvaluation(tokenizer, batch_size=2).sums(scorer, task)[0].tolist())
