"""The head on top of a checkpoint's decoder: the causal LM's, or one of transformers' generic task heads
(sequence classification, token classification, extractive question answering). A checkpoint names it in its
config's `architectures` (`ScaleVecForSequenceClassification`, `LlamaForQuestionAnswering`, ...). Every head is one
linear layer reading the final norm's output, so folding passes it through and each format only has to name it."""

from dataclasses import dataclass
from pathlib import Path

import transformers
from transformers.models.auto import modeling_auto

from .errors import CheckpointError


@dataclass(frozen=True)
class Head:
    name: str  # as messages say it
    suffix: str  # of its class names: `ScaleVec{suffix}`, `Llama{suffix}`, `AutoModel{suffix}`
    layer: str  # its linear layer, which reads the final norm's output
    outputs: tuple[str, ...]  # the fields of its model output that verification compares
    pipeline_tag: str  # the Hub's name for its task
    stock_classes: dict[str, str]  # transformers' class of this head, by model type (absent: transformers has none)

    @property
    def auto_class(self) -> type:
        return getattr(transformers, f"AutoModel{self.suffix}")


CAUSAL_LM = Head(
    "causal LM",
    "ForCausalLM",
    "lm_head",
    ("logits",),
    "text-generation",
    modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES,
)
SEQUENCE_CLASSIFICATION = Head(
    "sequence-classification",
    "ForSequenceClassification",
    "score",
    ("logits",),
    "text-classification",
    modeling_auto.MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES,
)
TOKEN_CLASSIFICATION = Head(
    "token-classification",
    "ForTokenClassification",
    "score",
    ("logits",),
    "token-classification",
    modeling_auto.MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES,
)
QUESTION_ANSWERING = Head(
    "question-answering",
    "ForQuestionAnswering",
    "qa_outputs",
    ("start_logits", "end_logits"),
    "question-answering",
    modeling_auto.MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES,
)
HEADS = (CAUSAL_LM, SEQUENCE_CLASSIFICATION, TOKEN_CLASSIFICATION, QUESTION_ANSWERING)
HEAD_LAYERS = frozenset(head.layer for head in HEADS)

# Config fields that only the task heads read; carried between ScaleVec and stock configs.
HEAD_FIELDS = ("id2label", "label2id", "problem_type", "classifier_dropout", "token_classification_bias")


def head_of(config: dict, config_file: Path) -> Head:
    """The head of a checkpoint whose config.json (read as a dict) is `config`: what `architectures` names, the
    causal LM if it names nothing (as older writers left it)."""
    architectures = config.get("architectures") or []
    if not architectures:
        return CAUSAL_LM
    for head in HEADS:
        if architectures[0].endswith(head.suffix):
            return head
    raise CheckpointError(
        f"{config_file} names the architecture {architectures[0]!r}; the converter reads "
        f"{', '.join(f'*{head.suffix}' for head in HEADS)} models"
    )


def head_fields(config: transformers.PreTrainedConfig) -> dict:
    """The task-head fields `config` has."""
    return {field: getattr(config, field) for field in HEAD_FIELDS if hasattr(config, field)}
