"""Scoring multiple-choice tasks as lm-evaluation-harness (lm-eval) scores them, split across processes.

Each choice's request (`TaskItem.requests`) is tokenised as lm-eval's `_encode_pair` does for a causal model: the
whitespace at the end of the context moves to the start of the continuation, the context and the whole text are
encoded with the tokenizer's defaults, and the continuation is what the whole has beyond the context's tokens.
Context and continuation are cut from the left to the model's length (`max_length + 1` tokens, the last not fed),
and the log-likelihood of the continuation summed in float32, as lm-eval's `_loglikelihood_tokens` does. Per item:

- `acc`: the gold choice has the highest log-likelihood;
- `acc_norm`: the same with each log-likelihood divided by its choice's length in characters (lm-eval's);
- `bpb`: the gold continuation's negative log-likelihood in bits per UTF-8 byte of the text scored (the choice
  with its leading space), as OLMo's in-loop evaluator reports it.

Each item's context is fed once, not once per choice: one row holds the tokens its choices' inputs begin with
(the context encoded alone, as `encode_pair` encodes it, so that each input is exactly lm-eval's even where the
context's last token would merge with a choice's first), then the rest of each choice's input, which attends to that
prefix and to itself only (a 4-D mask), at the positions it has in its own input; only the scored columns' logits
are computed.
This equals one forward per choice (tests/test_task_scoring.py). Rows are sorted longest first and batched by
tokens (`_schedule`); a model whose attention takes no such mask (flash attention) or has a sliding window (which
the mask replaces) is fed each choice's input as a row of its own, in the same batches.

A task's figures are means over its items. The items are dealt to the processes by width; each keeps four sums
per task (acc, acc_norm, bpb, items) in float64 and one all-reduce adds them (`HeldOutSums`' convention), so
nothing per item is gathered, and memory depends on the batch, not on the number of items.
"""

import inspect
import math
import os
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch

from ..run_records import TaskScore, TaskScores
from .tasks import Task, TaskError, TaskItem

_SUMS = 4  # acc, acc_norm, bpb, items


