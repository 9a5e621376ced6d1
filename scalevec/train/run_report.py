"""What `scalevec-train` tells a person: the plan at the start of a run (model, tokens, data, checkpoints, what is
logged) and, at its end, what happened (losses, evaluation, throughput, where everything went), also written to
`run_summary.json` for the model card."""

import math
import platform
import time
from collections.abc import Sequence
from pathlib import Path

import torch
from transformers import TrainerCallback

from ..convert.meta_model import non_embedding_parameters
from ..data import TrainingData
from ..data.held_out import EVALUATION_HALVES
from ..evaluation.task_scoring import fed_tokens
from ..evaluation.tasks import Task
from ..run_records import (
    EvaluationRecord,
    TaskScores,
    duration_text,
    logged_entries,
    loss_coverage,
    part_note,
    segments_text,
    whole_run,
)
from .throughput import model_flops_per_token, throughput_figures, training_peak_flops


def hardware(args) -> str:
    """The devices a run's times come from: `8 × NVIDIA H100 80GB HBM3`, `1 × CPU (Intel Xeon ..., 2 threads)`."""
    if args.device.type == "cuda":
        name = torch.cuda.get_device_name(args.device)
    else:
        name = f"CPU ({_cpu_model()}, {torch.get_num_threads()} threads)"
    return f"{args.world_size} × {name}"


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _precision(args) -> str:
    return "bf16" if args.bf16 else "fp16" if args.fp16 else "tf32" if args.tf32 else "fp32"


def tokens_per_step(args, seq_len: int) -> int:
    """Tokens per optimizer step: blocks per device x `seq_len` x processes x accumulation steps."""
    return args.per_device_train_batch_size * seq_len * args.world_size * args.gradient_accumulation_steps


def planned_steps(args, data: TrainingData) -> int:
    if args.max_steps > 0:
        return args.max_steps
    batches = math.ceil(len(data.train) / (args.per_device_train_batch_size * args.world_size))
    return math.ceil(batches / args.gradient_accumulation_steps) * math.ceil(args.num_train_epochs)


def _count(number: int, noun: str) -> str:
    return f"{number:,} {noun}" if number == 1 else f"{number:,} {noun}{'es' if noun.endswith('s') else 's'}"


def _data_line(source: dict) -> str:
    if source["kind"] == "streamed":
        return f"{source['name']}: streamed from {source['shards']:,} shards, weight {source['weight']:g}"
    line = f"{source['name']}: {source['documents']:,} documents, {source['tokens']:,} tokens"
    line += f" ({source['blocks']:,} blocks)"
    if "share" in source and source["share"] < 1:
        line += f", {100 * source['share']:.1f} % of the blocks"
    if "shard" in source:
        line += f"; only {part_note(source['shard'])}"
    return line


