"""A whole saved model scored on multiple-choice tasks and held-out blocks, as `scalevec-eval` and the study score
one: `evaluate_model` and its `EvaluationResult`."""

import json
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, field

import torch

from ..data.collator import PackedBlockCollator
from .held_out import BlockEvaluation, HeldOutSums, held_out_metrics, score_together, token_byte_lengths
from .quantization import quantization_deltas
from .task_scoring import TaskEvaluation, task_scores
from .tasks import Task


@dataclass
class EvaluationResult:
    model: str
    tasks: dict[str, dict[str, float]]  # name -> acc, acc_norm, bpb, items
    held_out: dict[str, float] | None  # loss, perplexity, bits_per_byte, tokens
    seconds: float
    quantized: dict[str, "EvaluationResult"] = field(default_factory=dict)  # scheme -> the quantized model's scores

    def scores(self) -> dict:
        return {"tasks": self.tasks, "held_out": self.held_out}

    def differences(self) -> dict[str, dict]:
        """Per quantization scheme, its scores minus the unquantized ones (`quantization_deltas`)."""
        return quantization_deltas(self.scores(), {scheme: q.scores() for scheme, q in self.quantized.items()})

    def to_json(self) -> str:
        record = {"model": self.model, **self.scores(), "seconds": self.seconds}
        if self.quantized:
            record["quantized"] = {s: {**q.scores(), "seconds": q.seconds} for s, q in self.quantized.items()}
            record["differences"] = self.differences()
        return json.dumps(record, indent=2) + "\n"


def evaluate_model(
    model: torch.nn.Module,
    tokenizer,
    tasks: list[Task],
    held_out: dict[str, torch.utils.data.Dataset] | None = None,
    *,
    name: str = "",
    batch_size: int = 8,
    rank: int = 0,
    world_size: int = 1,
) -> EvaluationResult:
    """Score `model` on `tasks` and on the `held_out` block sets (each process its share of items and blocks,
    the sums added in one all-reduce when `world_size` > 1). One call per model: a caller comparing variants of a
    model (quantized ones, say) calls it once for each, on the same tasks and blocks."""
    start = time.perf_counter()
    model.eval()
    device = next(model.parameters()).device
    lengths = token_byte_lengths(tokenizer)
    token_bytes = torch.from_numpy(lengths).to(device) if lengths is not None else None
    blocks = BlockEvaluation(
        rank, world_size, batch_size, PackedBlockCollator(tokenizer.eos_token_id), device, nullcontext
    )
    task_evaluation = TaskEvaluation(tokenizer, rank, world_size, batch_size, device)
    pieces = list((held_out or {}).values())
    held_sums, task_sums = score_together(model, pieces, blocks, token_bytes, tasks, task_evaluation)
    scored = task_scores([task.name for task in tasks], task_sums).tasks
    # each task's figures and what they were computed on (`Task.provenance`: the card's model-index, .eval_results/)
    scores = {task.name: {**asdict(scored[task.name]), **task.provenance()} for task in tasks}
    return EvaluationResult(name, scores, _held_out_figures(held_sums), time.perf_counter() - start)


def _held_out_figures(sums: list[HeldOutSums]) -> dict[str, float] | None:
    if not sums:
        return None
    total = sum(sums, HeldOutSums())
    metrics = held_out_metrics({"all": total}, "eval", per_set=False)
    return {key.removeprefix("eval_"): value for key, value in metrics.items()}