def encode_pair(tokenizer, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """(context ids, continuation ids) as lm-eval's `_encode_pair` gives them for a causal model."""
    spaces = len(context) - len(context.rstrip())
    if spaces:
        context, continuation = context[:-spaces], context[-spaces:] + continuation
    whole = tokenizer.encode(context + continuation)
    context_ids = tokenizer.encode(context)
    return context_ids, whole[len(context_ids) :]


def scored_text(context: str, continuation: str) -> str:
    """The text whose tokens the continuation's log-likelihood covers (with the context's trailing whitespace)."""
    return context[len(context.rstrip()) :] + continuation


def _config(model: torch.nn.Module):
    return getattr(model, "config", None) or getattr(getattr(model, "module", None), "config", None)  # DDP's


def model_length(model: torch.nn.Module, default: int = 2048) -> int:
    """The longest input a model takes, found as lm-eval's HFLM finds it."""
    config = _config(model)
    for attribute in ("n_positions", "max_position_embeddings", "n_ctx"):
        if (value := getattr(config, attribute, None)) is not None:
            return value
    return default


def check_requests(tokenizer, tasks: list[Task], length: int) -> None:
    """Refuse, before anything is trained or scored, an item that cannot be scored by a model of `length`
    positions: a context or continuation that encodes to no token, or a continuation longer than the model. The
    `TaskError` names the item's file and line (or a built-in's row)."""
    for task in tasks:
        for item in task.items:
            for context, continuation in item.requests():
                _encoded(tokenizer, item, context, continuation, length)


def _encoded(tokenizer, item: TaskItem, context: str, continuation: str, length: int) -> tuple[list[int], list[int]]:
    context_ids, continuation_ids = encode_pair(tokenizer, context, continuation)
    where = item.origin or f"item {item.context[:40]!r}"
    if not context_ids:
        raise TaskError(f"{where}: the context {context!r} encodes to no token (there is nothing to condition on)")
    if not continuation_ids:
        raise TaskError(f"{where}: the continuation {continuation!r} encodes to no token beyond the context")
    if len(continuation_ids) > length:
        raise TaskError(
            f"{where}: a continuation of {len(continuation_ids)} tokens exceeds the model's {length} positions: "
            f"{continuation[:60]!r}..."
        )
    return context_ids, continuation_ids


def fed_tokens(tokenizer, tasks: list[Task], model: torch.nn.Module, batch_size: int, world_size: int = 1) -> int:
    """The tokens that scoring `tasks` with `model` feeds over `world_size` processes, counted on the batches
    `TaskEvaluation` builds (padding included) and on the one-token forwards of the processes with fewer batches
    than the busiest."""
    total = 0
    for task in tasks:
        schedule = _schedule(tokenizer, task.items, model, batch_size, world_size)
        most = max(len(batches) for batches in schedule)
        total += sum(len(batch) * batch[0].width for batches in schedule for batch in batches)
        total += sum(most - len(batches) for batches in schedule)
    return total


def shares_prefixes(model: torch.nn.Module) -> bool:
    """Whether the model's attention takes the 4-D mask that lets an item's choices share its context in one row
    (eager and SDPA do; flash attention reads a mask as padding only) and needs no other (a sliding window, which
    a given 4-D mask replaces)."""
    config = _config(model)
    attention = getattr(config, "_attn_implementation", None)
    return attention in ("eager", "sdpa") and not getattr(config, "sliding_window", None)


@dataclass
class _Branch:
    choice: int
    tokens: list[int]  # the choice's model input after the row's prefix
    continuation: list[int]  # the tokens scored: what the input's last len(continuation) positions predict


@dataclass
class _Row:
    """One row of a forward: an item's prefix (what all its choices' inputs begin with), fed once, then the rest of
    the input of some of its choices, each attending to the prefix and to itself only, at the positions it has in
    its own input."""

    item: int
    choices: int  # of the item
    prefix: list[int]
    branches: list[_Branch] = field(default_factory=list)

    @property
    def width(self) -> int:
        return len(self.prefix) + sum(len(branch.tokens) for branch in self.branches)

    def layout(self) -> tuple[list[int], list[int], list[int]]:
        """(tokens, positions, segments) along the row: the prefix's segment is 0, the k-th branch's k."""
        tokens, positions, segments = list(self.prefix), list(range(len(self.prefix))), [0] * len(self.prefix)
        for k, branch in enumerate(self.branches, 1):
            tokens += branch.tokens
            positions += range(len(self.prefix), len(self.prefix) + len(branch.tokens))
            segments += [k] * len(branch.tokens)
        return tokens, positions, segments

    def scored_columns(self) -> Iterator[list[int]]:
        """For each branch, the columns of the row whose predictions score its continuation: the last
        len(continuation) positions of the choice's input, in the prefix or in the branch."""
        start = len(self.prefix)
        for branch in self.branches:
            fed = len(self.prefix) + len(branch.tokens)
            positions = range(fed - len(branch.continuation), fed)
            yield [p if p < len(self.prefix) else start + p - len(self.prefix) for p in positions]
            start += len(branch.tokens)


def _inputs(tokenizer, item: TaskItem, length: int) -> list[tuple[list[int], list[int]]]:
    """(model input, continuation) of each choice: context and continuation cut from the left to `length` + 1
    tokens, the last not fed, as lm-eval's `_loglikelihood_tokens` cuts them."""
    pairs = []
    for context, continuation in item.requests():
        context_ids, continuation_ids = _encoded(tokenizer, item, context, continuation, length)
        pairs.append(((context_ids + continuation_ids)[-(length + 1) : -1], continuation_ids))
    return pairs


def _rows(index: int, inputs: list[tuple[list[int], list[int]]], widest: int, shares: bool) -> list[_Row]:
    """An item's rows: its choices' inputs split after their common prefix, as many to a row as fit in `widest`
    tokens; without `shares`, each input whole in a row of its own."""
    if not shares:
        return [_Row(index, len(inputs), [], [_Branch(k, fed, scored)]) for k, (fed, scored) in enumerate(inputs)]
    common = len(os.path.commonprefix([fed for fed, _ in inputs]))  # of lists as of strings
    rows = [_Row(index, len(inputs), inputs[0][0][:common])]
    for choice, (fed, scored) in enumerate(inputs):
        if rows[-1].branches and rows[-1].width + len(fed) - common > widest:
            rows.append(_Row(index, len(inputs), rows[-1].prefix))
        rows[-1].branches.append(_Branch(choice, fed[common:], scored))
    return rows


def _schedule(tokenizer, items: list[TaskItem], model, batch_size: int, world_size: int) -> list[list[list[_Row]]]:
    """Each process's batches of rows. The budget of a batch is `batch_size` times the longest choice input of
    `items`, padding included: the tokens of `batch_size` requests. Items are dealt to the processes in order of
    width, so that each gets a like share; each process's rows are sorted longest first (a batch too large for
    memory fails at once, as in lm-eval's `Collator`), and a batch takes rows while their number times the first's
    width stays within the budget."""
    length = model_length(model)
    inputs = [_inputs(tokenizer, item, length) for item in items]
    budget = batch_size * max((len(fed) for pairs in inputs for fed, _ in pairs), default=0)
    rows = [_rows(index, pairs, min(budget, length), shares_prefixes(model)) for index, pairs in enumerate(inputs)]
    by_width = sorted(range(len(items)), key=lambda index: -max(row.width for row in rows[index]))
    schedule = []
    for rank in range(world_size):
        mine = sorted((row for index in by_width[rank::world_size] for row in rows[index]), key=lambda r: -r.width)
        batches: list[list[_Row]] = []
        for row in mine:
            if batches and (len(batches[-1]) + 1) * batches[-1][0].width <= budget:
                batches[-1].append(row)
            else:
                batches.append([row])
        schedule.append(batches)
    return schedule


@dataclass
class TaskEvaluation:
    """How one process scores tasks: its rank among `world_size`, the tokens a forward takes (`batch_size` times
    the longest request: `_schedule`), the device, and the context (autocast) its forwards run in."""

    tokenizer: object
    rank: int = 0
    world_size: int = 1
    batch_size: int = 8
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    forward_context: Callable[[], AbstractContextManager] = nullcontext

    def loglikelihoods(self, model: torch.nn.Module, items: list[TaskItem]) -> list[tuple[int, list[float]]]:
        """(index, log-likelihood of each choice) of this process's items, in the items' order. Every process runs
        as many forwards as the busiest one (a sharded model needs every process in each forward): the others run
        a one-token filler."""
        schedule = _schedule(self.tokenizer, items, model, self.batch_size, self.world_size)
        selects = "logits_to_keep" in inspect.signature(getattr(model, "module", model).forward).parameters
        scores: dict[int, list[float | None]] = {}
        for batch in schedule[self.rank]:
            branches = [(row, branch) for row in batch for branch in row.branches]
            for (row, branch), loglikelihood in zip(branches, self._score(model, batch, selects)):
                scores.setdefault(row.item, [None] * row.choices)[branch.choice] = loglikelihood
        for _ in range(max(len(batches) for batches in schedule) - len(schedule[self.rank])):
            self._forward(model, input_ids=torch.zeros(1, 1, dtype=torch.long))
        return sorted(scores.items())

    def _score(self, model, batch: list[_Row], selects: bool) -> list[float]:
        """The log-likelihood of each branch of the batch's rows; one device sync."""
        width = batch[0].width
        tokens = torch.zeros(len(batch), width, dtype=torch.long)
        positions = torch.zeros(len(batch), width, dtype=torch.long)
        segments = torch.full((len(batch), width), -1)  # padding
        rows, columns, targets, counts = [], [], [], []  # of each scored token; tokens of each branch
        for r, row in enumerate(batch):
            for values, tensor in zip(row.layout(), (tokens, positions, segments)):
                tensor[r, : len(values)] = torch.tensor(values)
            for branch, scored in zip(row.branches, row.scored_columns()):
                rows += [r] * len(scored)
                columns += scored
                targets += branch.continuation
                counts.append(len(scored))
        inputs = {"input_ids": tokens}
        if any(sum(bool(branch.tokens) for branch in row.branches) > 1 for row in batch):  # not plain sequences
            inputs.update(attention_mask=self._mask(model, segments), position_ids=positions)
        if selects:  # the logits of the scored columns only
            kept = sorted(set(columns))
            inputs["logits_to_keep"] = torch.tensor(kept)
            columns = list(map({column: k for k, column in enumerate(kept)}.get, columns))
        logits = self._forward(model, **{key: value.to(self.device) for key, value in inputs.items()})
        rows, columns, targets = (torch.tensor(v, device=self.device) for v in (rows, columns, targets))
        log_probs = logits[rows, columns].float().log_softmax(-1).gather(-1, targets[:, None])[:, 0]
        # each branch's own float32 `sum`, as lm-eval adds a continuation's: the same rounding
        sums = torch.stack([part.sum() for part in log_probs.split(counts)])
        return sums.tolist()

    @staticmethod
    def _mask(model, segments: torch.Tensor) -> torch.Tensor:
        """(rows, 1, queries, keys): causal, and a token sees the prefix (segment 0) and its own segment; padding
        sees itself, so that no attention row is empty. Boolean for SDPA; additive for eager attention."""
        width = segments.shape[1]
        causal = torch.ones(width, width, dtype=torch.bool).tril()
        keys, queries = segments[:, None, :], segments[:, :, None]
        allowed = (causal & ((keys == 0) | (keys == queries)))[:, None]
        if _config(model)._attn_implementation == "sdpa":
            return allowed
        return torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)

    def _forward(self, model, **inputs: torch.Tensor) -> torch.Tensor:
        with torch.no_grad(), self.forward_context():
            return model(**inputs, use_cache=False).logits

    def sums(self, model: torch.nn.Module, tasks: list[Task]) -> torch.Tensor:
        """This process's float64 sums of each task: a row of (acc, acc_norm, bpb, items) per task."""
        sums = torch.zeros(len(tasks), _SUMS, dtype=torch.float64)
        for row, task in zip(sums, tasks):
            for index, lls in self.loglikelihoods(model, task.items):
                row += torch.tensor(item_scores(task.items[index], lls), dtype=torch.float64)
        return sums.to(self.device)


