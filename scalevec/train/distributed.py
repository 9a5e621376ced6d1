"""FSDP2 for ScaleVec models, as torchtitan applies it: `fully_shard` on each decoder layer (the model's
`_no_split_modules`) and then on the root, with bf16 compute and fp32 gradient reduction on GPUs.

With the Trainer, accelerate does the same from a config file (`examples/fsdp2.yaml`, `fsdp_version: 2`); these
helpers are for training loops of your own and for the multi-process checks."""

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard


def default_mixed_precision(device_type: str) -> MixedPrecisionPolicy | None:
    """bf16 parameters and activations with fp32 gradient reduction on accelerators; none on CPUs, whose bf16
    matmuls are slower than fp32."""
    if device_type == "cpu":
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def sharding_units(model: nn.Module) -> list[nn.Module]:
    """The modules the model declares unsplittable (`_no_split_modules`: its decoder layers), in order."""
    names = set(model._no_split_modules)
    return [module for module in model.modules() if type(module).__name__ in names]


def apply_fsdp(
    model: nn.Module, mesh: DeviceMesh | None = None, mp_policy: MixedPrecisionPolicy | None = None
) -> nn.Module:
    """Shard `model` in place with FSDP2 (parameters become DTensors) over `mesh` (default: every process).

    `mp_policy` defaults to `default_mixed_precision` for the model's device. The root unit holds what no layer
    does: embeddings, final norm, LM head (tied or not)."""
    if mp_policy is None:
        mp_policy = default_mixed_precision(next(model.parameters()).device.type) or MixedPrecisionPolicy()
    units = sharding_units(model)
    if not units:
        raise ValueError(f"{type(model).__name__} declares no sharding units (`_no_split_modules`)")
    for unit in units:
        fully_shard(unit, mesh=mesh, mp_policy=mp_policy)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)
    return model


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded state dict of an FSDP2 model, on the CPU of rank 0 (empty elsewhere): what `save_pretrained`
    of an unsharded model of the same config takes. Every rank must call it."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    return get_model_state_dict(model, options=options)
