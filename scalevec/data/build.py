"""`--dataset` and friends: from what a user names to the datasets the Trainer reads.

Each `--dataset` entry is a prepared folder (used as it is), or raw data (files, folders, a Hub dataset id) that is
prepared once into a cache folder keyed by the files, the tokenizer and the options, and reused on every later
start; with `--streaming`, raw data is streamed instead. Several entries make a mixture (`--dataset-weights`).
"""

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

import datasets
import torch
from transformers import AutoTokenizer, PreTrainedTokenizerBase

from ..run_records import EvaluationRecord, HeldOutSetRecord
from .checks import prepared_tokenizer, verify
from .corpus import cache_dir, corpus_name, default_corpus_file, default_tokenizer
from .held_out import (
    DEFAULT_EVAL_TOKENS,
    DEFAULT_TASK_EXAMPLES,
    HeldOutSet,
    evaluation_sets,
    parse_token_budget,
    set_names,
)
from .mixture import WeightedMixture
from .preparation import prepare
from .prepared import (
    DEFAULT_EVAL_EVERY,
    DEFAULT_MAX_EVAL_DOCUMENTS,
    METADATA,
    PreparedBlocks,
    PreparedMetadata,
    PrepareOptions,
    is_prepared,
    load_held_out_digests,
    looks_prepared,
    tokenizer_fingerprint,
)
from .sources import DataError, Source, check_hub_repo, find_source, is_missing_path, names_a_local_path
from .streaming import streamed_blocks

DEFAULT_SEQ_LEN = 256
EMBEDDED_TOKENIZER = "the embedded byte-level BPE"
COMBINE_COMMAND = (
    "scalevec-data combine PART... --output FOLDER"  # joins the parts of a preparation split with --shard
)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")


