"""What an evaluation reads: a token budget's worth of held-out blocks, the same blocks at every evaluation of a
run, on any number of processes, and in every run on the same held-out data, so that loss curves compare across
steps and runs (Megatron-LM's `--eval-iters`, nanoGPT's `eval_iters`, OLMo-core's fixed evaluation sets).

The budget is split between the held-out sets by weight (a mixture's weights: the combined loss is then the loss on
the training mixture), a set with fewer blocks than its share evaluated whole and the rest shared by the others.
Within a set the blocks are the first positions of a permutation with a fixed key (`evaluation_blocks`), so a
smaller budget's blocks are part of a larger one's. The evaluation holds their indices: 8 bytes a block.

The evaluated blocks of each set fall into two fixed, disjoint halves (`evaluation_halves`: the even and the odd
positions among them), whose losses `--eval-halves` (which scalevec-ablate sets) logs beside `eval_loss` as
`eval_select_loss` and `eval_report_loss`: a study picks each variant's learning rate on the selection half and
measures differences on the report half, so that the number it reports was not also the one it chose by. The halves
are the same on any number of processes.
"""

import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Subset

from ..run_records import EvaluationRecord
from .mixture import places
from .prepared import PreparedBlocks
from .sampler import evaluation_blocks
from .sources import COMPRESSIONS, FORMATS

DEFAULT_EVAL_TOKENS = 1 << 20
DEFAULT_TASK_EXAMPLES = 500  # items of each multiple-choice task an evaluation scores (scalevec/evaluation/tasks.py)
EVALUATION_HALVES = ("select", "report")  # in metric names: eval_select_loss, eval_report_loss
_SUFFIXES = (*COMPRESSIONS, *FORMATS)  # what a data file's name ends with


@dataclass
class HeldOutSet:
    name: str  # in metric names: eval_<name>_loss
    blocks: torch.utils.data.Dataset
    weight: float


def parse_token_budget(text: str) -> int | None:
    """`--max-eval-tokens`: a positive number of tokens, or `all` (None)."""
    if text.strip().lower() == "all":
        return None
    try:
        budget = int(text.replace("_", "").replace(",", ""))
    except ValueError:
        budget = 0
    if budget < 1:
        raise ValueError(f"--max-eval-tokens must be a positive number of tokens or 'all'; got {text!r}")
    return budget


def split_budget(budget: int, sizes: Sequence[int], weights: Sequence[float]) -> list[int]:
    """Blocks per set: `budget` shared by `weights`, no set given more than its `sizes`, the surplus shared again."""
    counts, remaining = [0] * len(sizes), min(budget, sum(sizes))
    open_sets = [k for k, size in enumerate(sizes) if size > 0]
    while open_sets and remaining > 0:
        weight = sum(weights[k] for k in open_sets)
        full = [k for k in open_sets if remaining * weights[k] / weight >= sizes[k]]
        if not full:
            for k, count in zip(open_sets, places(remaining, [weights[k] for k in open_sets])):
                counts[k] = count
            break
        for k in full:
            counts[k], remaining = sizes[k], remaining - sizes[k]
        open_sets = [k for k in open_sets if k not in full]
    return counts


def evaluation_sets(
    sets: list[HeldOutSet], seq_len: int, budget_tokens: int | None
) -> dict[str, torch.utils.data.Subset]:
    """Each set's evaluated blocks (at least one block in all, where there are any), by name."""
    sizes = [len(held_out.blocks) for held_out in sets]
    budget = sum(sizes) if budget_tokens is None else max(1, budget_tokens // seq_len)
    counts = split_budget(budget, sizes, [held_out.weight for held_out in sets])
    return {
        held_out.name: Subset(held_out.blocks, evaluation_blocks(len(held_out.blocks), count))
        for held_out, count in zip(sets, counts)
        if count
    }


def evaluation_halves(blocks: torch.utils.data.Dataset) -> tuple[Subset, Subset]:
    """The selection half (even positions) and the report half (odd positions) of a set's evaluated blocks."""
    return Subset(blocks, range(0, len(blocks), 2)), Subset(blocks, range(1, len(blocks), 2))


def recorded_evaluation(evaluation: EvaluationRecord | dict) -> dict[str, Subset]:
    """The blocks each evaluation of a run read, from what it recorded (`EvaluationRecord`, or `training_data.json`'s
    "eval" entry)."""
    if isinstance(evaluation, dict):
        evaluation = EvaluationRecord.read({"eval": evaluation})
    return {
        held_out.name: Subset(
            PreparedBlocks(held_out.folder, held_out.split),
            evaluation_blocks(held_out.blocks, held_out.evaluated_blocks),
        )
        for held_out in evaluation.sets
    }


def set_names(entries: Sequence[str]) -> list[str]:
    """A short name per data source, for metric names: `data/web.jsonl.gz` -> `web`; repeats numbered."""
    names: list[str] = []
    for entry in entries:
        name = Path(entry.rstrip("/")).name or entry
        while name.endswith(_SUFFIXES):
            name = name[: name.rindex(".")]
        name = re.sub(r"[^A-Za-z0-9_-]+", "_", name).strip("_") or "data"
        unique, number = name, 1
        while unique in names or unique in EVALUATION_HALVES:  # eval_select_loss names the half
            number += 1
            unique = f"{name}_{number}"
        names.append(unique)
    return names
