"""Shared test helpers: tiny configs and fresh Python processes that cannot import `scalevec`."""

import itertools
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from scalevec import ScaleVecConfig

TINY = dict(
    vocab_size=101,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)
TINY_MOE = dict(TINY, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


def tiny_config(**overrides) -> ScaleVecConfig:
    return ScaleVecConfig(**{**TINY, **overrides})


def tiny_moe_config(**overrides) -> ScaleVecConfig:
    return ScaleVecConfig(**{**TINY_MOE, **overrides})


def random_ids(config, batch: int = 2, length: int = 9, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (batch, length), generator=generator)


def randomize_scales(model: torch.nn.Module, seed: int = 0) -> None:
    """Move every scale parameter away from 1 so that tests see what the scales do."""
    generator = torch.Generator().manual_seed(seed)
    parameters = dict(model.named_parameters())
    with torch.no_grad():
        for names in model.scale_vector_roles().values():
            for name in names:
                parameter = parameters[name]
                parameter.copy_(1 + 0.3 * torch.randn(parameter.shape, generator=generator))


def run_without_scalevec(script: str, *args: str, env: dict | None = None, timeout: int = 300) -> str:
    """Run `script` in a fresh interpreter in which `import scalevec` fails, and return its stdout."""
    prelude = "import sys\nsys.modules['scalevec'] = None  # this process must not see the package\n"
    result = subprocess.run(
        [sys.executable, "-c", prelude + textwrap.dedent(script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "HF_HUB_OFFLINE": "1", **(env or {})},
        cwd=Path(__file__).parent,
    )
    if result.returncode:
        raise AssertionError(f"subprocess failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")
    return result.stdout


STRATEGIES = list(itertools.product(("none", "shared", "branch"), ("none", "in", "out", "both"), ("direct", "magdir")))


def logits(model, ids: torch.Tensor, **kwargs) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, **kwargs).logits


def matrices_of(model) -> dict[str, torch.Tensor]:
    """The state dict without scale vectors: what a model of another strategy can load."""
    roles = model.scale_vector_roles()
    scales = set(roles["input"] + roles["output"])
    return {k: v for k, v in model.state_dict().items() if k not in scales}