def training_plan(model: torch.nn.Module, args, data: TrainingData, tasks: Sequence[Task] = (), tokenizer=None) -> str:
    """The start-of-run block (with `tasks`, what scoring them costs, their requests tokenised by `tokenizer`)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # LoRA: its base model
    config, total, scales = base.config, sum(p.numel() for p in base.parameters()), base.num_scale_parameters()
    n = non_embedding_parameters(config)  # the study's N
    per_step, steps = tokens_per_step(args, data.seq_len), planned_steps(args, data)
    tokens = steps * per_step
    kind = f"MoE, {config.num_experts} experts, top-{config.num_experts_per_tok}" if config.num_experts else "dense"
    strategy = f"{config.scale_preset} ({config.norm_scale} / {config.linear_scale} / {config.scale_param})"
    lines = [
        f"model        ScaleVec {strategy}, {kind}: {total:,} parameters, N = {n:,} non-embedding "
        f"(no embedding, LM head or scale vector), {scales:,} in scale vectors ({100 * scales / total:.2f} %)",
        f"batch        {_count(args.per_device_train_batch_size, 'block')} × {data.seq_len} tokens × "
        f"{_count(args.world_size, 'process')} × {_count(args.gradient_accumulation_steps, 'accumulation step')} = "
        f"{per_step:,} tokens per optimizer step",
        f"length       {steps:,} steps = {tokens:,} tokens = {tokens / total:.2f} tokens per parameter "
        f"({tokens / n:.2f} per non-embedding parameter N; Chinchilla's compute-optimal ratio, about "
        "20, counts all parameters)",
    ]
    lines += [f"data         {_data_line(source)}" for source in data.record["sources"]]
    lines.append(f"held out     {_evaluation_line(args, data, tokens)}")
    if tasks:
        fed = fed_tokens(tokenizer, list(tasks), model, args.eval_batch_size, args.world_size)
        lines.append(f"tasks        {_tasks_line(tasks, fed, evaluations_planned(args, steps), tokens)}")
    saving = "none (--save-strategy no)" if args.save_strategy == "no" else _checkpoint_cadence(args)
    lines.append(f"checkpoints  {saving}")
    peak = training_peak_flops(args)
    mfu = (
        f"MFU against {peak / 1e12:g} TFLOP/s per device" if peak else "no MFU (no known peak: --peak-flops sets one)"
    )
    lines.append(f"logging      every {args.logging_steps:g} steps: loss, learning rate, tokens/s, {mfu}, peak memory")
    lines.append(f"device       {hardware(args)}, {_precision(args)}")
    lines.append(f"output       {args.output_dir}")
    return "\n".join(["== scalevec-train: the plan ==", *lines])


def evaluations_planned(args, steps: int) -> int:
    """Evaluations in a run of `steps` steps: every `--eval-steps` (a fraction: of all steps), and one at the end."""
    if args.eval_strategy != "steps":
        return 1 if args.eval_strategy == "no" else math.ceil(args.num_train_epochs)
    every = math.ceil(args.eval_steps * steps) if args.eval_steps < 1 else int(args.eval_steps)
    return steps // every + (steps % every != 0)


def _evaluation_line(args, data: TrainingData, train_tokens: int) -> str:
    held_out = EvaluationRecord.read(data.record)
    if held_out is None or data.eval is None:
        return "nothing: no evaluation"
    evaluated, count = held_out.evaluated_tokens, evaluations_planned(args, planned_steps(args, data))
    subset = "all of it" if evaluated == held_out.blocks * data.seq_len else "a fixed subset"
    counts = ", ".join(f"{held.name} {held.evaluated_blocks:,}" for held in held_out.sets)
    per_set = f" ({counts})" if len(held_out.sets) > 1 else ""
    when = f"{_count(count, 'time')}: every {args.eval_steps:g} steps and at the end" if count > 1 else "at the end"
    # A forward pass costs about a third of a training step's forward and backward.
    share = 100 * count * evaluated / (3 * train_tokens)
    return (
        f"{held_out.name}: {held_out.tokens:,} tokens ({held_out.blocks:,} blocks); each evaluation reads "
        f"{evaluated:,} tokens ({held_out.evaluated_blocks:,} blocks{per_set}, {subset}; --max-eval-tokens) and "
        f"predicts {evaluated - held_out.evaluated_blocks:,} of them (all but each block's first), {when}, about "
        f"{share:.2g} % of the training compute"
    )


def _tasks_line(tasks: Sequence[Task], tokens: int, evaluations: int, train_tokens: int) -> str:
    """The tasks each evaluation scores, and their share of the training compute (the `tokens` each one feeds)."""
    names = ", ".join(f"{task.name} {len(task.items):,} of {task.available:,} items" for task in tasks)
    share = 100 * evaluations * tokens / (3 * train_tokens)
    return (
        f"{names} (--task-examples); each evaluation feeds {tokens:,} tokens (each item's context once, with its "
        f"choices), about {share:.2g} % of the training compute"
    )


def _checkpoint_cadence(args) -> str:
    every = f"every {args.save_steps:g} steps" if args.save_strategy == "steps" else f"every {args.save_strategy}"
    kept = f" (the newest {args.save_total_limit} kept)" if args.save_total_limit else ""
    return f"{every}{kept}, into {args.output_dir}/checkpoint-N; rerun with --resume after a stop"


class PaceCallback(TrainerCallback):
    """Prints, at the second training log, how long the rest of the run takes at the pace of the steps between the
    first two logs (the first log's steps, slower while the run warms up, left out; an evaluation or save between
    them starts the count again): the plan's estimate of the run's time, measured on its own hardware."""

    def __init__(self):
        self._first: tuple[float, int] | None = None  # (clock, step) at the training log the pace is taken from
        self._done = False

    def on_evaluate(self, args, state, control, **kwargs):
        self._first = None

    def on_save(self, args, state, control, **kwargs):
        self._first = None

    def on_log(self, args, state, control, logs=None, **kwargs):
        if self._done or logs is None or "loss" not in logs:
            return
        now = time.perf_counter()
        if self._first is None:
            self._first = (now, state.global_step)
            return
        self._done = True
        print(pace(now - self._first[0], self._first[1], state.global_step, state.max_steps), flush=True)


def pace(seconds: float, since: int, step: int, steps: int) -> str:
    """The line that estimates the rest of a run of `steps` steps from the `seconds` that steps `since` to `step`
    took."""
    per_step, left = seconds / max(step - since, 1), max(steps - step, 0)
    return (
        f"pace         steps {since + 1:,} to {step:,} took {duration_text(seconds)}: the {left:,} steps left take "
        f"about {duration_text(left * per_step)} more at that pace (evaluations and saves come on top)"
    )


def summary(trainer, metrics: dict, seq_len: int) -> dict:
    """The end-of-run figures, of the whole run however often it was resumed: steps, tokens, the last logged and
    the mean training loss, wall time, throughput and MFU (of `seq_len`-token blocks) over the training time, and
    the evaluation."""
    args, state = trainer.args, trainer.state
    run = whole_run(vars(state))
    losses = logged_entries(state.log_history, "loss")
    clock = run.clock
    figures = {
        "hardware": hardware(args),
        "precision": _precision(args),
        "steps": run.steps,
        "tokens_seen": run.tokens,
        "final_train_loss": losses[-1]["loss"] if losses else None,
        "final_train_loss_step": losses[-1]["step"] if losses else None,
        "mean_train_loss": run.mean_loss,  # over the logged steps of every segment (`mean_train_loss_steps`)
        "mean_train_loss_steps": run.mean_loss_steps,
        "segment_starts": clock.segment_starts if clock else None,  # [0]: never resumed
        "wall_seconds": clock.wall_seconds if clock else None,  # of all segments (None: not recorded)
        "training_seconds": clock.training_seconds if clock else None,  # the same less evaluations and saves
        "tokens_per_second": run.tokens_per_second,  # over the training seconds
        "eval": {key: value for key, value in metrics.items() if key.startswith("eval_")},
        "output_dir": str(args.output_dir),
    }
    if run.tokens_per_second is not None:
        model = getattr(trainer.model, "module", trainer.model)
        flops = model_flops_per_token(model.config, seq_len)
        throughput = throughput_figures(args, clock.training_seconds, run.tokens, flops, training_peak_flops(args))
        if "mfu_percent" in throughput:
            figures["mfu_percent"] = throughput["mfu_percent"]
    return figures


def _evaluation_lines(evaluation: dict) -> list[str]:
    """The held-out figures: over all sets, then each set of a per-set evaluation (`eval_<name>_loss`)."""
    if "eval_loss" not in evaluation:
        return ["eval         none (no held-out data)"]
    names = [key[5:-5] for key in evaluation if key.endswith("_loss") and key != "eval_loss"]
    names = [name for name in names if name not in EVALUATION_HALVES]  # halves of the blocks, not sets
    lines = []
    for label, prefix in [("eval        ", "eval"), *((f"  {name:<10}", f"eval_{name}") for name in names)]:
        parts = [f"loss {evaluation[f'{prefix}_loss']:.4f} nats per token"]
        if f"{prefix}_perplexity" in evaluation:
            parts.append(f"perplexity {evaluation[f'{prefix}_perplexity']:.1f}")
        if f"{prefix}_bits_per_byte" in evaluation:
            parts.append(f"{evaluation[f'{prefix}_bits_per_byte']:.3f} bits per byte")
        if f"{prefix}_tokens" in evaluation:
            parts.append(f"{evaluation[f'{prefix}_tokens']:,} tokens predicted")
        lines.append(f"{label} {', '.join(parts)}")
    if "eval_runtime" in evaluation:
        lines[0] += f" in {duration_text(evaluation['eval_runtime'])}"
    return lines + _task_lines(evaluation)


def _task_lines(evaluation: dict) -> list[str]:
    """Each multiple-choice task's scores, then their mean over the tasks."""
    lines = []
    for name, score in TaskScores.from_metrics(evaluation).rows():
        items = " (mean)" if score.items is None else f", {score.items:,} items"
        lines.append(
            f"  {name:<10} acc {score.acc:.4f}, acc_norm {score.acc_norm:.4f}, {score.bpb:.3f} bits per byte{items}"
        )
    return lines