@dataclass
class DataArguments:
    dataset: str | None = field(
        default=None,
        metadata={
            "help": "Comma-separated training data: prepared folders (scalevec-data prepare), text/jsonl/json/"
            "parquet files or folders (prepared into a cache once), or Hub dataset ids. Default: the embedded "
            "corpus, CPython's pydoc help topics and standard-library docstrings (2.2 MB of text on Python 3.11)."
        },
    )
    dataset_weights: str | None = field(
        default=None,
        metadata={"help": "Comma-separated mixture weights, one per --dataset entry (default: by their sizes)."},
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Configuration name of a Hub dataset."})
    text_column: str = field(default="text", metadata={"help": "Column (or JSON field) holding the documents."})
    eval_dataset: str | None = field(
        default=None, metadata={"help": "Held-out data of its own, instead of documents held out of --dataset."}
    )
    tokenizer: str | None = field(
        default=None,
        metadata={"help": "Tokenizer folder or Hub id. Default: a prepared folder's own, else the embedded BPE."},
    )
    seq_len: int | None = field(
        default=None,
        metadata={"help": f"Tokens per training block. Default: a prepared folder's, else {DEFAULT_SEQ_LEN}."},
    )
    streaming: bool = field(
        default=False, metadata={"help": "Stream raw --dataset sources instead of preparing them (too large)."}
    )
    eval_every: int | None = field(
        default=None,
        metadata={
            "help": f"Hold out every n-th document (default {DEFAULT_EVAL_EVERY}, 0 with --eval-dataset); 0: no "
            "held-out evaluation, also from a prepared folder's held-out split."
        },
    )
    max_documents: int | None = field(default=None, metadata={"help": "Use only the first n documents."})
    max_eval_documents: int = field(
        default=DEFAULT_MAX_EVAL_DOCUMENTS,
        metadata={"help": f"At most this many held-out documents (default {DEFAULT_MAX_EVAL_DOCUMENTS:,})."},
    )
    max_eval_tokens: str = field(
        default=str(DEFAULT_EVAL_TOKENS),
        metadata={
            "help": f"Tokens each evaluation reads (default {DEFAULT_EVAL_TOKENS:,}): a fixed subset of the held-out "
            "blocks, the same at every evaluation; 'all' for the whole held-out data."
        },
    )
    num_proc: int = field(
        default=1,
        metadata={"help": "Processes that tokenise while preparing (one process already runs on every core)."},
    )
    stream_window: int = field(
        default=1000,
        metadata={"help": "--streaming: documents packed together (at most 4 M characters), their blocks reordered."},
    )
    prepared_cache: str | None = field(
        default=None, metadata={"help": "Where raw --dataset data is prepared. Default: $SCALEVEC_CACHE/prepared."}
    )
    document_masking: bool = field(
        default=False,
        metadata={
            "help": "Attention never crosses a document boundary in a packed block (train and eval): position ids "
            "restart after every end-of-text token, with no attention mask (transformers' padding-free path)."
        },
    )
    eval_tasks: str | None = field(
        default=None,
        metadata={
            "help": "Comma-separated multiple-choice tasks scored at every evaluation beside the held-out loss "
            "(eval_<task>_acc, _acc_norm, _bpb): built-in names (hellaswag, arc_easy, arc_challenge, piqa, "
            'winogrande, sciq) or jsonl files of {"context": ..., "choices": [...], "gold": i} lines.'
        },
    )
    task_examples: int = field(
        default=DEFAULT_TASK_EXAMPLES,
        metadata={"help": "Items of each task an evaluation scores: a fixed subset, the same at every evaluation."},
    )

    def __post_init__(self):
        at_least = {"seq_len": 2, "max_documents": 1, "num_proc": 1, "stream_window": 1}
        at_least |= {"eval_every": 0, "max_eval_documents": 0, "task_examples": 1}
        for name, lowest in at_least.items():
            value = getattr(self, name)
            if value is not None and value < lowest:
                raise ValueError(f"--{name.replace('_', '-')} must be at least {lowest}; got {value}")
        for entry in self.eval_entries():
            if is_missing_path(entry):  # found here, or the source would be named as a --dataset
                raise DataError(f"--eval-dataset {entry}: no such file or folder")
        if self.eval_dataset and self.eval_every:
            raise ValueError("--eval-every holds documents out of --dataset; with --eval-dataset it must be 0")
        if self.streaming and self.max_documents is not None:
            raise ValueError("--max-documents applies to prepared data, not to --streaming")
        self.weights()  # checked now, before anything is built
        self.eval_token_budget()

    def entries(self) -> list[str]:
        if self.dataset is None:
            return [str(default_corpus_file())]
        return _split_entries(self.dataset, "--dataset")

    def eval_entries(self) -> list[str]:
        return _split_entries(self.eval_dataset, "--eval-dataset") if self.eval_dataset else []

    def eval_token_budget(self) -> int | None:
        """Tokens each evaluation reads; None: all the held-out data."""
        return parse_token_budget(self.max_eval_tokens)

    def weights(self) -> list[float] | None:
        if self.dataset_weights is None:
            return None
        try:
            weights = [float(weight) for weight in self.dataset_weights.split(",")]
        except ValueError:
            raise ValueError(f"--dataset-weights {self.dataset_weights!r}: not comma-separated numbers") from None
        count = len(self.entries())
        if len(weights) != count:
            raise ValueError(f"--dataset-weights gives {len(weights)} weights for {count} --dataset entries")
        if not all(weight > 0 for weight in weights):
            raise ValueError(f"--dataset-weights must all be positive; got {self.dataset_weights}")
        return weights

    def first_prepared(self) -> PreparedMetadata | None:
        """What the first `--dataset` entry that is a prepared folder holds, if one is."""
        prepared = next((entry for entry in self.entries() if is_prepared(entry)), None)
        return PreparedMetadata.read(Path(prepared)) if prepared else None

    def resolved_seq_len(self) -> int:
        """`--seq-len`; else a prepared `--dataset`'s; else the default."""
        if self.seq_len is not None:
            return self.seq_len
        prepared = self.first_prepared()
        return prepared.seq_len if prepared else DEFAULT_SEQ_LEN

    @property
    def held_out_every(self) -> int:
        if self.eval_every is not None:
            return self.eval_every
        return 0 if self.eval_dataset else DEFAULT_EVAL_EVERY


def _split_entries(text: str, flag: str) -> list[str]:
    """Comma-separated entries, except that a comma inside a path that exists does not separate: the longest run
    of comma-joined parts that names an existing file or folder is one entry."""
    parts, entries = text.split(","), []
    while parts:
        taken = next((n for n in range(len(parts), 1, -1) if _exists(",".join(parts[:n]))), 1)
        entries.append(",".join(parts[:taken]).strip())
        parts = parts[taken:]
    if not all(entries):
        raise ValueError(f"{flag} {text!r}: an empty entry")
    return entries


def _exists(entry: str) -> bool:
    return Path(entry.strip()).expanduser().exists()


@dataclass
class TrainingData:
    train: torch.utils.data.Dataset | datasets.IterableDataset
    eval: torch.utils.data.Dataset | dict[str, torch.utils.data.Dataset] | None  # what each evaluation reads
    seq_len: int
    record: dict  # what the run records about its data (sources, sizes, weights)
    notes: list[str] = field(default_factory=list)  # what the run says about its data at its start
    warnings: list[str] = field(default_factory=list)  # ... and what it warns of


def load_tokenizer(args: DataArguments) -> PreTrainedTokenizerBase:
    """`--tokenizer`; else the tokenizer a prepared `--dataset` was made with; else the embedded one."""
    if args.tokenizer:
        return _named_tokenizer(args.tokenizer)
    prepared = next((entry for entry in args.entries() if is_prepared(entry)), None)
    return prepared_tokenizer(Path(prepared)) if prepared else default_tokenizer()


def _named_tokenizer(name: str) -> PreTrainedTokenizerBase:
    path = Path(name).expanduser()
    if path.is_dir() and not any((path / file).is_file() for file in _TOKENIZER_FILES):
        raise DataError(f"--tokenizer {name}: not a tokenizer folder (none of {', '.join(_TOKENIZER_FILES)})")
    if not path.exists() and names_a_local_path(name):
        raise DataError(f"--tokenizer {name}: no such folder")
    if path.is_file():
        raise DataError(f"--tokenizer {name}: a file; give the folder that holds the tokenizer")
    cache_only = not path.exists() and not check_hub_repo("--tokenizer", name)
    try:
        return AutoTokenizer.from_pretrained(str(path) if path.exists() else name, local_files_only=cache_only)
    except Exception as error:  # transformers raises many types here (OSError, ValueError, ImportError, ...)
        where = "a tokenizer folder" if path.exists() else "a local folder, and it could not be loaded from the Hub"
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise DataError(f"--tokenizer {name}: not {where} ({reason})") from error


def check_vocabulary(tokenizer: PreTrainedTokenizerBase, vocab_size: int) -> None:
    """Every id the tokenizer can produce must have an embedding row."""
    if len(tokenizer) > vocab_size:
        raise ValueError(
            f"the tokenizer {tokenizer.name_or_path} has {len(tokenizer)} tokens but the model's vocab_size is "
            f"{vocab_size}: ids from {vocab_size} on would have no embedding. Use a model with vocab_size >= "
            f"{len(tokenizer)} (--config-overrides '{{\"vocab_size\": {len(tokenizer)}}}') or another tokenizer"
        )


def build_held_out_data(
    args: DataArguments, tokenizer: PreTrainedTokenizerBase, progress: bool = True
) -> tuple[dict | None, dict | None]:
    """The held-out sets of `--eval-dataset` alone, as a training run's evaluation reads them (prepared once, the
    same `--max-eval-tokens` subset), by name, and their record; no sets (None) where they hold no block."""
    if not args.eval_dataset:
        raise ValueError("build_held_out_data reads --eval-dataset; none was given")
    sets, record = _Builder(args, tokenizer, args.resolved_seq_len(), progress)._evaluation([], [], [])
    if sets is not None and not isinstance(sets, dict):
        sets = {record["sets"][0]["name"]: sets}
    return sets, record


def build_training_data(
    args: DataArguments,
    tokenizer: PreTrainedTokenizerBase,
    seed: int,
    rank: int = 0,
    world_size: int = 1,
    progress: bool = True,
) -> TrainingData:
    """The training blocks (prepared, mixed or streamed) and the held-out blocks, as `args` asks."""
    if tokenizer.eos_token_id is None:
        raise DataError("the tokenizer has no eos_token: packing needs one between documents")
    builder = _Builder(args, tokenizer, args.resolved_seq_len(), progress)
    if args.streaming:
        return builder.streamed(args.entries(), seed, rank, world_size)
    return builder.prepared(args.entries())


class _Builder:
    def __init__(self, args: DataArguments, tokenizer: PreTrainedTokenizerBase, seq_len: int, progress: bool):
        self.args, self.tokenizer, self.seq_len, self.progress = args, tokenizer, seq_len, progress
        self.fingerprint = tokenizer_fingerprint(tokenizer)
        self.cache = Path(args.prepared_cache) if args.prepared_cache else cache_dir() / "prepared"
        self.notes: list[str] = []
        self.warnings: list[str] = []

    def prepared(self, entries: list[str]) -> TrainingData:
        args = self.args
        options = PrepareOptions(self.seq_len, args.held_out_every, args.max_eval_documents, args.max_documents)
        folders = [self._prepared_folder(entry, options) for entry in entries]
        blocks = [PreparedBlocks(folder, "train") for folder in folders]
        weights = args.weights() or [len(split) for split in blocks]
        train = blocks[0] if len(blocks) == 1 else WeightedMixture(blocks, weights)
        sources = [self._describe(entry, folder, split) for entry, folder, split in zip(entries, folders, blocks)]
        for source, count in zip(sources, getattr(train, "places", [len(train)])):
            source["share"] = count / len(train)
        return self._finish(train, sources, self._evaluation(entries, folders, weights))

    def streamed(self, entries: list[str], seed: int, rank: int, world_size: int) -> TrainingData:
        sources, held_out, folders = [], [], []
        for entry in entries:
            if is_prepared(entry):
                raise DataError(f"--dataset {entry} is a prepared folder: train from it without --streaming")
            source = self._source(entry)
            sources.append(source)
            if self.args.held_out_every:
                options = PrepareOptions(self.seq_len, self.args.held_out_every, self.args.max_eval_documents)
                folders.append(self._cached(source, options, with_train=False))
                held_out.append(frozenset(load_held_out_digests(folders[-1])))
            else:
                held_out.append(frozenset())
        weights = self.args.weights() or [1.0] * len(sources)
        train = streamed_blocks(
            sources, weights, self.tokenizer, self.seq_len, seed, self.args.stream_window, held_out, rank, world_size
        )
        if next(iter(train), None) is None:
            raise DataError(f"--dataset {self.args.dataset}: no complete block of --seq-len {self.seq_len} tokens")
        described = [
            {"name": self._label(entry), "kind": "streamed", "shards": len(source.shards()), "weight": weight}
            for entry, source, weight in zip(entries, sources, weights)
        ]
        return self._finish(train, described, self._evaluation(entries, folders, weights))

    def _finish(self, train, sources: list[dict], evaluation: tuple) -> TrainingData:
        eval_sets, eval_record = evaluation
        record = {
            "seq_len": self.seq_len,
            "tokenizer": self._tokenizer_label(),
            "streaming": self.args.streaming,
            "document_masking": self.args.document_masking,
            "sources": sources,
            "eval": eval_record,
        }
        return TrainingData(train, eval_sets, self.seq_len, record, self.notes, self.warnings)

    def _evaluation(self, entries: list[str], folders: list[Path], weights: list[float]) -> tuple:
        """(what each evaluation reads, record): the held-out splits of the training sources (each weighted as in
        the mixture), or the sets of `--eval-dataset` (weighted by size); `--max-eval-tokens` of them in all."""
        if self.args.eval_dataset:
            names, split = self.args.eval_entries(), "train"
            options = PrepareOptions(self.seq_len, 0, 0, max_documents=self.args.max_eval_documents)
            folders = [self._prepared_folder(entry, options) for entry in names]
        elif self.args.held_out_every:
            names, split = [self._label(entry) for entry in entries], "eval"
        else:
            return None, None
        splits = [PreparedMetadata.read(folder).splits for folder in folders]
        if self.args.eval_dataset:
            weights = [split_infos[split].blocks for split_infos in splits]  # as if one set
        sets = [
            HeldOutSet(name, PreparedBlocks(folder, split), weight)
            for name, folder, weight, split_infos in zip(set_names(names), folders, weights, splits)
            if split in split_infos
        ]
        if not sets:
            return None, None
        infos = [held_out.blocks.metadata.splits[split] for held_out in sets]
        blocks, tokens = sum(info.blocks for info in infos), sum(info.tokens + info.dropped_tokens for info in infos)
        name = self.args.eval_dataset or "documents held out of the training data"
        record = EvaluationRecord(name, blocks, tokens)
        if blocks == 0:
            self.warnings.append(
                f"no evaluation: the held-out data ({tokens} tokens) holds no complete block of --seq-len "
                f"{self.seq_len} tokens (hold out more with --eval-every / --max-eval-documents)"
            )
            return None, record.to_record()
        chosen = evaluation_sets(sets, self.seq_len, self.args.eval_token_budget())
        record.evaluated_blocks = sum(len(subset) for subset in chosen.values())
        record.evaluated_tokens = record.evaluated_blocks * self.seq_len
        record.sets = [
            HeldOutSetRecord(
                held_out.name,
                str(held_out.blocks.folder),
                split,
                len(held_out.blocks),
                len(chosen.get(held_out.name, ())),
            )
            for held_out in sets
        ]
        return (chosen if len(sets) > 1 else next(iter(chosen.values()))), record.to_record()

    def _prepared_folder(self, entry: str, options: PrepareOptions) -> Path:
        if is_prepared(entry):
            self._check_compatible(Path(entry))
            folder = Path(entry)
        else:
            folder = self._cached(self._source(entry), options, with_train=True)
        verify(folder)
        return folder

    def _source(self, entry: str) -> Source:
        if looks_prepared(entry):  # rather than read its tokenizer's files as data
            raise DataError(f"--dataset {entry}: a prepared folder without its {METADATA}; prepare it again")
        return find_source(entry, self.args.text_column, self.args.dataset_config)

    def _check_compatible(self, folder: Path) -> None:
        metadata = PreparedMetadata.read(folder)
        ours = (_display_name(self.tokenizer.name_or_path), self.fingerprint, self.seq_len)
        theirs = (_display_name(metadata.tokenizer_name), metadata.tokenizer_fingerprint, metadata.seq_len)
        if ours[1:] != theirs[1:]:
            raise DataError(
                f"--dataset {folder} was prepared with tokenizer {theirs[0]} ({theirs[1]}) and --seq-len {theirs[2]};"
                f" this run uses tokenizer {ours[0]} ({ours[1]}) and --seq-len {ours[2]}. Prepare it again with this "
                "run's tokenizer and --seq-len, or train with its own (omit --tokenizer and --seq-len)"
            )

    def _cached(self, source: Source, options: PrepareOptions, with_train: bool) -> Path:
        """The cache folder holding `source` prepared with `options`: reused if it is there, else made now."""
        key = {"source": source.identity(), "tokenizer": self.fingerprint, "options": asdict(options)}
        key["with_train"] = with_train
        digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
        folder = self.cache / f"{_slug(source.name)}-{digest}"
        if is_prepared(folder):
            self.notes.append(f"data: {self._label(source.name)}, prepared in {folder} (reused)")
            return folder
        what = "data" if with_train else "held-out data"
        print(f"scalevec-data: preparing {what} of {self._label(source.name)} into {folder}", flush=True)
        try:
            num_proc, progress = self.args.num_proc, self.progress
            prepare([source], self.tokenizer, options, folder, num_proc, progress, with_train, wait=True)
        except (DataError, FileExistsError):
            if not is_prepared(folder):  # rather than made by a process that prepared it at the same time
                raise
        self.notes.append(f"data: {self._label(source.name)}, prepared in {folder}")
        return folder

    def _describe(self, entry: str, folder: Path, blocks: PreparedBlocks) -> dict:
        info = blocks.metadata.splits["train"]
        described = {
            "name": self._label(entry),
            "kind": "prepared",
            "folder": str(folder),
            "documents": info.documents,
            "tokens": info.tokens,
            "blocks": info.blocks,
        }
        if blocks.metadata.shard:  # one part of a preparation split across machines: rarely what was meant
            index, count = blocks.metadata.shard
            described["shard"] = [index, count]
            self.warnings.append(
                f"--dataset {entry} is part {index}/{count} of a preparation split with --shard: this run trains "
                f"on that part alone; join the parts first with `{COMBINE_COMMAND}`"
            )
        return described

    def _tokenizer_label(self) -> str:
        """The tokenizer's name for people: as given, or as recorded by the prepared folder it came from, the
        embedded one by that name rather than by its cache folder."""
        prepared = self.args.first_prepared()
        name = self.args.tokenizer or (prepared.tokenizer_name if prepared else "")
        return f"{_display_name(name)} ({len(self.tokenizer):,} tokens)"

    def _label(self, entry: str) -> str:
        # An --eval-dataset file is named as given, also when the training data is the embedded corpus.
        return corpus_name() if self.args.dataset is None and entry == str(default_corpus_file()) else entry


def _display_name(tokenizer_name: str) -> str:
    """A tokenizer's name, the embedded one's by that name rather than by its cache folder."""
    if not tokenizer_name or Path(tokenizer_name).resolve().is_relative_to(cache_dir().resolve()):
        return EMBEDDED_TOKENIZER
    return tokenizer_name


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", Path(name).name or name).strip("-")[:40] or "data"
