"""Scoring multiple-choice tasks as lm-evaluation-harness (lm-eval) scores them, split across processes.

Each choice's request (`TaskItem.requests`) is tokenised as lm-eval's `_encode_pair` does for a causal model: the
whitespace at the end of the context moves to the start of the continuation, the context and the whole text are
encoded with the tokenizer's defaults, and the continuation is what the whole has beyond the context's tokens.
Context and continuation are cut from the left to the model's length (`max_length + 1` tokens, the last not fed),
batched right-padded without an attention mask, and the log-likelihood of the continuation summed in float32, as
lm-eval's `_loglikelihood_tokens` does. Per item:

- `acc`: the gold choice has the highest log-likelihood;
- `acc_norm`: the same with each log-likelihood divided by its choice's length in characters (lm-eval's);
- `bpb`: the gold continuation's negative log-likelihood in bits per UTF-8 byte of the text scored (the choice
  with its leading space), as OLMo's in-loop evaluator reports it.

A task's figures are means over its items. Process r scores items r, r + N, ...; each keeps four sums per task
(acc, acc_norm, bpb, items) in float64 and one all-reduce adds them (`HeldOutSums`' convention), so nothing per
item is kept or gathered, and memory depends on the batch, not on the number of items.
"""

import math
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..run_records import TASK_FIGURES, TASKS_MEAN
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


def model_length(model: torch.nn.Module, default: int = 2048) -> int:
    """The longest input a model takes, found as lm-eval's HFLM finds it."""
    config = getattr(model, "config", None) or getattr(getattr(model, "module", None), "config", None)  # DDP's
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


def fed_tokens(tokenizer, tasks: list[Task], length: int, batch_size: int, world_size: int = 1) -> int:
    """The tokens that scoring `tasks` feeds a model of `length` positions over `world_size` processes, counted on
    the batches `TaskEvaluation` builds: each right-padded to its longest request, and the one-token forwards of a
    process with fewer batches than the busiest."""
    total = 0
    for task in tasks:
        for rank in range(world_size):
            scorer = TaskEvaluation(tokenizer, rank, world_size, batch_size)
            batches = [[len(request.inputs) for request in batch] for batch in scorer.batches(task.items, length)]
            total += sum(len(batch) * max(batch) for batch in batches)
            total += scorer.forwards(task.items) - len(batches)
    return total


@dataclass
class _Request:
    item: int  # index among the items being scored
    choice: int
    choices: int  # of the item
    inputs: list[int]  # fed to the model: context and continuation, less the last token
    continuation: list[int]


@dataclass
class TaskEvaluation:
    """How one process scores tasks: its rank among `world_size`, how many sequences a forward takes, the device,
    and the context (autocast) its forwards run in."""

    tokenizer: object
    rank: int = 0
    world_size: int = 1
    batch_size: int = 8
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    forward_context: Callable[[], AbstractContextManager] = nullcontext

    def loglikelihoods(self, model: torch.nn.Module, items: list[TaskItem]) -> Iterator[tuple[int, list[float]]]:
        """(index, log-likelihood of each choice) of this process's items, in order. Every process runs as many
        forwards as the busiest one (a sharded model needs every process in each forward): the others run a
        one-token filler."""
        forwards = self.forwards(items)
        scores: dict[int, list[float | None]] = {}
        for batch in self.batches(items, model_length(model)):
            yield from self._flush(model, batch, scores)
            forwards -= 1
        for _ in range(forwards):
            self._forward(model, [[0]])

    def forwards(self, items: list[TaskItem]) -> int:
        """The forwards every process runs on `items`: the busiest process's batches."""
        most = max(
            sum(len(items[i].choices) for i in range(r, len(items), self.world_size)) for r in range(self.world_size)
        )
        return math.ceil(most / self.batch_size)

    def batches(self, items: list[TaskItem], length: int) -> Iterator[list[_Request]]:
        """This process's requests (items rank, rank + world_size, ...), `batch_size` at a time, in order, each
        cut from the left to `length` + 1 tokens."""
        pending: list[_Request] = []
        for index in range(self.rank, len(items), self.world_size):
            item = items[index]
            for choice, (context, continuation) in enumerate(item.requests()):
                context_ids, continuation_ids = _encoded(self.tokenizer, item, context, continuation, length)
                whole = (context_ids + continuation_ids)[-(length + 1) :]
                pending.append(_Request(index, choice, len(item.choices), whole[:-1], continuation_ids))
                if len(pending) == self.batch_size:
                    yield pending
                    pending = []
        if pending:
            yield pending

    def _flush(self, model, pending: list[_Request], scores: dict) -> Iterator[tuple[int, list[float]]]:
        """Score the pending requests; yield each item whose choices are all scored, and forget it."""
        logits = self._forward(model, [request.inputs for request in pending])
        sums = []
        for row, request in zip(logits, pending):
            end = len(request.inputs)
            targets = torch.tensor(request.continuation, device=row.device)
            log_probs = F.log_softmax(row[end - len(targets) : end].float(), dim=-1)
            sums.append(log_probs.gather(-1, targets[:, None]).sum())
        for request, loglikelihood in zip(pending, torch.stack(sums).tolist()):  # one device sync a batch
            scores.setdefault(request.item, [None] * request.choices)[request.choice] = loglikelihood
        done = sorted({request.item for request in pending if None not in scores[request.item]})
        for index in done:
            yield index, scores.pop(index)

    def _forward(self, model, rows: list[list[int]]) -> torch.Tensor:
        width = max(len(row) for row in rows)
        batch = torch.zeros(len(rows), width, dtype=torch.long)
        for k, row in enumerate(rows):
            batch[k, : len(row)] = torch.tensor(row)
        with torch.no_grad(), self.forward_context():
            return model(input_ids=batch.to(self.device), use_cache=False).logits

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


def task_metrics(names: list[str], sums: torch.Tensor, prefix: str = "eval") -> dict[str, float]:
    """`<prefix>_<task>_{acc,acc_norm,bpb,items}` from each task's summed row, and with several tasks their
    unweighted mean (`<prefix>_tasks_acc`, ...: each task counts once, as OLMo's and nanochat's averages)."""
    metrics: dict[str, float] = {}
    for name, (acc, acc_norm, bpb, items) in zip(names, sums.tolist()):
        if not items:
            raise ValueError(f"task {name}: no item was scored")
        metrics.update(
            {f"{prefix}_{name}_{figure}": value / items for figure, value in zip(TASK_FIGURES, (acc, acc_norm, bpb))}
        )
        metrics[f"{prefix}_{name}_items"] = int(items)
    if len(names) > 1:
        for figure in TASK_FIGURES:
            metrics[f"{prefix}_{TASKS_MEAN}_{figure}"] = sum(metrics[f"{prefix}_{n}_{figure}"] for n in names) / len(
                names
            )
    return metrics


def reduce_together(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """Each tensor summed over all processes, in one all-reduce."""
    flat = torch.cat([tensor.flatten() for tensor in tensors])
    torch.distributed.all_reduce(flat)
    return [part.view_as(tensor) for part, tensor in zip(flat.split([t.numel() for t in tensors]), tensors)]
