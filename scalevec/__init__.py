"""ScaleVec: scale vectors done right, as a transformers architecture."""

import importlib.util
import logging
from contextlib import contextmanager

import torch
import transformers


@contextmanager
def _quiet_torchao_import():
    """transformers imports torchao, when it is installed, with its model classes; torchao 0.17 and 0.18 then print
    four lines that concern no ScaleVec command: on a CPU-only torch, "Failed to load" for each of its compiled CUDA
    kernels (PyPI's torchao wheels are CUDA builds; its weight-only CPU path is plain Python), and on torch 2.13 two
    notices that registering Enums as pytree constants is deprecated. Raise those two loggers above WARNING for
    the import; with a CUDA build of torch, a kernel that fails to load is still reported."""
    quieted = [logging.getLogger("torch.utils._pytree")]
    if torch.version.cuda is None:
        quieted.append(logging.getLogger("torchao"))
    levels = [logger.level for logger in quieted]
    for logger in quieted:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(quieted, levels):
            logger.setLevel(level)


with _quiet_torchao_import():
    from . import modeling_scalevec
    from .configuration_scalevec import ScaleVecConfig
    from .modeling_scalevec import *  # noqa: F403

__all__ = ["ScaleVecConfig", *modeling_scalevec.__all__]

transformers.AutoConfig.register(ScaleVecConfig.model_type, ScaleVecConfig)
ScaleVecConfig.register_for_auto_class()
for auto_name, reference in modeling_scalevec.AUTO_MAP.items():
    if auto_name != "AutoConfig":  # the Auto classes of `save_pretrained`'s folders, each with its model class
        model_class = getattr(modeling_scalevec, reference.removeprefix("modeling_scalevec."))
        getattr(transformers, auto_name).register(ScaleVecConfig, model_class)
        model_class.register_for_auto_class(auto_name)


def _register_peft_defaults() -> None:
    """PEFT picks LoRA's target modules by model type when a `LoraConfig` names none: Llama's q and v projections,
    which ScaleVec names alike."""
    if importlib.util.find_spec("peft") is not None:
        from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as lora_targets

        lora_targets.setdefault(ScaleVecConfig.model_type, lora_targets["llama"])


_register_peft_defaults()
