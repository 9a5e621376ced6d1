"""Pretraining data: sources read with precise errors, prepared once (resumably, on one machine or split across
several) into memory-light token blocks, mixed by weight, or streamed by shard with a resumable position."""

from .build import DataArguments, TrainingData, build_training_data, check_vocabulary, load_tokenizer
from .collator import PackedBlockCollator, document_positions
from .corpus import default_corpus_file, default_tokenizer
from .mixture import WeightedMixture
from .preparation import combine, prepare
from .prepared import PreparedBlocks, PreparedMetadata, PrepareOptions
from .sources import DataError, Source, find_source

__all__ = [
    "DataArguments",
    "DataError",
    "PackedBlockCollator",
    "PrepareOptions",
    "PreparedBlocks",
    "PreparedMetadata",
    "Source",
    "TrainingData",
    "WeightedMixture",
    "build_training_data",
    "check_vocabulary",
    "combine",
    "default_corpus_file",
    "default_tokenizer",
    "document_positions",
    "find_source",
    "load_tokenizer",
    "prepare",
]
