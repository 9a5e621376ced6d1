"""Fold, export, import, verify and inspect ScaleVec and stock checkpoints (`scalevec-convert`).

Exit status: 0 on success, 1 when a conversion is refused or fails (nothing is written then) or when `verify`
finds a difference beyond the bound, 2 for wrong usage, 130 when interrupted.
"""

import argparse
import ctypes
import json
import logging
import signal
import sys
from collections.abc import Sequence

from transformers.utils import logging as transformers_logging

from ..atomic import describe_os_error
from ..configuration_scalevec import SCALE_FIELDS, SCALE_PRESETS
from .card import card_writer
from .errors import ConversionError
from .formats import TARGETS
from .inspection import format_summary, inspect_checkpoint
from .pipeline import (
    DEFAULT_MAX_SHARD_SIZE,
    OUTPUT_DTYPES,
    ConversionResult,
    OutputOptions,
    Strategy,
    export_checkpoint,
    import_checkpoint,
)
from .push import PushError, add_push_arguments, push_folder, run_push
from .task_results import read_task_results
from .verify import compare_checkpoints

VERIFY_HELP = (
    "after writing, run the source and the output on fixed random tokens (float32) and fail if the logits differ "
    "by more than the bound; each model runs with one layer's weights in memory at a time"
)


def add_output_options(parser: argparse.ArgumentParser) -> None:
    """The options of every command that writes a checkpoint."""
    parser.add_argument("source", metavar="SRC", help="checkpoint folder to read")
    parser.add_argument("destination", metavar="DST", help="folder to create (written beside it, then renamed)")
    parser.add_argument(
        "--dtype", choices=OUTPUT_DTYPES, help="dtype of the written tensors (default: the source's); folding is fp32"
    )
    parser.add_argument(
        "--max-shard-size",
        default=DEFAULT_MAX_SHARD_SIZE,
        help=f"largest output file, e.g. 500MB (default {DEFAULT_MAX_SHARD_SIZE}); memory does not depend on it",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace DST if it exists (atomically)")
    parser.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="convert tensors that hold NaN or Inf as they are, with a warning (by default they are refused)",
    )
    parser.add_argument(
        "--no-verify", dest="verify", action="store_false", help="skip the verification: " + VERIFY_HELP
    )
    add_atol(parser)


def add_publishing_options(parser: argparse.ArgumentParser) -> None:
    """The options of the commands that write a publishable checkpoint (fold, export)."""
    parser.add_argument(
        "--no-model-card",
        dest="model_card",
        action="store_false",
        help="do not write README.md (by default a model card from the run's records in SRC, when there are any)",
    )
    parser.add_argument(
        "--model-name", help="the model card's title (default: the --push-to-hub repository, else the model's kind)"
    )
    parser.add_argument(
        "--push-to-hub", metavar="REPO_ID", help="after writing DST, upload it to this Hub repository (owner/name)"
    )
    parser.add_argument("--private", action="store_true", help="with --push-to-hub: create the repository private")
    parser.add_argument("--revision", help="with --push-to-hub: branch to push to (default main)")
    parser.add_argument(
        "--eval-results",
        metavar="FILE",
        type=_task_results,
        help="a `scalevec-eval --output` results file: the card gets its task table and quantization differences, "
        "and DST the Hub's .eval_results/ files",
    )


def _task_results(path: str) -> dict:
    try:
        return read_task_results(path)
    except ValueError as error:  # argparse keeps the message of this error only
        raise argparse.ArgumentTypeError(str(error)) from None


def add_atol(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--atol",
        type=float,
        help="bound on the max abs logit difference (default 1e-4 for float32 weights, "
        "1e-4 + 8 eps max|logits| for bfloat16/float16 weights)",
    )


def output_options(args: argparse.Namespace) -> OutputOptions:
    writes_card = getattr(args, "model_card", False)
    card = card_writer(args.source, args.push_to_hub, args.model_name, args.eval_results) if writes_card else None
    return OutputOptions(
        dtype=args.dtype,
        max_shard_size=args.max_shard_size,
        overwrite=args.overwrite,
        verify=args.verify,
        atol=args.atol,
        before_commit=card,
        allow_nonfinite=args.allow_nonfinite,
    )


def print_result(result: ConversionResult) -> None:
    megabytes = result.total_bytes / 2**20
    print(f"wrote {result.destination} ({result.target}, {result.num_tensors} tensors, {megabytes:.1f} MiB)")
    print("files: " + ", ".join(result.files))
    print("verification: " + ("skipped" if result.verification is None else result.verification.describe()))


def run_export(args: argparse.Namespace) -> int:
    result = export_checkpoint(args.source, args.destination, args.to, output_options(args))
    print_result(result)
    if args.push_to_hub is None:
        return 0
    try:
        pushed = push_folder(result.destination, args.push_to_hub, private=args.private, revision=args.revision)
    except PushError as error:
        print(f"scalevec-convert: error: {error}\n{result.destination} was written and is kept.", file=sys.stderr)
        return 1
    print(f"pushed to {pushed.repo_id} at revision {pushed.revision}: {pushed.commit_url}")
    return 0


def run_import(args: argparse.Namespace) -> int:
    strategy = Strategy(args.preset, **{name: getattr(args, name) for name in SCALE_FIELDS})
    print_result(import_checkpoint(args.source, args.destination, strategy, output_options(args)))
    return 0


def run_verify(args: argparse.Namespace) -> int:
    comparison = compare_checkpoints(args.reference, args.candidate, args.atol)
    print(comparison.describe())
    return 0 if comparison.passed else 1


