"""Pretraining ScaleVec models with the transformers Trainer."""

from ..data import DataArguments, build_training_data, default_corpus_file, default_tokenizer
from .cli import ModelArguments, TrainResult, train
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
    "build_training_data",
    "default_corpus_file",
    "default_tokenizer",
    "parameter_groups",
    "train",
]
