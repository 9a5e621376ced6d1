"""Pretraining ScaleVec models with the transformers Trainer."""

from .cli import ModelArguments, TrainResult, train
from .corpus import default_corpus_file, default_tokenizer
from .data import DataArguments, build_datasets, pack
from .optim import DecayConfig, MuonAdamW, parameter_groups
from .presets import MODEL_SIZES
from .trainer import NonFiniteLossError, ScaleVecTrainer, ScaleVecTrainingArguments

__all__ = [
    "MODEL_SIZES",
    "DataArguments",
    "DecayConfig",
    "ModelArguments",
    "MuonAdamW",
    "NonFiniteLossError",
    "ScaleVecTrainer",
    "ScaleVecTrainingArguments",
    "TrainResult",
    "build_datasets",
    "default_corpus_file",
    "default_tokenizer",
    "pack",
    "parameter_groups",
    "train",
]