def describe_summary(figures: dict, written: list[str]) -> str:
    """The end-of-run block."""
    lines = ["== scalevec-train: done =="]
    trained = f"trained      {figures['steps']:,} steps, {figures['tokens_seen']:,} tokens"
    if figures["wall_seconds"] is None:
        lines.append(f"{trained}; time unknown (resumed from a checkpoint that did not record it)")
    else:
        speed = f"{figures['tokens_per_second']:,.0f} tokens/s" if figures["tokens_per_second"] else "speed unknown"
        mfu = f", MFU {figures['mfu_percent']:.1f} %" if "mfu_percent" in figures else ""
        lines.append(
            f"{trained} in {duration_text(figures['wall_seconds'])}{segments_text(figures['segment_starts'])} on "
            f"{figures['hardware']} ({figures['precision']}): {speed}{mfu}"
        )
    if figures["final_train_loss"] is not None:
        covered = loss_coverage(figures["mean_train_loss_steps"], figures["steps"])
        lines.append(
            f"train loss   {figures['final_train_loss']:.4f} at step {figures['final_train_loss_step']} (the last "
            f"logged; the mean over {covered} was {figures['mean_train_loss']:.4f})"
        )
    lines += _evaluation_lines(figures["eval"])
    lines.append(f"written to   {figures['output_dir']}: {', '.join(written)}")
    return "\n".join(lines)