def run_inspect(args: argparse.Namespace) -> int:
    summary = inspect_checkpoint(args.source)
    print(json.dumps(summary, indent=2) if args.json else format_summary(summary))
    return 0


def build_parser() -> argparse.ArgumentParser:
    summary, exit_status = __doc__.split("\n\n")[:2]
    parser = argparse.ArgumentParser(prog="scalevec-convert", description=summary, epilog=exit_status)
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-q", "--quiet", action="store_true", help="print only results, warnings and errors")

    fold = commands.add_parser(
        "fold",
        parents=[common],
        help="folded ScaleVec checkpoint with its remote code",
        description="Fold every scale vector into the weights (folded=True, the inference form) and write a "
        "ScaleVec checkpoint with configuration_scalevec.py, modeling_scalevec.py and auto_map: it loads with "
        "trust_remote_code=True where scalevec is not installed.",
    )
    add_output_options(fold)
    add_publishing_options(fold)
    fold.set_defaults(run=run_export, to="scalevec")

    export = commands.add_parser(
        "export",
        parents=[common],
        help="fold, then write a target format",
        description="Fold, then write the target format: "
        "scalevec (remote code; always possible) or a stock architecture that transformers loads with no custom "
        "code (llama, qwen3, mixtral, qwen3_moe), when it can express the model.",
    )
    add_output_options(export)
    add_publishing_options(export)
    export.add_argument("--to", required=True, choices=TARGETS, help="output format")
    export.set_defaults(run=run_export)

    imported = commands.add_parser(
        "import",
        parents=[common],
        help="stock checkpoint -> ScaleVec for continued pretraining",
        description="Read a stock "
        "llama / qwen3 / mixtral / qwen3_moe checkpoint as a ScaleVec model of the chosen strategy; the scales are "
        "initialised so that the function is unchanged (norm weights become the strategy's scales, the rest ones).",
    )
    add_output_options(imported)
    imported.add_argument(
        "--preset", default="unified", choices=SCALE_PRESETS, help="strategy preset (default unified)"
    )
    for name, choices in SCALE_FIELDS.items():
        imported.add_argument(f"--{name.replace('_', '-')}", choices=choices, help=f"override the preset's {name}")
    imported.set_defaults(run=run_import)

    verify = commands.add_parser(
        "verify",
        parents=[common],
        help="compare the logits of two checkpoints",
        description="Run two checkpoints (any supported "
        "formats) on the same fixed random tokens in float32; print the max abs / relative logit difference and "
        "exit with status 1 beyond the bound.",
    )
    verify.add_argument("reference", metavar="A")
    verify.add_argument("candidate", metavar="B")
    add_atol(verify)
    verify.set_defaults(run=run_verify)

    inspect = commands.add_parser(
        "inspect",
        parents=[common],
        help="config, strategy, parameter counts, scale statistics",
        description="Summarise a checkpoint, after checking its tensors against its config as a conversion does: "
        "format and architecture, scale-vector strategy, parameter counts, the tensors that hold NaN or Inf, and "
        "per scale-vector site (all layers and experts together) the mean, std, min and max of the scale values.",
    )
    inspect.add_argument("source", metavar="SRC")
    inspect.add_argument("--json", action="store_true", help="print the summary as JSON")
    inspect.set_defaults(run=run_inspect)

    push = commands.add_parser(
        "push",
        parents=[common],
        help="upload a checkpoint folder to the Hub",
        description="Upload DIR as it is to the Hub repository REPO_ID (created if missing) in one commit. The "
        "token comes from HF_TOKEN or `hf auth login`, never from the command line, and is never printed.",
    )
    add_push_arguments(push).set_defaults(run=run_push)
    return parser


def _reuse_freed_memory() -> None:
    """Keep freed memory in the heap. Each unit's tensors are freed once written, and glibc hands large blocks
    straight back to the OS, so the next unit would fault in fresh zeroed pages: keeping them makes a conversion
    about 25% faster, and the peak resident memory is the same. A no-op where libc is not glibc."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3  # from glibc's malloc.h
    libc.mallopt(m_mmap_threshold, 32 << 20)  # glibc's largest allowed value
    libc.mallopt(m_trim_threshold, 1 << 30)


def _terminate(signum, frame):
    raise SystemExit(128 + signum)  # unwinds like an exception, so the staged output is cleaned up


class _Interrupts:
    """Ctrl-C as KeyboardInterrupt, remembered: raised inside a native reader (safetensors) it comes back as an
    unrelated error, which must still read as an interruption."""

    received = False

    @classmethod
    def handle(cls, signum, frame):
        cls.received = True
        raise KeyboardInterrupt


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING if args.quiet else logging.INFO, format="%(message)s")
    transformers_logging.disable_progress_bar()
    signal.signal(signal.SIGTERM, _terminate)
    signal.signal(signal.SIGINT, _Interrupts.handle)
    _reuse_freed_memory()
    try:
        return args.run(args)
    except (KeyboardInterrupt, Exception) as error:
        if _Interrupts.received:
            print("scalevec-convert: interrupted; nothing was written", file=sys.stderr)
            return 130
        if isinstance(error, ConversionError):
            print(f"scalevec-convert: error: {error}", file=sys.stderr)
            return 1
        if isinstance(error, OSError):  # a folder the user cannot read, say
            print(f"scalevec-convert: error: {describe_os_error(error)}", file=sys.stderr)
            return 1
        raise


if __name__ == "__main__":
    sys.exit(main())
