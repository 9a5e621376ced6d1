"""A ScaleVec model of a config built on the meta device: the names and shapes of its tensors, its scale vectors
by role and its parameter counts, for any model size and with no memory spent on weights."""

import functools
import json

import torch

from ..configuration_scalevec import ScaleVecConfig
from ..modeling_scalevec import ScaleVecForCausalLM
from .layout import LM_HEAD

Tensors = dict[str, torch.Tensor]


def meta_state(config: ScaleVecConfig) -> tuple[Tensors, dict[str, list[str]]]:
    """The state dict (as saved: no tied LM head) and the scale-vector names by role of a ScaleVec model of
    `config`, on the meta device: the layout of a checkpoint."""
    state, roles = _meta_state(_config_key(config))
    return dict(state), {role: list(names) for role, names in roles.items()}


def num_parameters(config: ScaleVecConfig) -> int:
    """All parameters of a ScaleVec model of `config` (a tied LM head counted once)."""
    state, _ = _meta_state(_config_key(config))
    return sum(tensor.numel() for tensor in state.values())


def scale_parameters(config: ScaleVecConfig) -> dict[str, int]:
    """The scale-vector parameters of a ScaleVec model of `config`, by role ("input", "output")."""
    state, roles = _meta_state(_config_key(config))
    return {role: sum(state[name].numel() for name in names) for role, names in roles.items()}


def _config_key(config: ScaleVecConfig) -> str:
    return json.dumps(config.to_dict(), sort_keys=True)


@functools.lru_cache(maxsize=4)  # a conversion, its model card and inspection ask for the same layouts
def _meta_state(config_json: str) -> tuple[Tensors, dict[str, list[str]]]:
    with torch.device("meta"):
        model = ScaleVecForCausalLM(ScaleVecConfig.from_dict(json.loads(config_json)))  # built from a copy
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        del state[LM_HEAD]
    return state, model.scale_vector_roles()
