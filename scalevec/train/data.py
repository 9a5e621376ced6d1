"""Datasets for pretraining: local files, folders or Hub ids (or the embedded corpus), tokenised with a batched
`map` and packed into fixed-length blocks with an end-of-text token between documents; with document masking, each
block carries position ids that restart at every document, which keep attention inside documents."""

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import datasets
import torch
from transformers import DataCollatorForLanguageModeling, PreTrainedConfig, PreTrainedTokenizerBase
from transformers.utils.generic import is_flash_attention_requested

from .corpus import default_corpus_file

_BUILDERS = {".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}


@dataclass
class DataArguments:
    dataset: str | None = field(
        default=None,
        metadata={"help": "Text/jsonl/parquet file or folder, or a Hub dataset id. Default: the embedded corpus."},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Configuration name of a Hub dataset."})
    text_column: str = field(default="text", metadata={"help": "Column holding the documents."})
    tokenizer: str | None = field(default=None, metadata={"help": "Tokenizer path or id. Default: embedded BPE."})
    seq_len: int = field(default=256, metadata={"help": "Tokens per packed training block."})
    streaming: bool = field(default=False, metadata={"help": "Stream the corpus instead of loading it into memory."})
    eval_every: int = field(default=20, metadata={"help": "Hold out every n-th document for evaluation (0: none)."})
    max_documents: int | None = field(default=None, metadata={"help": "Use only the first n documents."})
    max_eval_documents: int = field(default=2000, metadata={"help": "At most this many held-out documents."})
    shuffle_buffer: int = field(default=10_000, metadata={"help": "Shuffle buffer (in blocks) when streaming."})
    num_proc: int | None = field(default=None, metadata={"help": "Processes for tokenisation (non-streaming)."})
    document_masking: bool = field(
        default=False,
        metadata={
            "help": "Attention never crosses a document boundary in a packed block (train and eval): position ids "
            "restart at every document, with no attention mask (transformers' padding-free path)."
        },
    )


@dataclass
class PackedData:
    train: datasets.Dataset | datasets.IterableDataset
    eval: datasets.Dataset | None
    bytes_per_token: float | None  # of the held-out text, for bits per byte


def _data_files(path: Path) -> tuple[str, list[str]]:
    files = sorted(p for p in path.rglob("*") if p.suffix in _BUILDERS) if path.is_dir() else [path]
    if not files:
        raise ValueError(f"--dataset {path}: no .txt, .jsonl, .json or .parquet files in this folder")
    builders = {_BUILDERS.get(p.suffix) for p in files}
    if None in builders or len(builders) > 1:
        raise ValueError(f"--dataset {path}: files must share one of the types {sorted(_BUILDERS)}; got {builders}")
    return builders.pop(), [str(p) for p in files]


def load_documents(args: DataArguments) -> datasets.Dataset | datasets.IterableDataset:
    """The raw documents, with a `text` column only."""
    if args.dataset is None:
        source = ("json", {"data_files": [str(default_corpus_file())]})
    elif Path(args.dataset).exists():
        builder, files = _data_files(Path(args.dataset))
        if all(Path(f).stat().st_size == 0 for f in files):  # `datasets` fails on these with a bare StopIteration
            raise ValueError(f"--dataset {args.dataset}: the dataset is empty")
        source = (builder, {"data_files": files})
    elif args.dataset.startswith((".", "/", "~")) or Path(args.dataset).suffix in _BUILDERS:
        raise ValueError(f"--dataset {args.dataset}: no such file or folder")
    else:
        source = (args.dataset, {"name": args.dataset_config})
    documents = datasets.load_dataset(source[0], **source[1], split="train", streaming=args.streaming)
    column = "text" if args.dataset is None else args.text_column
    columns = documents.column_names
    if columns is None:  # a stream whose features are unknown until read
        first = next(iter(documents), None)
        if first is None:
            raise ValueError(f"--dataset {args.dataset}: the dataset is empty")
        columns = list(first)
    if column not in columns:
        raise ValueError(f"--text-column {column!r} is not a column of {args.dataset}; it has {columns}")
    if args.max_documents is not None:
        documents = documents.take(args.max_documents)
    return documents.select_columns([column]).rename_column(column, "text") if column != "text" else documents


def pack(token_lists: Iterable[list[int]], seq_len: int, eos_token_id: int) -> Iterator[list[int]]:
    """Concatenate documents, each followed by EOS, and cut into `seq_len` blocks; only the last partial block is
    dropped."""
    for block, _ in pack_with_positions(token_lists, seq_len, eos_token_id):
        yield block


def pack_with_positions(
    token_lists: Iterable[list[int]], seq_len: int, eos_token_id: int
) -> Iterator[tuple[list[int], list[int]]]:
    """`pack`'s blocks, each with its tokens' positions in their documents (a document's EOS is its last token).
    Positions restart at 0 where a document starts and at the start of every block, so a document cut by a block
    boundary continues there as a document of its own."""
    tokens: list[int] = []
    positions: list[int] = []
    for document in token_lists:
        tokens.extend(document)
        tokens.append(eos_token_id)
        positions.extend(range(len(document) + 1))
        while len(tokens) >= seq_len:
            yield tokens[:seq_len], _counted_from_block_start(positions[:seq_len])
            del tokens[:seq_len], positions[:seq_len]


def _counted_from_block_start(positions: list[int]) -> list[int]:
    """Positions with the leading rest of a document begun in an earlier block counted from 0."""
    offset = positions[0]
    if offset == 0:
        return positions
    next_document = next((i for i, position in enumerate(positions) if position == 0), len(positions))
    return [position - offset for position in positions[:next_document]] + positions[next_document:]


def _tokenize(documents, tokenizer: PreTrainedTokenizerBase, num_proc: int | None):
    def encode(batch):
        return {
            "input_ids": tokenizer(batch["text"], add_special_tokens=False)["input_ids"],
            "bytes": [len(text.encode("utf-8")) for text in batch["text"]],
        }

    kwargs = {} if isinstance(documents, datasets.IterableDataset) else {"num_proc": num_proc, "desc": "tokenising"}
    return documents.map(encode, batched=True, remove_columns=["text"], **kwargs)


def _blocks(tokenized, seq_len: int, eos_token_id: int, document_masking: bool) -> Iterator[dict]:
    token_lists = (row["input_ids"] for row in tokenized)
    for block, positions in pack_with_positions(token_lists, seq_len, eos_token_id):
        yield {"input_ids": block, "position_ids": positions} if document_masking else {"input_ids": block}


def _split(documents, eval_every: int, held_out: bool):
    def keep(_, index):
        return (index % eval_every == eval_every - 1) == held_out

    return documents.filter(keep, with_indices=True)


def build_datasets(args: DataArguments, tokenizer: PreTrainedTokenizerBase, seed: int) -> PackedData:
    """Packed train (and held-out eval) blocks in a seeded, deterministic order."""
    if args.seq_len < 2:
        raise ValueError(f"--seq-len must be at least 2; got {args.seq_len}")
    documents = load_documents(args)
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError("the tokenizer has no eos_token: packing needs one between documents")
    train_docs = _split(documents, args.eval_every, held_out=False) if args.eval_every else documents
    train_tokens = _tokenize(train_docs, tokenizer, args.num_proc)
    no_block = f"the dataset holds no complete block of --seq-len {args.seq_len} tokens"
    if args.streaming:
        # Read the stream's start once: an empty stream would otherwise stop the Trainer with an unclear message.
        if next(_blocks(train_tokens, args.seq_len, eos, args.document_masking), None) is None:
            raise ValueError(no_block)
        packing = {"seq_len": args.seq_len, "eos_token_id": eos, "document_masking": args.document_masking}
        train = datasets.IterableDataset.from_generator(
            _blocks, gen_kwargs={"tokenized": train_tokens, **packing}
        ).shuffle(seed=seed, buffer_size=args.shuffle_buffer)
    else:
        train = _packed(train_tokens, args.seq_len, eos, args.document_masking)
        if len(train) == 0:
            raise ValueError(no_block)
    eval_set, bytes_per_token = None, None
    if args.eval_every:
        held_out = _split(documents, args.eval_every, held_out=True).take(args.max_eval_documents)
        eval_tokens = _tokenize(held_out, tokenizer, args.num_proc)
        if args.streaming:
            eval_tokens = datasets.Dataset.from_list(list(eval_tokens))
        if len(eval_tokens) == 0:  # nothing held out (and a stream's empty list has not even the columns)
            return PackedData(train, None, None)
        eval_set = _packed(eval_tokens, args.seq_len, eos, args.document_masking)
        token_count = sum(len(ids) + 1 for ids in eval_tokens["input_ids"])
        bytes_per_token = sum(eval_tokens["bytes"]) / token_count if token_count else None
        if len(eval_set) == 0:
            eval_set, bytes_per_token = None, None
    return PackedData(train, eval_set, bytes_per_token)


def _packed(tokenized: datasets.Dataset, seq_len: int, eos_token_id: int, document_masking: bool) -> datasets.Dataset:
    packed = list(pack_with_positions(tokenized["input_ids"], seq_len, eos_token_id))
    columns = {"input_ids": [block for block, _ in packed]}
    if document_masking:
        columns["position_ids"] = [positions for _, positions in packed]
    return datasets.Dataset.from_dict(columns)


@dataclass
class DocumentMaskingCollator:
    """Batches packed blocks with their `position_ids` and no attention mask: transformers' padding-free path, in
    which positions restarting at 0 make the attention block-diagonal, one block per document (the mask is built
    from the position ids by `create_causal_mask` for eager, sdpa and flex attention). Flash attention finds packed
    documents only in a batch of one row, so `flatten` lays the blocks end to end in one row."""

    flatten: bool = False

    def __call__(self, blocks: list[dict]) -> dict[str, torch.Tensor]:
        batch = {key: torch.tensor([block[key] for block in blocks]) for key in ("input_ids", "position_ids")}
        batch["labels"] = batch["input_ids"].clone()
        if self.flatten:
            # In one row a block's last token would learn to predict the next block's first token.
            batch["labels"][:, 0] = -100
            batch = {key: value.reshape(1, -1) for key, value in batch.items()}
        return batch


def language_modeling_collator(
    tokenizer: PreTrainedTokenizerBase, document_masking: bool, model_config: PreTrainedConfig
) -> DataCollatorForLanguageModeling | DocumentMaskingCollator:
    """The collator of `scalevec-train`'s packed blocks, for a model of `model_config`."""
    if document_masking:
        return DocumentMaskingCollator(flatten=is_flash_attention_requested(model_config))
    return DataCollatorForLanguageModeling(tokenizer, mlm=False)