def item_scores(item: TaskItem, lls: list[float]) -> tuple[float, float, float, float]:
    """(acc, acc_norm, bpb, 1) of one item from its choices' log-likelihoods; ties go to the first, as argmax."""
    normalized = [ll / length for ll, length in zip(lls, item.normalizers())]
    context, continuation = item.requests()[item.gold]
    gold_bytes = len(scored_text(context, continuation).encode("utf-8"))
    acc = float(max(range(len(lls)), key=lls.__getitem__) == item.gold)
    acc_norm = float(max(range(len(lls)), key=normalized.__getitem__) == item.gold)
    return acc, acc_norm, -lls[item.gold] / (math.log(2) * gold_bytes), 1.0


def task_scores(names: list[str], sums: torch.Tensor) -> TaskScores:
    """The `TaskScores` of the tasks `names` from each one's summed row (`TaskEvaluation.sums`, all-reduced)."""
    scores = {}
    for name, (acc, acc_norm, bpb, items) in zip(names, sums.tolist()):
        if not items:
            raise ValueError(f"task {name}: no item was scored")
        scores[name] = TaskScore(acc / items, acc_norm / items, bpb / items, int(items))
    return TaskScores(scores)


def reduce_together(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Each tensor summed over all processes, in one all-reduce."""
    flat = torch.cat([tensor.flatten() for tensor in tensors])
    torch.distributed.all_reduce(flat)
    return [part.view_as(tensor) for part, tensor in zip(flat.split([t.numel() for t in tensors]), tensors)]
