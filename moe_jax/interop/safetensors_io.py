"""Safetensors checkpoints as NumPy arrays, one tensor at a time (no torch needed).

Reading: a Hugging Face checkpoint directory holds either `model.safetensors` or shards
listed in `model.safetensors.index.json` (`weight_map`: tensor name -> shard file). Tensors
are read one at a time through the `safetensors` NumPy API and returned as float32. NumPy has
no bfloat16, so that API refuses BF16 tensors (the usual dtype of published checkpoints);
those are memory-mapped from their byte range in the file and widened exactly (a bfloat16 is
the high 16 bits of a float32).

Writing: `ShardWriter` buffers tensors up to a shard size, writes each full shard at once and
finally names the shards and the index the way `save_pretrained` does, so a model larger than
memory is written in per-layer pieces.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
_FLOAT_DTYPES = ("F64", "F32", "F16")  # dtypes the NumPy API reads itself


def _new_file_mode() -> int:
    """The mode `open()` gives a new file: 0o666 less the umask (which only os.umask reads)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


class InteropError(ValueError):
    """A checkpoint or config that cannot be converted; the message names what and why."""


class TensorReader:
    """Name -> float32 array for every tensor of a checkpoint directory (single file or shards)."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._handles: dict[Path, object] = {}  # open safe_open handles (memory maps)
        self._headers: dict[Path, tuple[int, dict]] = {}  # parsed headers, for BF16 reads
        index = self.directory / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (ValueError, KeyError) as e:
                raise InteropError(f"'{index}' is not a safetensors index ({e})") from None
            self._file_of = {name: self.directory / f for name, f in weight_map.items()}
            for f in sorted(set(self._file_of.values())):
                if not f.is_file():
                    raise InteropError(f"shard '{f.name}' listed in '{index}' is missing")
        else:
            files = sorted(self.directory.glob("*.safetensors"))
            if not files:
                raise InteropError(
                    f"no *.safetensors file in '{self.directory}'; save the model with "
                    "`save_pretrained` (safetensors is its default format)"
                )
            self._file_of = {}
            for f in files:
                self._file_of.update(dict.fromkeys(self._handle(f).keys(), f))

    def names(self) -> list[str]:
        return sorted(self._file_of)

    def has(self, name: str) -> bool:
        return name in self._file_of

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self._file(name)).get_slice(name).get_shape())

    def get(self, name: str) -> np.ndarray:
        path = self._file(name)
        handle = self._handle(path)
        dtype = handle.get_slice(name).get_dtype()
        if dtype in _FLOAT_DTYPES:
            return handle.get_tensor(name).astype(np.float32, copy=False)
        if dtype == "BF16":
            return self._bf16(path, name)
        raise InteropError(
            f"tensor '{name}' has dtype {dtype}; only float tensors (F32, F16, BF16) can be "
            "imported (dequantize the checkpoint first)"
        )

    def get_packed(self, name: str) -> np.ndarray:
        """A uint8 tensor as it is stored (MXFP4 blocks and scales; `interop.mxfp4`)."""
        handle = self._handle(self._file(name))
        dtype = handle.get_slice(name).get_dtype()
        if dtype != "U8":
            raise InteropError(f"tensor '{name}' has dtype {dtype}; packed tensors are U8")
        return handle.get_tensor(name)

    def _file(self, name: str) -> Path:
        if name not in self._file_of:
            raise InteropError(f"tensor '{name}' is missing from '{self.directory}'")
        return self._file_of[name]

    def _handle(self, path: Path):
        if path not in self._handles:
            try:
                self._handles[path] = safe_open(path, framework="np")
            except SafetensorError as e:
                raise InteropError(f"'{path}' is not a readable safetensors file ({e})") from None
        return self._handles[path]

    def _bf16(self, path: Path, name: str) -> np.ndarray:
        if path not in self._headers:
            with open(path, "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))  # header length, then the JSON header
                self._headers[path] = (8 + n, json.loads(f.read(n)))
        data_start, header = self._headers[path]
        info = header[name]
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end == start:
            return np.zeros(shape, np.float32)
        raw = np.memmap(path, dtype="<u2", mode="r", offset=data_start + start, shape=shape)
        return (raw.astype(np.uint32) << 16).view(np.float32)


class ShardWriter:
    """Writes tensors into safetensors shards of about `max_shard_bytes` plus an index.

    A tensor larger than the limit gets a shard of its own. `close()` names the files like
    `save_pretrained`: one `model.safetensors`, or `model-0000i-of-0000n.safetensors` and
    `model.safetensors.index.json`.
    """

    def __init__(self, directory: str | Path, max_shard_bytes: int):
        self.directory = Path(directory)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, np.ndarray] = {}
        self._pending_bytes = 0
        self._shards: list[tuple[Path, list[str]]] = []
        self.total_bytes = 0

    def add(self, name: str, array: np.ndarray) -> None:
        if name in self._pending or any(name in names for _, names in self._shards):
            raise ValueError(f"tensor '{name}' written twice")
        array = np.ascontiguousarray(array, dtype=np.float32)
        if self._pending and self._pending_bytes + array.nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = array
        self._pending_bytes += array.nbytes
        self.total_bytes += array.nbytes

    def _flush(self) -> None:
        path = self.directory / f"shard-{len(self._shards):05d}.tmp"
        save_file(self._pending, path, metadata={"format": "pt"})
        # safetensors 0.8 writes through a temporary file of mode 600 and keeps that mode
        # (safetensors issue #782): give the shard the umask's, like config.json and the index.
        os.chmod(path, _new_file_mode())
        self._shards.append((path, list(self._pending)))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> None:
        if self._pending or not self._shards:
            self._flush()
        n = len(self._shards)
        if n == 1:
            self._shards[0][0].rename(self.directory / SINGLE_FILE)
            return
        weight_map = {}
        for i, (path, names) in enumerate(self._shards):
            final = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            path.rename(self.directory / final)
            weight_map.update(dict.fromkeys(names, final))
        index = {"metadata": {"total_size": self.total_bytes}, "weight_map": weight_map}
        (self.directory / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
