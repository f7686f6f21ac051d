"""Streaming import: Hugging Face tensors -> our parameters, one slice at a time.

The family tensor maps (`common.TensorMap.load(src, *outs)`) say how HF tensors become our
arrays. Here their outputs are never whole-model buffers: each `out` a tensor map writes is a
`Window`, which keeps only the slice of that array being built (one device's shard, one layer
of a stacked parameter, one chunk of a checkpoint write) and ignores the rest. The tensors
arrive as memory maps in their own dtype (`TensorReader`), so assigning `tensor.T[window]`
reads just the bytes of that window from disk; the host holds about one slice plus a fixed
cost, whatever the model's size.

    plan = ImportPlan(reader, cfg, family, prefix, dtype="source")   # checks every tensor
    plan.fill(path, index) -> np.ndarray          # any slice of one of our parameters
    arrays = plan.to_devices(shardings)           # jax.Arrays, each process its own shards

`ImportPlan` runs every tensor map once with empty windows before anything is read in bulk: that
finds a missing tensor, a wrong shape or dtype, and each parameter's dtype (the source's:
bf16 stays bf16), so an error surfaces before any output exists.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from moe_jax.interop.common import Source, TensorMap
from moe_jax.interop.safetensors_io import InteropError, TensorReader

# A stacked parameter whose shard is larger than this is placed one layer at a time (into a
# donated device buffer); smaller ones in one piece, saving a compile per parameter.
STACK_PIECE_BYTES = 1 << 24
DTYPES = {"float32": np.dtype(np.float32), "bfloat16": np.dtype(ml_dtypes.bfloat16)}
_FLOATS = {np.dtype(t) for t in (np.float64, np.float32, np.float16, ml_dtypes.bfloat16)}


def _norm(index: tuple, shape: tuple) -> tuple[slice, ...]:
    """`index` (slices, possibly open or shorter than `shape`) as closed slices of `shape`."""
    index = tuple(index) + (slice(None),) * (len(shape) - len(index))
    return tuple(slice(*s.indices(n)[:2]) for s, n in zip(index, shape, strict=True))


def _extent(index: tuple[slice, ...]) -> tuple[int, ...]:
    return tuple(s.stop - s.start for s in index)


class Window:
    """One output of a tensor map: an array of `shape` of which only `index` is kept, in `buf`
    (None: nothing kept, only the dtypes of the values recorded)."""

    def __init__(self, shape: tuple, index: tuple[slice, ...], buf: np.ndarray | None):
        self.shape, self.index, self.buf = tuple(shape), index, buf
        self.size, self.ndim = math.prod(shape), len(shape)
        self.dtypes: set[np.dtype] = set()

    def __setitem__(self, key, value) -> None:
        self.dtypes.add(np.dtype(value.dtype))
        if self.buf is None:
            return
        # np.asarray: a memory map's slice is read, a deferred FP8 weight's computed, here
        if key is Ellipsis:
            self.buf[...] = np.asarray(value[self.index])
        elif isinstance(key, int):  # one row of the leading axis (an expert)
            rows = self.index[0]
            if rows.start <= key < rows.stop:
                self.buf[key - rows.start] = np.asarray(value[self.index[1:]])
        else:
            raise TypeError(
                f"a tensor map wrote out[{key!r}]; tensor maps write out[...] or out[i]"
            )


@dataclass(frozen=True)
class Piece:
    """One tensor map applied at one place: HF names under `prefix`, outputs `paths` (ours)."""

    prefix: str
    tensor_map: TensorMap
    paths: tuple[tuple, ...]
    block: int | None  # the index into the stacked block axis, or None


class ImportPlan:
    """Where every parameter of ours comes from, checked; see the module doc.

    `placements`: (name prefix, tensor map, our param paths, block index) as `convert._placements`
    yields them; `shapes`: our params' shapes; `dtype`: "source" (each parameter in the
    dtype its HF tensors have: bf16 stays bf16; decoded FP8/MXFP4 weights are bf16),
    "float32" or "bfloat16". `finite`: every tensor checked for NaN and inf as it is read
    (`finite.checked_finite`; an MXFP4 weight as it is decoded)."""

    def __init__(
        self, reader: TensorReader, prefix: str, placements, shapes: dict, dtype: str,
        finite: bool = True,
    ):  # fmt: skip
        if dtype != "source" and dtype not in DTYPES:
            raise InteropError(f"dtype '{dtype}': choose source, float32 or bfloat16")
        self.reader, self.prefix, self.shapes, self.finite = reader, prefix, shapes, finite
        self.used: set[str] = set()
        self.pieces: dict[tuple, dict[int | None, tuple[Piece, int]]] = {}
        # tensor maps that only check copies of params made elsewhere
        self.checks: list[Piece] = []
        for name_prefix, tensor_map, paths, block in placements:
            piece = Piece(name_prefix, tensor_map, tuple(paths), block)
            if paths and all(block in self.pieces.get(p, {}) for p in paths):
                self.checks.append(piece)
                continue
            for j, p in enumerate(paths):
                self.pieces.setdefault(p, {})[block] = (piece, j)
        missing = sorted(set(shapes) - set(self.pieces))
        assert not missing, f"no tensor map makes {missing}"
        # Every piece once with empty windows: shapes checked, names recorded, nothing read.
        seen: dict[tuple, set] = {p: set() for p in self.pieces}
        for piece in {id(pc): pc for by in self.pieces.values() for pc, _ in by.values()}.values():
            for p, dtypes in zip(piece.paths, self._probe(piece), strict=True):
                seen[p] |= dtypes
        self.dtypes = {p: _dtype_of(p, seen[p], dtype) for p in sorted(self.pieces)}

    def stacked(self, path: tuple) -> bool:
        return None not in self.pieces[path]

    def nbytes(self, path: tuple) -> int:
        return math.prod(self.shapes[path]) * self.dtypes[path].itemsize

    def _layer_shape(self, path: tuple) -> tuple:
        shape = self.shapes[path]
        return shape[1:] if self.stacked(path) else shape

    def _window(self, path: tuple, index: tuple | None = None, buf=None) -> Window:
        """A window on one layer of `path` (None: an empty one, for probing)."""
        shape = self._layer_shape(path)
        empty = (slice(0, 0),) * len(shape)
        return Window(shape, _norm(empty if index is None else index, shape), buf)

    def _probe(self, piece: Piece) -> list[set]:
        """The dtypes `piece`'s tensor map gives each of its outputs (read nothing)."""
        outs = [self._window(p) for p in piece.paths]
        self._load(piece, outs)
        return [o.dtypes for o in outs]

    def _load(self, piece: Piece, outs: list) -> None:
        src = Source(self.reader, self.prefix + piece.prefix, self.used, self.finite)
        piece.tensor_map.load(src, *outs)

    def _run(self, piece: Piece, j: int, window: Window) -> None:
        """Run `piece`'s tensor map keeping only output `j`, in `window`."""
        outs = [self._window(p) for p in piece.paths]
        outs[j] = window
        self._load(piece, outs)

    def fill(self, path: tuple, index: tuple) -> np.ndarray:
        """Our parameter `path`'s slice `index` (a tuple of slices), in its dtype."""
        shape = self.shapes[path]
        index = _norm(index, shape)
        out = np.empty(_extent(index), self.dtypes[path])
        if not self.stacked(path):
            piece, j = self.pieces[path][None]
            self._run(piece, j, Window(shape, index, out))
            return out
        for b in range(index[0].start, index[0].stop):
            piece, j = self.pieces[path][b]
            self._run(piece, j, Window(shape[1:], index[1:], out[b - index[0].start]))
        return out

    def run_checks(self) -> None:
        """The tensor maps that check a copy against a parameter made elsewhere (the MTP layers'
        embedding and head): each given that parameter whole (one tensor's worth)."""
        for piece in self.checks:
            mains = [self.fill(p, ()) for p in piece.paths]
            self._load(piece, mains)

    def unused(self, ignore: Callable[[str], bool]) -> list[str]:
        """The checkpoint's tensors under our prefix that no tensor map read (and `ignore`
        passes)."""
        names = self.reader.names()
        return [
            n for n in names if n.startswith(self.prefix) and n not in self.used and not ignore(n)
        ]

    def to_devices(self, shardings: dict, progress: Progress | None = None) -> dict:
        """{path: jax.Array} for each param `shardings` names (path -> Sharding), laid out so;
        each process builds only the shards its devices hold, and a large stacked parameter
        one layer at a time."""
        return to_devices(shardings, self.shapes, self.dtypes, self.stacked, self.fill, progress)


