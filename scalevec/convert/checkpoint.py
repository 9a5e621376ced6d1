"""Reading a checkpoint folder lazily: config, weight files (safetensors, or `.bin` through
`torch.load(weights_only=True)`), and the names, shapes and dtypes of its tensors, with errors that name the file
or tensor at fault. Tensors are read a few at a time (from a `.bin`, which cannot be read in parts: its file whole)
and each file is closed again, so that what is resident is what the converter is working on, never the whole
model."""

import json
import math
import pickle
import struct
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import torch
from safetensors import SafetensorError, safe_open

from .errors import CheckpointError

# In the order `from_pretrained` prefers them.
WEIGHT_INDEXES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
WEIGHT_FILES = ("model.safetensors", "pytorch_model.bin")
SAFETENSORS_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
FINITE_CHECK_ELEMENTS = 1 << 20  # values checked at once: a bounded temporary, whatever the tensor's size


@dataclass(frozen=True)
class TensorInfo:
    file: Path
    shape: tuple[int, ...]
    dtype: torch.dtype
    offset: int | None = None  # where its bytes start in a safetensors file (None in a `.bin`)


class Checkpoint:
    """A local checkpoint folder: `config` (config.json as a dict) and `tensors` (name -> TensorInfo)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            if not self.path.is_dir():
                what = "a file, not a checkpoint folder" if self.path.exists() else "no such folder"
                raise CheckpointError(f"{self.path}: {what}")
            self.config = _read_json(self.path / "config.json")
            self.tensors = _index_tensors(self.path)
        except (CheckpointError, OSError):
            if (gone := _missing_checkpoint(self.path)) is not None:  # before or while it was read
                raise CheckpointError(gone) from None
            raise

    @property
    def model_type(self) -> str:
        if "model_type" not in self.config:
            raise CheckpointError(f"{self.path / 'config.json'} has no model_type")
        return self.config["model_type"]

    @property
    def num_values(self) -> int:
        """The number of values its tensors hold, from the files' headers."""
        return sum(math.prod(info.shape) for info in self.tensors.values())

    @property
    def weight_files(self) -> list[Path]:
        return sorted({info.file for info in self.tensors.values()})

    def read(self, names: Iterable[str]) -> dict[str, torch.Tensor]:
        """The named tensors, in their stored dtype."""
        by_file: dict[Path, list[str]] = defaultdict(list)
        for name in names:
            by_file[self.tensors[name].file].append(name)
        tensors = {}
        for file, file_names in by_file.items():
            tensors |= _read_from(file, {name: self.tensors[name] for name in file_names})
        return tensors

    def check_tensors(self, expected: dict[str, tuple[int, ...]], what: str, ignored: Iterable[str] = ()) -> None:
        """Raise unless the stored tensors are exactly `expected` (name -> shape), apart from `ignored` names."""
        stored = set(self.tensors) - set(ignored)
        missing, unexpected = sorted(set(expected) - stored), sorted(stored - set(expected))
        if missing:
            raise CheckpointError(f"{self.path} lacks tensors that {what} has: {_some(missing)}")
        if unexpected:
            raise CheckpointError(f"{self.path} has tensors that {what} does not: {_some(unexpected)}")
        for name, shape in expected.items():
            info = self.tensors[name]
            if tuple(info.shape) != tuple(shape):
                raise CheckpointError(
                    f"tensor {name} in {info.file} has shape {list(info.shape)}; {what} needs {list(shape)}"
                )


def _missing_checkpoint(path: Path) -> str | None:
    """Where `path` is a missing `checkpoint-<step>` of a run folder that is there: the checkpoints the run holds,
    and whether the run most likely removed it (a Trainer keeps only its newest checkpoints, `save_total_limit`):
    only a step older than a checkpoint held, at which the run saved (a multiple of its recorded `save_steps`)."""
    name, parent = path.name, path.parent
    if path.exists() or not (name.startswith("checkpoint-") and name[11:].isdigit()) or not parent.is_dir():
        return None
    steps = sorted(int(p.name[11:]) for p in parent.glob("checkpoint-*") if p.name[11:].isdigit() and p.is_dir())
    holds = ", ".join(f"checkpoint-{step}" for step in steps) or "no checkpoint"
    if not steps or int(name[11:]) >= steps[-1] or int(name[11:]) % _save_steps(parent / f"checkpoint-{steps[-1]}"):
        return f"{path}: no such checkpoint; the run in {parent} holds {holds}"
    return (
        f"{path} no longer exists: the run in {parent} holds {holds} now (a run keeps only its newest checkpoints, "
        "--save-total-limit, and removes the older ones as it saves)"
    )


def _save_steps(checkpoint: Path) -> int:
    """The steps between a run's saves, as its checkpoint's trainer state records them; 1 where it records none."""
    try:
        steps = json.loads((checkpoint / "trainer_state.json").read_text()).get("save_steps")
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        return 1
    return steps if isinstance(steps, int) and steps >= 1 else 1


