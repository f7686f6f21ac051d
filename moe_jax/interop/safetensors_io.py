"""Safetensors checkpoints as NumPy arrays, one tensor at a time (no torch needed).

Reading: a Hugging Face checkpoint directory holds either `model.safetensors` or shards
listed in `model.safetensors.index.json` (`weight_map`: tensor name -> shard file). Each
tensor is memory-mapped from its byte range in its file, in its own dtype (bf16 and fp8
through `ml_dtypes`): a converter that slices it reads only the slice, and nothing is widened
to float32 on the way. The headers are parsed (and checked against the files' sizes) once.

Writing: `ShardWriter` buffers tensors up to a shard size, writes each full shard at once and
finally names the shards and the index the way `save_pretrained` does, so a model larger than
memory is written in per-layer pieces.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import ml_dtypes
import numpy as np
from safetensors.numpy import save_file

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def _new_file_mode() -> int:
    """The mode `open()` gives a new file: 0o666 less the umask (which only os.umask reads)."""
    umask = os.umask(0)
    os.umask(umask)
    return 0o666 & ~umask


class InteropError(ValueError):
    """A checkpoint or config that cannot be converted; the message names what and why."""


# safetensors dtype -> NumPy dtype of the values as stored (bf16 and fp8 through ml_dtypes).
DTYPES = {
    "F64": np.dtype("<f8"),
    "F32": np.dtype("<f4"),
    "F16": np.dtype("<f2"),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "F8_E4M3": np.dtype(ml_dtypes.float8_e4m3fn),
    "F8_E5M2": np.dtype(ml_dtypes.float8_e5m2),
    "U8": np.dtype("u1"),
    "I8": np.dtype("i1"),
}
FLOAT_DTYPES = ("F64", "F32", "F16", "BF16")  # read as values; the others need a format


class TensorReader:
    """Name -> the tensor as stored (its own dtype), memory-mapped: nothing is read until
    the array (or a slice of it) is used, so a converter reads only what it keeps.

    Every file's header is read and checked when the directory is opened (a missing or
    truncated shard, an index naming a file that is not there, a tensor whose byte range
    does not match its shape and dtype): `InteropError` naming the file and the tensor,
    before anything is converted or written."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self._headers: dict[Path, tuple[int, dict]] = {}  # data start, JSON header
        index = self.directory / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            except (ValueError, KeyError, TypeError) as e:
                raise InteropError(f"'{index}' is not a safetensors index ({e})") from None
            self._file_of = {name: self.directory / f for name, f in weight_map.items()}
            for name, f in self._file_of.items():
                if not f.is_file():
                    raise InteropError(
                        f"shard '{f.name}' listed in '{index}' (for tensor '{name}') is missing"
                    )
                if name not in self._header(f)[1]:
                    raise InteropError(f"'{index}' puts tensor '{name}' in '{f}', which lacks it")
        else:
            files = sorted(self.directory.glob("*.safetensors"))
            if not files:
                raise InteropError(
                    f"no *.safetensors file in '{self.directory}'; save the model with "
                    "`save_pretrained` (safetensors is its default format)"
                )
            self._file_of = {}
            for f in files:
                self._file_of.update(dict.fromkeys(self._header(f)[1], f))

    def names(self) -> list[str]:
        return sorted(self._file_of)

    def has(self, name: str) -> bool:
        return name in self._file_of

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._info(name)["shape"])

    def dtype(self, name: str) -> str:
        """The safetensors dtype name (BF16, F32, F8_E4M3, U8, ...)."""
        return self._info(name)["dtype"]

    def nbytes(self, name: str) -> int:
        start, end = self._info(name)["data_offsets"]
        return end - start

    def get(self, name: str) -> np.ndarray:
        """A float tensor (F64, F32, F16, BF16) in its own dtype, memory-mapped."""
        dtype = self.dtype(name)
        if dtype not in FLOAT_DTYPES:
            raise InteropError(
                f"tensor '{name}' in '{self._file(name)}' has dtype {dtype}; only F32, F16 and "
                "BF16 tensors (and the FP8 / MXFP4 weights with their scales) can be imported"
            )
        return self.raw(name)

    def get_packed(self, name: str) -> np.ndarray:
        """A uint8 tensor as it is stored (MXFP4 blocks and scales; `interop.mxfp4`)."""
        dtype = self.dtype(name)
        if dtype != "U8":
            raise InteropError(
                f"tensor '{name}' in '{self._file(name)}' has dtype {dtype}; packed tensors are U8"
            )
        return self.raw(name)

    def raw(self, name: str) -> np.ndarray:
        """Any tensor of a dtype in `DTYPES`, as stored, memory-mapped (read-only)."""
        path, info = self._file(name), self._info(name)
        dtype = DTYPES[info["dtype"]]
        start, end = info["data_offsets"]
        shape = tuple(info["shape"])
        if end == start:
            return np.zeros(shape, dtype)
        data_start = self._header(path)[0]
        return np.memmap(path, dtype=dtype, mode="r", offset=data_start + start, shape=shape)

    def file_of(self, name: str) -> Path:
        return self._file(name)

    def _file(self, name: str) -> Path:
        if name not in self._file_of:
            raise InteropError(f"tensor '{name}' is missing from '{self.directory}'")
        return self._file_of[name]

    def _info(self, name: str) -> dict:
        return self._header(self._file(name))[1][name]

    def _header(self, path: Path) -> tuple[int, dict]:
        if path not in self._headers:
            self._headers[path] = _read_header(path)
        return self._headers[path]


def _read_header(path: Path) -> tuple[int, dict]:
    """(where the data starts, {tensor name: its header entry}) of a safetensors file, every
    entry checked against the file: a known dtype, a byte range of its shape's size that
    lies inside the file."""
    size = path.stat().st_size
    bad = lambda why: InteropError(f"'{path}' is not a readable safetensors file ({why})")
    try:
        with open(path, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))  # header length, then the JSON header
            if n > size - 8:
                raise bad(f"its header of {n} bytes is longer than the file: truncated?")
            header = json.loads(f.read(n))
    except (OSError, struct.error) as e:
        raise bad(e) from None
    except ValueError as e:
        raise bad(f"header: {e}") from None
    header.pop("__metadata__", None)
    data = size - 8 - n
    for name, info in header.items():
        where = f"tensor '{name}' in '{path}'"
        try:
            dtype, shape, (start, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (KeyError, TypeError, ValueError):
            raise InteropError(f"{where} has a malformed header entry {info!r:.80}") from None
        if dtype not in DTYPES:
            raise InteropError(
                f"{where} has dtype {dtype}, which moe_jax cannot read "
                f"(it reads {', '.join(DTYPES)})"
            )
        if end - start != DTYPES[dtype].itemsize * math.prod(shape) or start > end:
            raise InteropError(f"{where}: its byte range does not hold a {dtype} {shape} tensor")
        if end > data:
            raise InteropError(
                f"{where} ends at byte {end} of the data, but the file holds {data}: the file "
                "is truncated; download it again"
            )
    return 8 + n, header


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
