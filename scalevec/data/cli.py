"""`scalevec-data`: prepare training data once (on a CPU node, say), then train from the folder on many machines.

scalevec-data prepare data/*.jsonl --output prepared/web --tokenizer gpt2 --seq-len 2048 --num-proc 16
scalevec-data info prepared/web
scalevec-train --dataset prepared/web ...     # the folder's tokenizer and sequence length
"""

import argparse
import sys
from dataclasses import asdict
from pathlib import Path

from ..atomic import exit_status
from .build import DEFAULT_EVAL_EVERY, DEFAULT_SEQ_LEN, DataArguments, load_tokenizer
from .prepared import PreparedMetadata, PrepareOptions, prepare
from .sources import find_source


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
    metadata = prepare(sources, tokenizer, options, args.output, args.num_proc, progress=not args.quiet)
    print(f"prepared {args.output}")
    _describe(metadata)


def _describe(metadata: PreparedMetadata) -> None:
    print(f"  tokenizer {metadata.tokenizer_name} ({metadata.tokenizer_fingerprint}), {metadata.vocab_size} tokens")
    print(f"  blocks of {metadata.seq_len} tokens stored as {metadata.dtype}; sources: {', '.join(metadata.sources)}")
    for name, info in metadata.splits.items():
        print(
            f"  {name}: {info.blocks:,} blocks ({info.tokens:,} tokens) from {info.documents:,} documents, "
            f"{info.bytes / max(info.tokens + info.dropped_tokens, 1):.2f} bytes per token, "
            f"{info.empty_documents:,} empty documents skipped"
        )


def _info(args: argparse.Namespace) -> None:
    metadata = PreparedMetadata.read(Path(args.folder))
    print(args.folder)
    _describe(metadata)
    print(f"  options: {asdict(PrepareOptions(**metadata.options))}")


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
    prep.add_argument("--quiet", action="store_true", help="no progress bar")
    prep.set_defaults(run=_prepare)
    info = commands.add_parser("info", help="what a prepared folder holds")
    info.add_argument("folder")
    info.set_defaults(run=_info)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return exit_status("scalevec-data", lambda: args.run(args), (ValueError,))  # DataError is a ValueError


if __name__ == "__main__":
    sys.exit(main())
