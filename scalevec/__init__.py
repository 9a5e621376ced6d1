"""ScaleVec: scale vectors done right, as a transformers architecture."""

import importlib.util

from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
)

from .configuration_scalevec import ScaleVecConfig
from .modeling_scalevec import (
    ScaleVecForCausalLM,
    ScaleVecForQuestionAnswering,
    ScaleVecForSequenceClassification,
    ScaleVecForTokenClassification,
    ScaleVecModel,
    ScaleVecPreTrainedModel,
)

AutoConfig.register(ScaleVecConfig.model_type, ScaleVecConfig)
ScaleVecConfig.register_for_auto_class()
for auto_class, model_class in (
    (AutoModel, ScaleVecModel),
    (AutoModelForCausalLM, ScaleVecForCausalLM),
    (AutoModelForSequenceClassification, ScaleVecForSequenceClassification),
    (AutoModelForTokenClassification, ScaleVecForTokenClassification),
    (AutoModelForQuestionAnswering, ScaleVecForQuestionAnswering),
):
    auto_class.register(ScaleVecConfig, model_class)
    model_class.register_for_auto_class(auto_class.__name__)


def _register_peft_defaults() -> None:
    """PEFT picks LoRA's target modules by model type when a `LoraConfig` names none: Llama's q and v projections,
    which ScaleVec names alike."""
    if importlib.util.find_spec("peft") is not None:
        from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as lora_targets

        lora_targets.setdefault(ScaleVecConfig.model_type, lora_targets["llama"])


_register_peft_defaults()

__all__ = [
    "ScaleVecConfig",
    "ScaleVecForCausalLM",
    "ScaleVecForQuestionAnswering",
    "ScaleVecForSequenceClassification",
    "ScaleVecForTokenClassification",
    "ScaleVecModel",
    "ScaleVecPreTrainedModel",
]
