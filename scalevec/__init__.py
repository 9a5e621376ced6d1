"""ScaleVec: scale vectors done right, as a transformers architecture."""

import importlib.util

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_scalevec import ScaleVecConfig
from .modeling_scalevec import ScaleVecForCausalLM, ScaleVecModel, ScaleVecPreTrainedModel

AutoConfig.register(ScaleVecConfig.model_type, ScaleVecConfig)
AutoModel.register(ScaleVecConfig, ScaleVecModel)
AutoModelForCausalLM.register(ScaleVecConfig, ScaleVecForCausalLM)
ScaleVecConfig.register_for_auto_class()
ScaleVecModel.register_for_auto_class("AutoModel")
ScaleVecForCausalLM.register_for_auto_class("AutoModelForCausalLM")


def _register_peft_defaults() -> None:
    """PEFT picks LoRA's target modules by model type when a `LoraConfig` names none: Llama's q and v projections,
    which ScaleVec names alike."""
    if importlib.util.find_spec("peft") is not None:
        from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as lora_targets

        lora_targets.setdefault(ScaleVecConfig.model_type, lora_targets["llama"])


_register_peft_defaults()

__all__ = ["ScaleVecConfig", "ScaleVecForCausalLM", "ScaleVecModel", "ScaleVecPreTrainedModel"]
