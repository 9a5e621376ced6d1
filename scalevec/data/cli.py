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
from dataclasses import asdict
from pathlib import Path

from ..atomic import exit_status
from .build import DEFAULT_EVAL_EVERY, DEFAULT_SEQ_LEN, DataArguments, load_tokenizer
from .checks import problems
from .preparation import combine, prepare
from .prepared import PreparedMetadata, PrepareOptions
from .sources import DataError, find_source


def _prepare(args: argparse.Namespace) -> None:
    # DataArguments checks the values as scalevec-train does, and finds the tokenizer as it does.
    data = DataArguments(
        dataset=",".join(args.sources),
        tokenizer=args.tokenizer,
        seq_len=args.seq_len,
        text_column=args.text_column,
        dataset_config=args.dataset_config,
        eval_every=args.eval_every,
        max_eval_documents=args.max_eval_documents,
        max_documents=args.max_documents,
        num_proc=args.num_proc,
    )
    tokenizer = load_tokenizer(data)
    sources = [find_source(name, args.text_column, args.dataset_config) for name in data.entries()]
    options = PrepareOptions(args.seq_len, args.eval_every, args.max_eval_documents, args.max_documents)
    metadata = prepare(
        sources, tokenizer, options, args.output, args.num_proc, progress=not args.quiet, shard=args.shard
    )
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


def _shard(text: str) -> tuple[int, int]:
    index, _, count = text.partition("/")
    if not (index.isdigit() and count.isdigit() and int(index) < int(count)):
        raise argparse.ArgumentTypeError(f"{text!r} is not i/n with 0 <= i < n (part i of n, e.g. 0/4)")
    return int(index), int(count)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="scalevec-data", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="tokenise and pack sources into a prepared folder")
    prep.add_argument("sources", nargs="+", help="text/jsonl/json/parquet files or folders, or Hub dataset ids")
    prep.add_argument("--output", required=True, help="the prepared folder to create (must not exist)")
    prep.add_argument("--tokenizer", help="tokenizer folder or Hub id (default: the embedded BPE)")
    prep.add_argument("--seq-len", type=int, default=DEFAULT_SEQ_LEN, help=f"default {DEFAULT_SEQ_LEN}")
    prep.add_argument("--text-column", default="text")
    prep.add_argument("--dataset-config", help="configuration name of a Hub dataset")
    prep.add_argument("--eval-every", type=int, default=DEFAULT_EVAL_EVERY, help="hold out every n-th document")
    prep.add_argument("--max-eval-documents", type=int, default=2000)
    prep.add_argument("--max-documents", type=int)
    prep.add_argument("--num-proc", type=int, default=1, help="tokenising processes (default 1, on every core)")
    prep.add_argument(
        "--shard", type=_shard, help="i/n: prepare part i of n (a range of the files), for `combine` to join"
    )
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
