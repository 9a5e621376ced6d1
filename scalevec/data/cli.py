"""`scalevec-data`: prepare training data once (on a CPU node, say), then train from the folder on many machines.

scalevec-data prepare data/*.jsonl --output prepared/web --tokenizer gpt2 --seq-len 2048 --num-proc 16
scalevec-data info prepared/web
scalevec-train --dataset prepared/web ...     # the folder's tokenizer and sequence length

Split across n machines: `prepare ... --output parts/web-i --shard i/n` on machine i, then
`scalevec-data combine parts/web-* --output prepared/web`.
"""

import argparse
import contextlib
import sys
from dataclasses import asdict, fields
from pathlib import Path
from typing import get_args

from ..atomic import exit_status
from ..shards import parse_shard
from .build import DataArguments, load_tokenizer
from .checks import problems
from .preparation import combine, prepare
from .prepared import PreparedMetadata, PrepareOptions
from .sources import DataError, find_source

# The flags `prepare` shares with scalevec-train: declared once, in DataArguments, with their defaults and help.
PREPARE_FLAGS = (
    "tokenizer",
    "seq_len",
    "text_column",
    "dataset_config",
    "eval_every",
    "max_eval_documents",
    "max_documents",
    "num_proc",
)


def _prepare(args: argparse.Namespace) -> None:
    # DataArguments checks the values as scalevec-train does, and finds the tokenizer as it does.
    data = DataArguments(dataset=",".join(args.sources), **{name: getattr(args, name) for name in PREPARE_FLAGS})
    shard = parse_shard(args.shard) if args.shard is not None else None
    tokenizer = load_tokenizer(data)
    sources = [find_source(name, data.text_column, data.dataset_config) for name in data.entries()]
    options = PrepareOptions(data.resolved_seq_len(), data.held_out_every, data.max_eval_documents, data.max_documents)
    metadata = prepare(sources, tokenizer, options, args.output, data.num_proc, progress=not args.quiet, shard=shard)
    print(f"prepared {args.output}")
    _describe(metadata)


def _combine(args: argparse.Namespace) -> None:
    metadata = combine(args.parts, args.output)
    print(f"combined {len(args.parts)} parts into {args.output}")
    _describe(metadata)


def _describe(metadata: PreparedMetadata) -> None:
    if metadata.shard:
        print(f"  part {metadata.shard[0]} of a preparation in {metadata.shard[1]} parts (--shard)")
    print(f"  tokenizer {metadata.tokenizer_name} ({metadata.tokenizer_fingerprint}), {metadata.vocab_size} tokens")
    print(f"  blocks of {metadata.seq_len} tokens stored as {metadata.dtype}; sources: {', '.join(metadata.sources)}")
    for name, info in metadata.splits.items():
        print(
            f"  {name}: {info.blocks:,} blocks ({info.tokens:,} tokens) from {info.documents:,} documents, "
            f"{info.bytes / max(info.tokens + info.dropped_tokens, 1):.2f} bytes per token, "
            f"{info.empty_documents:,} empty documents skipped"
        )


def _info(args: argparse.Namespace) -> None:
    folder = Path(args.folder)
    found = problems(folder, scan_ids=not args.quick)
    with contextlib.suppress(DataError):  # an unreadable description is the first of `found`
        metadata = PreparedMetadata.read(folder)
        print(args.folder)
        _describe(metadata)
        print(f"  options: {asdict(PrepareOptions(**metadata.options))}")
    if found:  # one line each, the last as the command's error
        for problem in found[:-1]:
            print(f"scalevec-data: error: {problem}", file=sys.stderr)
        raise DataError(found[-1])
    scanned = "(token ids not scanned: --quick)" if args.quick else "token ids below the vocabulary size"
    print(f"  checked: file sizes, {scanned}, held-out digests, tokenizer")


def _add_data_flags(parser: argparse.ArgumentParser, names: tuple[str, ...]) -> None:
    """The `DataArguments` fields `names` as flags, with their types, defaults and help."""
    for spec in fields(DataArguments):
        if spec.name in names:
            kind = next(arg for arg in get_args(spec.type) or (spec.type,) if arg is not type(None))
            flag = f"--{spec.name.replace('_', '-')}"
            parser.add_argument(flag, type=kind, default=spec.default, help=spec.metadata["help"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scalevec-data", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="tokenise and pack sources into a prepared folder")
    prep.add_argument("sources", nargs="+", help="text/jsonl/json/parquet files or folders, or Hub dataset ids")
    prep.add_argument("--output", required=True, help="the prepared folder to create (must not exist)")
    _add_data_flags(prep, PREPARE_FLAGS)
    prep.add_argument("--shard", help="I/N: prepare part I of N (a range of the files), for `combine` to join")
    prep.add_argument("--quiet", action="store_true", help="no progress bar")
    prep.set_defaults(run=_prepare)
    join = commands.add_parser("combine", help="join the parts of a preparation split with --shard")
    join.add_argument("parts", nargs="+", help="the prepared parts, one per --shard i/n")
    join.add_argument("--output", required=True, help="the prepared folder to create (must not exist)")
    join.set_defaults(run=_combine)
    info = commands.add_parser("info", help="what a prepared folder holds, checked")
    info.add_argument("folder")
    info.add_argument("--quick", action="store_true", help="do not scan the token ids")
    info.set_defaults(run=_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return exit_status("scalevec-data", lambda: args.run(args), (ValueError,))  # DataError is a ValueError


if __name__ == "__main__":
    sys.exit(main())