def _some(names: list[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return shown if len(names) <= limit else f"{shown}, ... ({len(names)} in all)"


def _read_json(file: Path) -> dict:
    if not file.is_file():
        raise CheckpointError(f"{file} does not exist")
    try:
        content = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"{file} is not readable JSON: {error}") from error
    if not isinstance(content, dict):
        raise CheckpointError(f"{file} holds a JSON {type(content).__name__}, not an object")
    return content


def _index_tensors(folder: Path) -> dict[str, TensorInfo]:
    for index_name in WEIGHT_INDEXES:
        if (folder / index_name).exists():
            return _tensors_of_index(folder / index_name)
    for file_name in WEIGHT_FILES:
        if (folder / file_name).exists():
            return _tensors_of(folder / file_name)
    raise CheckpointError(f"{folder} holds no weights (looked for {', '.join(WEIGHT_INDEXES + WEIGHT_FILES)})")


def _tensors_of_index(index_file: Path) -> dict[str, TensorInfo]:
    weight_map = _read_json(index_file).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise CheckpointError(f"{index_file} has no weight_map")
    if not all(isinstance(file_name, str) for file_name in weight_map.values()):
        raise CheckpointError(f"{index_file}: every weight_map entry must name a file")
    tensors: dict[str, TensorInfo] = {}
    for file_name in sorted(set(weight_map.values())):
        if not _inside_folder(file_name):
            raise CheckpointError(
                f"{index_file} places tensors in {file_name!r}, outside the checkpoint folder; refused"
            )
        file = index_file.parent / file_name
        if not file.is_file():
            raise CheckpointError(f"shard {file} listed in {index_file.name} does not exist")
        in_file = _tensors_of(file)
        listed = {name for name, owner in weight_map.items() if owner == file_name}
        absent = sorted(listed - set(in_file))
        if absent:
            raise CheckpointError(f"{index_file.name} places {_some(absent)} in {file}, which does not hold them")
        tensors |= {name: in_file[name] for name in listed}
    return tensors


def _tensors_of(file: Path) -> dict[str, TensorInfo]:
    if file.suffix == ".safetensors":
        try:
            with safe_open(file, framework="pt") as handle:  # validates the header against the file's size
                slices = {name: handle.get_slice(name) for name in handle.keys()}  # noqa: SIM118
            offsets = _data_offsets(file)
            return {
                name: TensorInfo(
                    file, tuple(s.get_shape()), SAFETENSORS_DTYPES.get(s.get_dtype(), s.get_dtype()), offsets[name]
                )
                for name, s in slices.items()
            }
        except (SafetensorError, OSError) as error:
            raise CheckpointError(
                f"{file} is not a readable safetensors file (truncated or corrupted?): {error}"
            ) from error
    return {name: TensorInfo(file, tuple(t.shape), t.dtype) for name, t in _load_bin(file, "meta").items()}


def _data_offsets(file: Path) -> dict[str, int]:
    """Byte offset of each tensor's data in a safetensors file: 8 bytes of header length, the JSON header, data."""
    with open(file, "rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        header = json.loads(handle.read(length))
    return {name: 8 + length + entry["data_offsets"][0] for name, entry in header.items() if name != "__metadata__"}


def _inside_folder(file_name: str) -> bool:
    """Whether an index's file name stays inside the checkpoint folder. Decided on the name alone: the files of a
    Hub cache snapshot are links into the cache, which resolving them would refuse."""
    path = PurePosixPath(file_name)
    return not path.is_absolute() and ".." not in path.parts


def _load_bin(file: Path, device: str = "cpu") -> dict[str, torch.Tensor]:
    """A `.bin` state dict; never unpickles anything but tensors. Read whole with plain reads, not through a memory
    map, for the reason `_read_tensor` gives; on the meta device only the names, shapes and dtypes are read."""
    try:
        state = torch.load(file, map_location=device, weights_only=True, mmap=False)
    except pickle.UnpicklingError as error:
        if "Weights only load failed" not in str(error):  # torch's words for a pickle it refuses to run
            raise _unreadable_bin(file, error) from error
        raise CheckpointError(
            f"{file} is a pickle that safe loading (torch.load with weights_only=True) refuses: it is not a "
            "`torch.save` file of tensors alone, and unpickling it could run arbitrary code, so it was not loaded. "
            "If you trust its origin, load it yourself and save the weights as safetensors"
        ) from error
    except Exception as error:  # torch raises RuntimeError, EOFError, ... for broken files
        raise _unreadable_bin(file, error) from error
    if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
        raise CheckpointError(f"{file} does not hold a flat state dict of tensors")
    return state


def _read_from(file: Path, infos: dict[str, TensorInfo]) -> dict[str, torch.Tensor]:
    names = list(infos)
    try:
        if file.suffix != ".safetensors":
            state = _load_bin(file)
            return {name: state[name] for name in names}
        with open(file, "rb", buffering=0) as handle:
            return {name: _read_tensor(handle, name, info) for name, info in infos.items()}
    except (SafetensorError, OSError) as error:
        raise CheckpointError(f"cannot read {names[0]} and the rest from {file}: {error}") from error


def _read_tensor(handle, name: str, info: TensorInfo) -> torch.Tensor:
    """Read one tensor with plain reads, not through a memory map: a file that shrinks while it is read (another
    process rewriting it) then ends in a short read, which is an error here, instead of a SIGBUS that kills the
    process. The same single copy as `safe_open(...).get_tensor`."""
    tensor = torch.empty(info.shape, dtype=info.dtype)
    buffer = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
    handle.seek(info.offset)
    while buffer:
        count = handle.readinto(buffer)
        if not count:
            raise CheckpointError(
                f"{info.file} ended inside tensor {name}: it was truncated, or shrank while it was being read"
            )
        buffer = buffer[count:]
    return tensor


def _unreadable_bin(file: Path, error: Exception) -> CheckpointError:
    return CheckpointError(
        f"{file} is not a readable PyTorch state dict (truncated, corrupted, or changed while it was being read?): "
        f"{error}"
    )


def count_nonfinite(tensor: torch.Tensor) -> int:
    """How many NaN and infinite values `tensor` holds."""
    if not tensor.is_floating_point():
        return 0
    flat, count = tensor.reshape(-1), 0
    for start in range(0, flat.numel(), FINITE_CHECK_ELEMENTS):
        finite = torch.isfinite(flat[start : start + FINITE_CHECK_ELEMENTS])
        if not finite.all():
            count += finite.numel() - int(finite.sum())
    return count
