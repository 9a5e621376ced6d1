"""Held-out evaluation at pretraining scale, as Megatron-LM and OLMo-core do it: the held-out blocks of each named
set are split between the processes so that each is evaluated exactly once, each process adds up the negative
log-likelihood, the predicted tokens and their bytes, and one all-reduce gives the sums. Nothing per token is kept or
gathered, so memory does not depend on how much is evaluated, and one process and N give the same loss."""

import json
import math
import re
from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
import torch
import torch.nn.functional as F

from .task_scoring import TaskEvaluation, reduce_together
from .tasks import Task

IGNORE_INDEX = -100
_BYTE_FALLBACK = re.compile(r"^<0x[0-9A-Fa-f]{2}>$")


@dataclass
class HeldOutSums:
    nll: float = 0.0  # nats, over the predicted tokens
    tokens: int = 0  # predicted tokens: every token of a block but its first
    bytes: int = 0  # UTF-8 bytes of the text the predicted tokens stand for (0 when unknown)

    def __add__(self, other: "HeldOutSums") -> "HeldOutSums":
        return HeldOutSums(self.nll + other.nll, self.tokens + other.tokens, self.bytes + other.bytes)

    def metrics(self, prefix: str) -> dict[str, float]:
        if not self.tokens:
            raise ValueError("no held-out token was evaluated")
        loss = self.nll / self.tokens
        metrics = {f"{prefix}_loss": loss, f"{prefix}_perplexity": math.exp(loss), f"{prefix}_tokens": self.tokens}
        if self.bytes:
            metrics[f"{prefix}_bits_per_byte"] = self.nll / (math.log(2) * self.bytes)
        return metrics


def held_out_metrics(sums: dict[str, HeldOutSums], prefix: str = "eval", per_set: bool = True) -> dict[str, float]:
    """Loss, perplexity, bits per byte and evaluated tokens over all sets (`eval_loss`: token-weighted, as if one
    set), and with `per_set` each set's (`eval_<name>_loss`)."""
    metrics = sum(sums.values(), HeldOutSums()).metrics(prefix)
    if per_set:
        for name, part in sums.items():
            metrics.update(part.metrics(f"{prefix}_{name}"))
    return metrics


def token_byte_lengths(tokenizer) -> np.ndarray | None:
    """The UTF-8 bytes of text that each token id stands for (special tokens: 0), so that the bytes of evaluated
    text are a sum over its tokens. Exact for byte-level BPE (GPT-2, Llama 3, Qwen, the embedded tokenizer) and
    SentencePiece with byte fallback (Llama 2, Mistral); None without a tokenizer."""
    if tokenizer is None or not hasattr(tokenizer, "convert_ids_to_tokens"):
        return None
    tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    special = set(tokenizer.all_special_ids)
    decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") if tokenizer.is_fast else None
    byte_level = "ByteLevel" in json.dumps(decoder)
    alphabet = _byte_level_alphabet() if byte_level else {}
    lengths = np.zeros(len(tokens), dtype=np.int64)
    for index, token in enumerate(tokens):
        if token is None or index in special:
            continue  # an end-of-text token stands for no text
        if byte_level and all(char in alphabet for char in token):
            lengths[index] = len(token)
        elif _BYTE_FALLBACK.match(token):
            lengths[index] = 1
        else:  # SentencePiece's "▁" is a space
            lengths[index] = len(token.replace("\u2581", " ").encode("utf-8"))
    return lengths


@lru_cache(maxsize=1)
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's map from the 256 bytes to printable characters, reversed."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    characters, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            characters[chr(byte)] = byte
        else:
            characters[chr(256 + extra)] = byte
            extra += 1
    return characters


@dataclass
class BlockEvaluation:
    """How one process evaluates: its rank among `world_size`, the batch size, how a list of blocks becomes model
    inputs, the device, and the context (autocast) its forwards run in."""

    rank: int
    world_size: int
    batch_size: int
    collate: Callable[[list], dict]
    device: torch.device
    forward_context: Callable[[], AbstractContextManager]

    def sums(self, model: torch.nn.Module, blocks, token_bytes: torch.Tensor | None) -> torch.Tensor:
        """This process's share of `blocks` (every `world_size`-th, from `rank`) as float64 sums (nll, tokens,
        bytes). Every process runs the same number of forwards, as sharded models need: a batch a process has too
        few blocks for is filled with block 0, whose labels are ignored."""
        mine = range(self.rank, len(blocks), self.world_size)
        batches = math.ceil(math.ceil(len(blocks) / self.world_size) / self.batch_size)
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)
        for batch in range(batches):
            indices = list(mine[batch * self.batch_size : (batch + 1) * self.batch_size])
            rows = _read(blocks, indices or [0])
            inputs = self.collate(rows)
            labels = inputs["labels"]
            if len(indices) < len(rows):  # fillers count for nothing (the collator's labels may share memory)
                labels = labels.clone()
                labels.view(len(rows), -1)[len(indices) :] = IGNORE_INDEX
            inputs = {key: value.to(self.device) for key, value in inputs.items() if key != "labels"}
            with torch.no_grad(), self.forward_context():
                logits = model(**inputs, use_cache=False).logits
            sums += _batch_sums(logits, labels.to(self.device), token_bytes)
        return sums

    def first_batch(self, blocks) -> dict:
        """The model inputs (no labels) of the first `batch_size` blocks: the same batch on every process."""
        inputs = self.collate(_read(blocks, list(range(min(self.batch_size, len(blocks))))))
        return {key: value.to(self.device) for key, value in inputs.items() if key != "labels"}


def score_together(
    model: torch.nn.Module,
    pieces: list,
    blocks: BlockEvaluation,
    token_bytes: torch.Tensor | None,
    tasks: list[Task],
    task_evaluation: TaskEvaluation,
) -> tuple[list[HeldOutSums], torch.Tensor]:
    """The held-out sums of each piece of blocks and the sums of each task (`task_scores`' rows) over every process:
    this process's share of both, added up in one all-reduce."""
    sums = [blocks.sums(model, piece, token_bytes) for piece in pieces]
    sums = torch.stack(sums) if sums else torch.zeros(0, 3, dtype=torch.float64, device=blocks.device)
    task_sums = task_evaluation.sums(model, tasks)
    if blocks.world_size > 1:
        sums, task_sums = reduce_together(sums, task_sums)
    return [HeldOutSums(row[0], round(row[1]), round(row[2])) for row in sums.tolist()], task_sums


def _read(blocks, indices: list[int]) -> list:
    if hasattr(blocks, "__getitems__"):
        return blocks.__getitems__(indices)
    return [blocks[index] for index in indices]


def _batch_sums(logits: torch.Tensor, labels: torch.Tensor, token_bytes: torch.Tensor | None) -> torch.Tensor:
    """(nll, tokens, bytes) of a batch; the logits in float32 one row at a time, not the whole batch at once."""
    targets = labels[:, 1:]
    counted = targets != IGNORE_INDEX
    nll = sum(
        F.cross_entropy(row[:-1].float(), target, ignore_index=IGNORE_INDEX, reduction="sum").double()
        for row, target in zip(logits, targets)
    )
    text_bytes = token_bytes[targets[counted]].sum() if token_bytes is not None else torch.zeros((), device=nll.device)
    return torch.stack([nll, counted.sum().double(), text_bytes.double()])
