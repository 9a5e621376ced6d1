"""A ScaleVec model of a config built on the meta device: the names and shapes of its tensors, its scale vectors
by role and its parameter counts, for any model size and with no memory spent on weights."""

import functools
import json

import torch

from .. import modeling_scalevec
from ..configuration_scalevec import ScaleVecConfig
from .heads import CAUSAL_LM, Head
from .layout import EMBEDDINGS, LM_HEAD

Tensors = dict[str, torch.Tensor]


def meta_state(config: ScaleVecConfig, head: Head = CAUSAL_LM) -> tuple[Tensors, dict[str, list[str]]]:
    """The state dict (as saved: no tied LM head) and the scale-vector names by role of a ScaleVec `head` model of
    `config`, on the meta device: the layout of a checkpoint."""
    state, roles = _meta_state(_config_key(config), head.suffix)
    return dict(state), {role: list(names) for role, names in roles.items()}


def num_parameters(config: ScaleVecConfig, head: Head = CAUSAL_LM) -> int:
    """All parameters of a ScaleVec `head` model of `config` (a tied LM head counted once)."""
    state, _ = _meta_state(_config_key(config), head.suffix)
    return sum(tensor.numel() for tensor in state.values())


def scale_parameters(config: ScaleVecConfig) -> dict[str, int]:
    """The scale-vector parameters of a ScaleVec model of `config`, by role ("input", "output"): the same for every
    head, which holds none."""
    state, roles = _meta_state(_config_key(config), CAUSAL_LM.suffix)
    return {role: sum(state[name].numel() for name in names) for role, names in roles.items()}


def non_embedding_parameters(config: ScaleVecConfig) -> int:
    """N of the scaling laws: the parameters of a causal LM of `config` other than the embedding, the LM head and the
    scale vectors, so the same for every scale strategy (and vocabulary) of one size. The one count that the
    training plan and a study's grid give."""
    unscaled = {"scale_preset": "none", "norm_scale": None, "linear_scale": None, "scale_param": None, "folded": False}
    bare = ScaleVecConfig.from_dict({**config.to_dict(), **unscaled, "vocab_size": 2})
    state, roles = meta_state(bare)
    scales = {name for names in roles.values() for name in names}
    return sum(t.numel() for name, t in state.items() if name not in (EMBEDDINGS, LM_HEAD) and name not in scales)


def active_parameters(config: ScaleVecConfig) -> int:
    """The parameters of a causal LM of `config` that one token uses: a MoE layer's token uses `num_experts_per_tok`
    of its `num_experts` routed experts, so only that share of the experts' parameters is active."""
    state, _ = meta_state(config)
    total = num_parameters(config)
    experts = sum(t.numel() for name, t in state.items() if ".mlp.experts." in name)
    routed, used = getattr(config, "num_experts", 0) or 0, getattr(config, "num_experts_per_tok", 0) or 0
    return total - (experts * (routed - used) // routed if routed else 0)


def _config_key(config: ScaleVecConfig) -> str:
    return json.dumps(config.to_dict(), sort_keys=True)


@functools.lru_cache(maxsize=4)  # a conversion, its model card and inspection ask for the same layouts
def _meta_state(config_json: str, head_suffix: str) -> tuple[Tensors, dict[str, list[str]]]:
    model_class = getattr(modeling_scalevec, f"ScaleVec{head_suffix}")
    with torch.device("meta"):
        model = model_class(ScaleVecConfig.from_dict(json.loads(config_json)))  # built from a copy
    state = model.state_dict()
    if model.config.tie_word_embeddings and LM_HEAD in state:  # only the causal LM's head is tied
        del state[LM_HEAD]
    return state, model.scale_vector_roles()
