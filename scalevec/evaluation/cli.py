"""`scalevec-eval`: score any checkpoint or export on multiple-choice tasks and on held-out text, as the training
loop's evaluation does (`task_scoring.py`, `held_out.py`).

scalevec-eval MODEL --tasks hellaswag,my_task.jsonl [--eval-dataset held_out.jsonl] [--output results.json]
torchrun --nproc_per_node 2 -m scalevec.evaluation.cli MODEL ...   # items and blocks split across the processes
scalevec-eval --export-task hellaswag hellaswag.jsonl        # where the Hub is reachable: the file to pass offline

MODEL is a folder (or Hub id) that `AutoModelForCausalLM` and `AutoTokenizer` load: a ScaleVec run or checkpoint,
its Llama / Qwen3 exports, a stock model. The results are printed as a table and, with `--output`, written as JSON:
{"model": ..., "tasks": {name: {"acc", "acc_norm", "bpb", "items"}}, "held_out": {"loss", "perplexity",
"bits_per_byte", "tokens"} or null}. With `--quantize int8,int4`, the model is scored again with each scheme's
weight-only quantization (`quantization.py`), on the same items and blocks, and the results add
"quantized": {scheme: {"tasks", "held_out", "seconds"}} and "differences": {scheme: quantized minus unquantized}.
"""

import argparse
import dataclasses
import os
import sys
import tempfile
import typing
from dataclasses import replace
from pathlib import Path

import torch
from transformers.utils import ADAPTER_CONFIG_NAME, CONFIG_NAME

from ..atomic import exit_status, write_text_atomically, writes_into
from ..convert.checkpoint import WEIGHT_FILES, WEIGHT_INDEXES
from ..data.build import DEFAULT_SEQ_LEN, DataArguments, build_held_out_data
from ..data.sources import check_hub_repo, names_a_local_path
from .model import EvaluationResult, evaluate_model
from .quantization import parse_schemes, quantize_weights, require_torchao
from .task_scoring import check_requests, model_length
from .tasks import BUILTIN_TASKS, load_tasks, parse_task_list, task_file_text


def results_table(result: EvaluationResult) -> str:
    """The results as a table."""
    lines = [
        f"== scalevec-eval: {result.model} ==",
        f"{'task':<20} {'items':>7} {'acc':>8} {'acc_norm':>9} {'bpb':>8}",
    ]
    for name, score in result.tasks.items():
        lines.append(
            f"{name:<20} {score['items']:>7,} {score['acc']:>8.4f} {score['acc_norm']:>9.4f} {score['bpb']:>8.4f}"
        )
    if (held := result.held_out) is not None:
        bits = f", {held['bits_per_byte']:.4f} bits per byte" if "bits_per_byte" in held else ""
        lines.append(
            f"held out: loss {held['loss']:.4f} nats per token, perplexity {held['perplexity']:.2f}{bits}, "
            f"{held['tokens']:,} tokens"
        )
    lines.append(f"in {result.seconds:.1f} s")
    for scheme, differences in result.differences().items():
        lines += ["", results_table(result.quantized[scheme])]
        changes = [f"held-out loss {d:+.4f}" for d in [differences["held_out"].get("loss")] if d is not None]
        changes += [f"{task} acc {d['acc']:+.4f}, bpb {d['bpb']:+.4f}" for task, d in differences["tasks"].items()]
        lines.append(f"{scheme} minus unquantized: {'; '.join(changes) or '-'}")
    return "\n".join(lines)


# The data flags, DataArguments' fields: each one's flag here, and its help where the training's would mislead.
_DATA_FLAGS = {
    "eval_tasks": ("--tasks", f"Comma-separated built-in names ({', '.join(BUILTIN_TASKS)}) or jsonl files."),
    "task_examples": ("--task-examples", None),
    "eval_dataset": ("--eval-dataset", "Held-out text (files, folders, prepared folders) for the loss."),
    "max_eval_tokens": ("--max-eval-tokens", None),
    "seq_len": ("--seq-len", f"Held-out block length. Default: {DEFAULT_SEQ_LEN}, or the model's if shorter."),
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scalevec-eval", description=__doc__.split("\n\n")[0])
    parser.add_argument("model", nargs="?", help="model folder or Hub id (AutoModelForCausalLM, AutoTokenizer)")
    hints = typing.get_type_hints(DataArguments)
    for field in dataclasses.fields(DataArguments):  # their types, defaults and checks are the training's
        if field.name in _DATA_FLAGS:
            flag, own_help = _DATA_FLAGS[field.name]
            kind = int if int in (hints[field.name], *typing.get_args(hints[field.name])) else str
            help_text = own_help or field.metadata["help"]
            metavar = flag.removeprefix("--").replace("-", "_").upper()
            parser.add_argument(
                flag, dest=field.name, metavar=metavar, type=kind, default=field.default, help=help_text
            )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=8,
        help="held-out blocks per forward; for tasks, the tokens of this many of the longest requests (context and "
        "choice) per forward, padding included, as lm-eval's batch of requests takes",
    )
    parser.add_argument(
        "--quantize",
        help="comma-separated weight-only schemes (int8, int4): score the model again with each, beside the "
        "unquantized scores (needs torchao: pip install 'scalevec[quantize]')",
    )
    parser.add_argument("--output", help="write the results here as JSON")
    parser.add_argument("--export-task", nargs=2, metavar=("NAME", "FILE"), help="write a built-in task as jsonl")
    return parser


