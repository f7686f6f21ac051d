"""Safetensors checkpoints as NumPy arrays, one tensor at a time (no torch needed).

Reading: a Hugging Face checkpoint directory holds either `model.safetensors` or shards
listed in `model.safetensors.index.json` (`weight_map`: tensor name -> shard file). Each
tensor is memory-mapped from its byte range in its file, in its own dtype (bf16 and fp8
through `ml_dtypes`): a converter that slices it reads only the slice, and nothing is widened
to float32 on the way. The headers are parsed (and checked against the files' sizes) once.

Writing: `ShardWriter` appends each tensor to its shard's data file as it comes, gives a full
shard its header, and finally names the shards and the index the way `save_pretrained`
does: it holds one tensor at a time, whatever the model's size.
"""

from __future__ import annotations

import json
import math
import shutil
import struct
from collections.abc import Callable
from pathlib import Path

import ml_dtypes
import numpy as np

from moe_jax.errors import MoeJaxError
from moe_jax.interop.lazy import Deferred

WRITE_BYTES = 1 << 26  # a deferred tensor is computed and written this much at a time
INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class InteropError(MoeJaxError, ValueError):
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

    def __init__(self, directory: str | Path, rename: Callable[[str], str] | None = None):
        """`rename`: the name each stored tensor is read by (a multimodal checkpoint's text
        model under the names of its text-only architecture)."""
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
        rename = rename or (lambda name: name)
        self._stored = {rename(name): name for name in self._file_of}
        self._file_of = {rename(name): f for name, f in self._file_of.items()}

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
        self._check_float(name)
        return self.raw(name)

    def lazy(self, name: str) -> Deferred:
        """A float tensor not yet memory-mapped: only the regions used are (a tensor map that
        walks every expert of a layer while a converter keeps a few memory-maps those few)."""
        self._check_float(name)
        return Deferred(self.shape(name), lambda index: self.raw(name)[index], self.raw_dtype(name))

    def raw_dtype(self, name: str) -> np.dtype:
        return DTYPES[self.dtype(name)]

    def _check_float(self, name: str) -> None:
        dtype = self.dtype(name)
        if dtype not in FLOAT_DTYPES:
            raise InteropError(
                f"tensor '{name}' in '{self._file(name)}' has dtype {dtype}; only F32, F16 and "
                "BF16 tensors (and the FP8 / MXFP4 weights with their scales) can be imported"
            )

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
        return self._header(self._file(name))[1][self._stored[name]]

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

    Each tensor goes to disk as it is added (its bytes appended to the shard's data file;
    the shard gets its header when it is full), so the writer holds one tensor at a time.
    `dtype`: the dtype a tensor is written in unless `add` names its own (default float32).
    A tensor larger than
    the limit gets a shard of its own. `close()` names the files like `save_pretrained`: one
    `model.safetensors`, or `model-0000i-of-0000n.safetensors` and
    `model.safetensors.index.json`.
    """

    def __init__(self, directory: str | Path, max_shard_bytes: int, dtype=np.float32):
        self.directory = Path(directory)
        self.max_shard_bytes = max_shard_bytes
        self.dtype = np.dtype(dtype)
        self._entries: dict[str, dict] = {}  # the shard being written: name -> header entry
        self._data = None  # its data file, open
        self._shards: list[tuple[Path, list[str]]] = []
        self._names: set[str] = set()
        self.total_bytes = 0

    def add(self, name: str, array, dtype=None) -> None:
        """Write tensor `name` in `dtype` (default: the writer's): an array, or a
        `lazy.Deferred` (computed and written a block of rows at a time, so a large one is
        never whole in memory)."""
        if name in self._names:
            raise ValueError(f"tensor '{name}' written twice")
        if not isinstance(array, Deferred):
            array = np.asarray(array)
        dtype = self.dtype if dtype is None else np.dtype(dtype)
        shape, nbytes = tuple(array.shape), math.prod(array.shape) * dtype.itemsize
        size = sum(e["data_offsets"][1] - e["data_offsets"][0] for e in self._entries.values())
        if self._entries and size + nbytes > self.max_shard_bytes:
            self._flush()
        if self._data is None:
            self._data = open(self._path(len(self._shards), ".data"), "wb")  # noqa: SIM115
            size = 0
        code = next(k for k, v in DTYPES.items() if v == dtype)
        entry = {"dtype": code, "shape": list(shape), "data_offsets": [size, size + nbytes]}
        self._entries[name] = entry
        row_bytes = math.prod(shape[1:]) * dtype.itemsize if shape else nbytes
        step = max(1, WRITE_BYTES // max(row_bytes, 1))
        for start in range(0, shape[0], step) if shape else [None]:
            part = array if start is None else array[start : start + step]
            part = np.ascontiguousarray(np.asarray(part), dtype=dtype)
            self._data.write(part.reshape(-1).view(np.uint8).data)
        self._names.add(name)
        self.total_bytes += nbytes

    def _path(self, i: int, suffix: str) -> Path:
        return self.directory / f"shard-{i:05d}{suffix}"

    def _flush(self) -> None:
        """The shard whole: its header, then its data (copied from the data file)."""
        path, data = self._path(len(self._shards), ".tmp"), self._path(len(self._shards), ".data")
        if self._data is not None:
            self._data.close()
            self._data = None
        else:
            data.write_bytes(b"")
        header = json.dumps({"__metadata__": {"format": "pt"}, **self._entries}).encode()
        header += b" " * (-len(header) % 8)
        with open(path, "wb") as out, open(data, "rb") as src:
            out.write(struct.pack("<Q", len(header)) + header)
            shutil.copyfileobj(src, out, 1 << 20)
        data.unlink()
        self._shards.append((path, list(self._entries)))
        self._entries = {}

    def close(self) -> None:
        if self._entries or not self._shards:
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
