"""Shared benchmark machinery: interleaved timing with medians, the exact peak of live tensor memory, and the model
code of a git revision imported beside the current one."""

import functools
import importlib
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Iterable
from datetime import date
from pathlib import Path
from types import ModuleType

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from transformers.dynamic_module_utils import get_relative_imports

# The tests' tiny model (tests/_helpers.py), for the checks that compare two computations of it
TINY_DIMS = dict(
    vocab_size=101,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=64,
)


def machine() -> str:
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"{torch.get_num_threads()}-thread CPU"
    return f"{platform.machine()}, {device}, torch {torch.__version__}"


def today() -> str:
    return date.today().isoformat()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def interleaved_times(steps: dict[str, Callable[[], None]], repetitions: int, warmup: int = 2) -> dict[str, list]:
    """Seconds of each call of each step; the steps take turns so that drift in machine speed hits all alike."""
    for step in steps.values():
        for _ in range(warmup):
            step()
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(repetitions):
        for name, step in steps.items():
            _sync()
            start = time.perf_counter()
            step()
            _sync()
            times[name].append(time.perf_counter() - start)
    return times


def interleaved_medians(steps: dict[str, Callable[[], None]], repetitions: int, warmup: int = 2) -> dict[str, float]:
    """Median seconds per call of each step, measured by `interleaved_times`."""
    return {name: statistics.median(values) for name, values in interleaved_times(steps, repetitions, warmup).items()}


class LiveTensorMemory(TorchDispatchMode):
    """Tracks the bytes of every tensor storage created inside it until that storage is freed, and their peak:
    on CPU the counterpart of `torch.cuda.max_memory_allocated`, exact and free of allocator noise."""

    def __init__(self):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = self.peak = 0

    def _release(self, pointer: int) -> None:
        self.current -= self.live.pop(pointer)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu":
                storage = tensor.untyped_storage()
                pointer, size = storage.data_ptr(), storage.nbytes()
                if size and pointer not in self.live:
                    self.live[pointer] = size
                    self.current += size
                    self.peak = max(self.peak, self.current)
                    weakref.finalize(storage, self._release, pointer)
        return out


def peak_memory_during(run: Callable[[], object]) -> int:
    """Peak bytes of the tensors that `run()` allocates, beyond those alive before it."""
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        run()
        return torch.cuda.max_memory_allocated() - before
    with LiveTensorMemory() as memory:
        run()
    return memory.peak


def peak_memory(build: Callable[[], Callable[[], None]], steps: int = 2) -> int:
    """Peak bytes of model, optimizer state, gradients and activations over `steps` training steps."""

    def run() -> None:
        step = build()
        for _ in range(steps):
            step()

    return peak_memory_during(run)


def move_scales_off_one(model: torch.nn.Module) -> None:
    """Every scale parameter drawn from U(0.5, 1.5), so that a check sees what the scales do (not their init, 1)."""
    with torch.no_grad():
        for names in model.scale_vector_roles().values():
            for name in names:
                model.get_parameter(name).uniform_(0.5, 1.5)


def training_step(
    model: torch.nn.Module,
    vocab_size: int,
    batch: int,
    seq: int,
    optimized: Iterable[torch.Tensor] | None = None,
    autocast: torch.dtype | None = None,
) -> Callable[[], None]:
    """One forward + backward + fused AdamW step (what `adamw_torch_fused` builds) on fixed random tokens, of the
    `optimized` parameters (all by default), on the model's device; the forward under autocast to `autocast` if
    given (what the Trainer's `--bf16` does: float32 weights, bf16 matmuls)."""
    model.train()
    optimized = model.parameters() if optimized is None else optimized
    optimizer = torch.optim.AdamW(optimized, lr=1e-4, fused=True)  # the Trainer's default
    device = next(model.parameters()).device
    ids = torch.randint(0, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)

    def step() -> None:
        with torch.autocast(device.type, dtype=autocast, enabled=autocast is not None):
            loss = model(ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        model.zero_grad(set_to_none=True)

    return step


@functools.cache
def modeling_at(revision: str) -> ModuleType:
    """`scalevec/modeling_scalevec.py` as it was at a git revision, with the files it imports relatively (what ships
    to the Hub), imported as a package of their own beside the current code."""
    root = Path(__file__).parents[1]
    package = "scalevec_at_" + re.sub(r"\W", "_", revision)
    folder = Path(tempfile.mkdtemp()) / package
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    pending = ["modeling_scalevec"]
    while pending:
        path = folder / f"{pending.pop()}.py"
        if not path.exists():
            show = ["git", "show", f"{revision}:scalevec/{path.name}"]
            path.write_text(subprocess.run(show, cwd=root, capture_output=True, text=True, check=True).stdout)
            pending.extend(get_relative_imports(path))
    sys.path.insert(0, str(folder.parent))
    modeling = importlib.import_module(f"{package}.modeling_scalevec")
    # registered as the package registers its own classes, which transformers then treats as remote code (generate
    # inspects the forward of such a model at every step): the same work on both sides
    for auto_class, reference in modeling.AUTO_MAP.items():
        getattr(modeling, reference.split(".")[-1]).register_for_auto_class(auto_class)
    return modeling


def at_revision(revision: str, model: torch.nn.Module) -> torch.nn.Module:
    """`model` (a ScaleVecForCausalLM) as the model code of a git revision builds it, with the same weights."""
    modeling = modeling_at(revision)
    fields = model.config.to_diff_dict() | {"attn_implementation": model.config._attn_implementation}
    twin = modeling.ScaleVecForCausalLM(modeling.ScaleVecConfig(**fields))
    twin.load_state_dict(model.state_dict())
    return twin.train(model.training)


def split_revision(name: str) -> tuple[str, str | None]:
    """ "unified @ 3d87363" -> ("unified", "3d87363"); "unified" -> ("unified", None): a model name in a benchmark's
    `--against` runs."""
    model, _, revision = name.partition(" @ ")
    return model, revision or None
