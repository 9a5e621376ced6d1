"""Pretraining ScaleVec models with the transformers Trainer."""

from ..data import DataArguments, build_training_data, default_corpus_file, default_tokenizer
from .optim import DecayConfig, MuonAdamW, parameter_groups
from .presets import MODEL_SIZES

_FROM_CLI = ("ModelArguments", "TrainResult", "train")
# `.trainer` (and the transformers Trainer behind it) loads on first use too: reading a finished study needs none.
_FROM_TRAINER = ("NonFiniteLossError", "ScaleVecTrainer")

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


def __getattr__(name: str):
    # `.cli` loads on first use: imported here, `python -m scalevec.train.cli` (and torchrun's `-m`) would find it
    # imported before running it as __main__, and runpy warns of "unpredictable behaviour" in every process.
    if name in _FROM_CLI:
        from . import cli

        return getattr(cli, name)
    if name in _FROM_TRAINER:
        from . import trainer

        return getattr(trainer, name)
    if name == "ScaleVecTrainingArguments":
        from .arguments import ScaleVecTrainingArguments

        return ScaleVecTrainingArguments
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