def to_devices(
    shardings: dict, shapes: dict, dtypes: dict, stacked: Callable[[tuple], bool],
    fill: Callable[[tuple, tuple], np.ndarray], progress: Progress | None = None,
) -> dict:  # fmt: skip
    """{path: jax.Array} of `shapes[path]`, `dtypes[path]` for each param `shardings` names
    (path -> Sharding), its values `fill(path, index)`, one parameter in turn: each process
    builds only the shards its devices hold, and a large `stacked` parameter one layer at a
    time. Used wherever weights are read onto devices (an HF directory, a run's checkpoint),
    so that the host holds one parameter's (or layer's) values at a time, not the model's."""
    arrays = {}
    for path in sorted(shardings):
        sharding, shape = shardings[path], shapes[path]
        per_shard = math.prod(sharding.shard_shape(shape)) * dtypes[path].itemsize
        if stacked(path) and shape[0] > 1 and per_shard > STACK_PIECE_BYTES:
            arrays[path] = _by_layer(shape, dtypes[path], sharding, lambda i, p=path: fill(p, i))
        else:
            # A host buffer lives until its copy to the device has run, and dispatch does
            # not wait for that: unwaited, a loaded host holds every tensor in flight.
            arrays[path] = jax.make_array_from_callback(
                shape, sharding, lambda idx, p=path: fill(p, idx)
            ).block_until_ready()
        if progress is not None:
            progress.add(math.prod(shape) * dtypes[path].itemsize)
    return arrays


