"""A streaming safetensors writer. The converter knows every output tensor's name and shape before it computes any
(from a meta-device model), so each shard's header is written first and each tensor's bytes follow as soon as the
tensor exists; folded products are computed a few rows at a time as they are written (`ScaledMatrix`), so memory
holds the unit's source tensors (memory-mapped) and one block of rows, whatever the shard size. The files are
ordinary safetensors (`safe_open`, `from_pretrained`), sharded and indexed with `save_pretrained`'s names."""

import json
import math
import os
import struct
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import BinaryIO

import torch

from .checkpoint import SAFETENSORS_DTYPES, TensorInfo
from .errors import ConversionError
from .scales import BLOCK_ELEMENTS, ScaledMatrix

DTYPE_CODES = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}
INDEX_FILE = "model.safetensors.index.json"

Plan = Sequence[tuple[str, tuple[int, ...]]]


def shard_plan(plan: Plan, element_size: int, max_shard_bytes: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Consecutive tensors grouped into shards of at most `max_shard_bytes` (a larger tensor gets its own)."""
    shards: list[list] = [[]]
    size = 0
    for name, shape in plan:
        nbytes = math.prod(shape) * element_size
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def _write_all(file: BinaryIO, data) -> None:
    view = memoryview(data).cast("B")
    while view:  # an unbuffered write may take only part
        view = view[file.write(view) :]


def _flat_blocks(tensor: torch.Tensor, dtype: torch.dtype) -> Iterator[torch.Tensor]:
    """The tensor whole where it is written as it is; in blocks where it is cast, so the cast copy stays small."""
    flat = tensor.reshape(-1)
    step = len(flat) if tensor.dtype == dtype else BLOCK_ELEMENTS
    for start in range(0, len(flat), max(1, step)):
        yield flat[start : start + step]


class ShardedWriter:
    """Writes the tensors of `plan`, in plan order, as `dtype` into `folder`. Call `write` with consecutive groups
    of planned tensors (each group in any order), then `close`."""

    def __init__(self, folder: Path, plan: Plan, dtype: torch.dtype, max_shard_bytes: int):
        self.folder, self.dtype = Path(folder), dtype
        self.element_size = torch.empty((), dtype=dtype).element_size()
        self.shards = shard_plan(plan, self.element_size, max_shard_bytes)
        count = len(self.shards)
        self.file_names = (
            ["model.safetensors"]
            if count == 1
            else [f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]
        )
        self._pending = [(shard, name, shape) for shard, tensors in enumerate(self.shards) for name, shape in tensors]
        self._pending.reverse()  # popped from the end
        self._file: BinaryIO | None = None
        self._shard = -1

    def write(
        self, tensors: dict[str, "torch.Tensor | ScaledMatrix"], stored: dict[str, TensorInfo] | None = None
    ) -> None:
        """`stored`: where tensors that are the source's own bytes lie; those of the output dtype are copied file to
        file in the kernel, never passing through this process's memory."""
        tensors, stored = dict(tensors), stored or {}
        while tensors:
            shard, name, shape = self._pending.pop()
            if name not in tensors:
                raise ConversionError(f"internal error: expected {name} next, got {sorted(tensors)[:3]}")
            tensor = tensors.pop(name)
            if tuple(tensor.shape) != tuple(shape):
                raise ConversionError(f"internal error: {name} has shape {list(tensor.shape)}, planned {list(shape)}")
            if shard != self._shard:
                self._open_shard(shard)
            source = stored.get(name)
            if source is not None and source.dtype == self.dtype and self._copy_stored(source, tensor):
                continue
            for block in tensor.blocks() if isinstance(tensor, ScaledMatrix) else _flat_blocks(tensor, self.dtype):
                data = block.to(self.dtype).contiguous().reshape(-1)
                if data.numel():
                    _write_all(self._file, data.view(torch.uint8).numpy())

    def close(self) -> None:
        """Finish the files, and write the index when there are several."""
        if self._pending:
            raise ConversionError(f"internal error: {len(self._pending)} planned tensors were never written")
        self._close_file()
        if len(self.shards) > 1:
            self._write_index()

    def __enter__(self) -> "ShardedWriter":
        return self

    def __exit__(self, *exc_info) -> None:
        self._close_file()

    def _copy_stored(self, source: TensorInfo, tensor: torch.Tensor) -> bool:
        """False where the kernel cannot copy (no `sendfile`, or a file system that refuses it)."""
        if source.offset is None or not hasattr(os, "sendfile"):
            return False
        start, nbytes = self._file.tell(), tensor.numel() * self.element_size
        try:
            with open(source.file, "rb") as handle:
                done, source_fd, output_fd = 0, handle.fileno(), self._file.fileno()
                while done < nbytes:
                    # sendfile, not copy_file_range: on ext4 the latter measured 3x slower for the same copy.
                    copied = os.sendfile(output_fd, source_fd, source.offset + done, nbytes - done)
                    if not copied:
                        raise OSError(f"{source.file} ended early")
                    done += copied
        except OSError:
            self._file.seek(start)
            self._file.truncate()
            return False
        return True

    def _open_shard(self, shard: int) -> None:
        self._close_file()
        self._shard = shard
        # Unbuffered: the kernel copies of `_copy_stored` and ordinary writes share the file position.
        self._file = open(self.folder / self.file_names[shard], "wb", buffering=0)  # noqa: SIM115 (many writes)
        header: dict = {"__metadata__": {"format": "pt"}}
        offset = 0
        for name, shape in self.shards[shard]:
            nbytes = math.prod(shape) * self.element_size
            header[name] = {
                "dtype": DTYPE_CODES[self.dtype],
                "shape": list(shape),
                "data_offsets": [offset, offset + nbytes],
            }
            offset += nbytes
        blob = json.dumps(header, separators=(",", ":")).encode()
        blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as safetensors itself pads
        _write_all(self._file, struct.pack("<Q", len(blob)) + blob)

    def _close_file(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _write_index(self) -> None:
        weight_map = {name: self.file_names[i] for i, tensors in enumerate(self.shards) for name, _ in tensors}
        shapes = [shape for tensors in self.shards for _, shape in tensors]
        parameters = sum(math.prod(shape) for shape in shapes)
        index = {
            "metadata": {"total_parameters": parameters, "total_size": parameters * self.element_size},
            "weight_map": dict(sorted(weight_map.items())),
        }
        (self.folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
