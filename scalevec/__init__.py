"""ScaleVec: scale vectors done right, as a transformers architecture."""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from .configuration_scalevec import ScaleVecConfig
from .modeling_scalevec import ScaleVecForCausalLM, ScaleVecModel, ScaleVecPreTrainedModel

AutoConfig.register(ScaleVecConfig.model_type, ScaleVecConfig)
AutoModel.register(ScaleVecConfig, ScaleVecModel)
AutoModelForCausalLM.register(ScaleVecConfig, ScaleVecForCausalLM)
ScaleVecConfig.register_for_auto_class()
ScaleVecModel.register_for_auto_class("AutoModel")
ScaleVecForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = ["ScaleVecConfig", "ScaleVecForCausalLM", "ScaleVecModel", "ScaleVecPreTrainedModel"]