def _by_layer(shape: tuple, dtype, sharding, fill: Callable) -> jax.Array:
    layer_sharding = _drop_leading_axis(sharding, len(shape))
    stack = _zeros(shape, jnp.dtype(dtype), sharding)
    for b in range(shape[0]):
        layer = jax.make_array_from_callback(
            shape[1:],
            layer_sharding,
            lambda idx, b=b: fill((slice(b, b + 1), *idx))[0],
        )
        stack = _put_layer(stack, layer, b).block_until_ready()  # one layer in flight
    return stack


def _dtype_of(path: tuple, seen: set, dtype: str) -> np.dtype:
    """A parameter's dtype: `dtype`, or for "source" the one its tensor map's values have."""
    if seen - _FLOATS:
        raise InteropError(f"parameter {'.'.join(map(str, path))} decodes to {seen - _FLOATS}")
    if dtype != "source":
        return DTYPES[dtype]
    return np.result_type(*seen) if seen else np.dtype(np.float32)


def _drop_leading_axis(sharding, ndim: int):
    """The sharding of one layer of a stacked array laid out by `sharding`."""
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = tuple(sharding.spec) + (None,) * (ndim - len(sharding.spec))
        if spec[0] is not None:
            raise InteropError(f"a stacked parameter sharded along its layer axis ({spec})")
        return jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec[1:]))
    return sharding


@functools.lru_cache(maxsize=64)
def _zeros_fn(shape: tuple, dtype, sharding):
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


def _zeros(shape, dtype, sharding) -> jax.Array:
    return _zeros_fn(tuple(shape), dtype, sharding)()


@functools.partial(jax.jit, donate_argnums=0)
def _put_layer(stack: jax.Array, layer: jax.Array, b) -> jax.Array:
    """`stack` with row b replaced by `layer`, in place (the stack's buffer is donated)."""
    return jax.lax.dynamic_update_index_in_dim(stack, layer, b, 0)


class Progress:
    """One line on `write` (stderr) with bytes done, rate and ETA, at most every `every_s`
    seconds, and a last line when done."""

    def __init__(self, total: int, what: str, write: Callable[[str], None], every_s: float = 2.0):
        self.total, self.what, self.write, self.every_s = total, what, write, every_s
        self.done, self.start = 0, time.monotonic()
        self._last = self.start

    def add(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if now - self._last >= self.every_s or self.done >= self.total:
            self._last = now
            self.write(self.line(now))

    def line(self, now: float) -> str:
        elapsed = max(now - self.start, 1e-9)
        rate = self.done / elapsed
        eta = (self.total - self.done) / rate if rate > 0 else 0.0
        unit, size = ("GiB", 2**30) if self.total >= 2**30 else ("MiB", 2**20)
        return (
            f"{self.what}: {self.done / size:.2f} / {self.total / size:.2f} {unit}, "
            f"{rate / 2**20:.0f} MiB/s, {elapsed:.0f} s elapsed, ETA {eta:.0f} s"
        )