def _run(args: argparse.Namespace) -> None:
    if args.export_task:
        return _export_task(*args.export_task)
    if not args.model or not (args.eval_tasks or args.eval_dataset):
        raise ValueError("give a MODEL and --tasks and/or --eval-dataset (or --export-task NAME FILE)")
    data_args = DataArguments(**{name: getattr(args, name) for name in _DATA_FLAGS}, eval_every=0)  # checked
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be at least 1; got {args.batch_size}")
    schemes = parse_schemes(args.quantize) if args.quantize else []
    if schemes:
        require_torchao()  # before the unquantized scoring, which would otherwise be discarded
    if args.output:
        _check_output(args.output)
    cache_only = check_model_source("model", args.model)
    rank, world_size, device = _distributed()
    tasks = load_tasks(parse_task_list(args.eval_tasks), args.task_examples) if args.eval_tasks else []
    tokenizer, model = _load(args.model, device, cache_only)
    check_requests(tokenizer, tasks, model_length(model))
    held_out = _held_out(data_args, tokenizer, model, rank) if args.eval_dataset else None

    def score(model: torch.nn.Module, name: str) -> EvaluationResult:
        return evaluate_model(
            model, tokenizer, tasks, held_out, name=name, batch_size=args.batch_size, rank=rank, world_size=world_size
        )

    result = score(model, args.model)
    for scheme in schemes:  # each from the unquantized weights, loaded again: quantizing is in place
        quantized = quantize_weights(_load(args.model, device, cache_only)[1], scheme)
        result.quantized[scheme] = score(quantized, f"{args.model} ({scheme} weights)")
    if rank == 0:
        print(results_table(result), flush=True)
        if args.output:
            with writes_into(Path(args.output).parent, named=args.output):
                write_text_atomically(args.output, result.to_json())


def _distributed() -> tuple[int, int, torch.device]:
    """(rank, world size, device): under torchrun, a process group (gloo without an accelerator)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if world_size > 1 and not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo" if accelerator is None else None)
    rank = torch.distributed.get_rank() if world_size > 1 else 0
    if accelerator is None:
        return rank, world_size, torch.device("cpu")
    return rank, world_size, torch.device(accelerator.type, int(os.environ.get("LOCAL_RANK", "0")))


def _load(name: str, device: torch.device, cache_only: bool):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name, local_files_only=cache_only)
    model = AutoModelForCausalLM.from_pretrained(name, dtype=torch.float32, local_files_only=cache_only)
    return tokenizer, model.to(device)


def _check_output(path: str) -> None:
    """`--output` can be written: checked before the scoring, which may take hours, by creating a file where it
    goes (in the nearest folder there is, as the writing creates the missing ones)."""
    target = Path(path).absolute()
    if target.is_dir():
        raise ValueError(f"--output {path}: a folder; give the name of the file to write")
    folder = next(parent for parent in target.parents if parent.exists())
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        raise OSError(error.errno, error.strerror, path) from None


def check_model_source(option: str, name: str) -> bool:
    """`name` (for `option`) is a folder holding a model (its config and weights, or a PEFT adapter's), or a Hub
    repository that is there (looked up once: `check_hub_repo`); True where the Hub cannot be reached but its local
    cache holds it, so that only the cache is read. Anything else is refused in one line naming the cause."""
    path = Path(name).expanduser()
    if path.is_dir():
        if (path / ADAPTER_CONFIG_NAME).is_file():
            return False
        if not (path / CONFIG_NAME).is_file():
            raise ValueError(
                f"{option} {name}: this folder holds no model (no {CONFIG_NAME} or {ADAPTER_CONFIG_NAME})"
            )
        if not any((path / file).is_file() for file in WEIGHT_INDEXES + WEIGHT_FILES):
            raise ValueError(f"{option} {name}: this folder holds no weights (none of {', '.join(WEIGHT_FILES)})")
        return False
    if path.exists():
        raise ValueError(f"{option} {name}: a file; give the folder that holds the model")
    if names_a_local_path(name):
        raise ValueError(f"{option} {name}: no such folder")
    return not check_hub_repo(option, name)


def _held_out(data_args: DataArguments, tokenizer, model, rank: int) -> dict | None:
    """The `--eval-dataset` blocks, prepared by the first process while the others wait, then read by all."""
    seq_len = data_args.seq_len or min(DEFAULT_SEQ_LEN, model_length(model))
    data_args = replace(data_args, seq_len=seq_len)
    distributed = torch.distributed.is_initialized()
    if distributed and rank != 0:
        torch.distributed.barrier()
    sets, _ = build_held_out_data(data_args, tokenizer, progress=rank == 0)
    if distributed and rank == 0:
        torch.distributed.barrier()
    if sets is None:
        raise ValueError(f"--eval-dataset {data_args.eval_dataset}: no complete block of {seq_len} tokens")
    return sets


def _export_task(name: str, path: str) -> None:
    if name not in BUILTIN_TASKS:
        raise ValueError(f"--export-task {name}: not a built-in task ({', '.join(BUILTIN_TASKS)})")
    (task,) = load_tasks([name], sys.maxsize)
    write_text_atomically(path, task_file_text(task))
    print(f"scalevec-eval: wrote the {len(task.items):,} items of {task.source} to {Path(path)}")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(sys.argv[1:] if argv is None else argv)
    return exit_status("scalevec-eval", lambda: _run(args), (ValueError, ImportError))


if __name__ == "__main__":
    sys.exit(main())
