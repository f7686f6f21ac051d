"""A params-only checkpoint written one chunk at a time, never holding a whole parameter,
and any checkpoint's params read a region at a time.

    write_params_run(out_dir, meta, params_abstract, dtypes, fill, stacked, progress=None)
    arrays = CheckpointArrays(step_dir, params_abstract)   # .read(path, index), .dtype(path)

Orbax saves a pytree of arrays that already exist; an imported model that does not fit in
host memory has none. So the `params` item is written here directly with TensorStore, in
the layout Orbax reads (`StandardRestore` restores it onto any mesh, casting the dtype as it
goes): one zarr array per parameter named by its key path, `_METADATA` naming them, no
OCDBT. Each array is written in chunks (a layer of a stacked parameter, split further to at
most `CHUNK_BYTES`) that `fill(path, index)` makes on demand. The `meta` item (config,
tokenizer) is Orbax's own; there is no `opt_state` or `data` item: training starts from such
a checkpoint with a new optimizer state and the data from its start (`Checkpointer.restore`).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import orbax.checkpoint as ocp
import tensorstore as ts
from flax import nnx

from moe_jax.config import config_to_yaml
from moe_jax.run.checkpoints import _manager, keep_tokenizer_files
from moe_jax.run.layout import CHECKPOINT_DIR, CONFIG_FILE
from moe_jax.run.output import new_output

# At most this much of a parameter is made and written at once: one chunk, which is also
# what a reader of a region decodes (an export reads one expert at a time).
CHUNK_BYTES = 1 << 23
PARAMS_DIR = "params"


def _chunks(shape: tuple, itemsize: int, stacked: bool) -> tuple[int, ...]:
    """The zarr chunk shape of a parameter: one layer of a stacked one, and along the next
    axes as few rows as keep a chunk within CHUNK_BYTES."""
    chunk = list(shape)
    if stacked and chunk:
        chunk[0] = 1
    for axis in range(1 if stacked else 0, len(chunk)):
        rest = math.prod(chunk[axis + 1 :]) * itemsize
        if math.prod(chunk) * itemsize <= CHUNK_BYTES:
            break
        chunk[axis] = max(1, CHUNK_BYTES // max(rest, 1))
    return tuple(max(c, 1) for c in chunk)


def _zarr_dtype(dtype: np.dtype) -> str:
    return "bfloat16" if dtype == np.dtype(ml_dtypes.bfloat16) else dtype.str


def _key_name(key) -> str:
    for attr in ("key", "name", "idx"):  # DictKey, GetAttrKey, SequenceKey
        if hasattr(key, attr):
            return str(getattr(key, attr))
    raise TypeError(f"unexpected pytree key {key!r}")


def orbax_names(params_abstract) -> dict[tuple, tuple[str, ...]]:
    """Our param path -> the key names Orbax gives its leaf (nnx's `value` last): the zarr
    array's name is them joined by dots."""
    flat = list(nnx.to_flat_state(params_abstract))
    marked = nnx.from_flat_state([(p, v.copy(i)) for i, (p, v) in enumerate(flat)])
    names = {}
    for keypath, i in jax.tree_util.tree_flatten_with_path(marked)[0]:
        names[flat[i][0]] = tuple(_key_name(k) for k in keypath)
    return names


def write_params(item_dir: Path, params_abstract, dtypes: dict, fill, stacked, progress=None):
    """The `params` item: every parameter of `params_abstract` (an nnx State of abstract
    arrays) in dtype `dtypes[path]`, chunk by chunk from `fill(path, index)`."""
    item_dir.mkdir(parents=True)
    tree = {}
    shapes = {p: tuple(v.shape) for p, v in nnx.to_flat_state(params_abstract)}
    for path, names in sorted(orbax_names(params_abstract).items()):
        shape, dtype = shapes[path], dtypes[path]
        chunk = _chunks(shape, dtype.itemsize, stacked(path))
        spec = {
            "driver": "zarr",
            "kvstore": {"driver": "file", "path": str(item_dir / ".".join(names))},
            "metadata": {
                "shape": list(shape),
                "chunks": list(chunk),
                "dtype": _zarr_dtype(dtype),
                "compressor": None,
            },
        }
        array = ts.open(spec, create=True).result()
        for index in np.ndindex(*(math.ceil(n / c) for n, c in zip(shape, chunk, strict=True))):
            region = tuple(
                slice(i * c, min((i + 1) * c, n))
                for i, c, n in zip(index, chunk, shape, strict=True)
            )
            block = fill(path, region)
            array[region].write(block).result()
            if progress is not None:
                progress.add(block.nbytes)
        tree[str(names)] = {
            "key_metadata": [{"key": n, "key_type": 2} for n in names],
            "value_metadata": {
                "value_type": "jax.Array",
                "skip_deserialize": False,
                "write_shape": list(chunk),
            },
        }
    metadata = {
        "tree_metadata": tree,
        "use_ocdbt": False,
        "use_zarr3": False,
        "store_array_data_equal_to_fill_value": True,
        "custom_metadata": None,
    }
    (item_dir / "_METADATA").write_text(json.dumps(metadata))


def write_params_run(
    out_dir: Path,
    meta: dict,
    params_abstract,
    dtypes: dict,
    fill: Callable,
    stacked: Callable[[tuple], bool],
    progress=None,
) -> None:
    """A new run directory `out_dir` (written through a temporary sibling: whole or absent)
    with config.yaml, the tokenizer's files, and checkpoint 0 of the params only. `meta`: as
    `Checkpointer.save` takes it ("config", "tokenizer", "fingerprint", ...)."""
    with new_output(out_dir, f"--out '{out_dir}'") as tmp:
        (tmp / CONFIG_FILE).write_text(config_to_yaml(meta["config"]), encoding="utf-8")
        keep_tokenizer_files(tmp, meta["tokenizer"], checkpointed=False)
        saved = meta | {
            "step": 0,
            "config": config_to_yaml(meta["config"]),
            "tokenizer": meta["tokenizer"].to_dict(),
        }
        manager = _manager(tmp, enable_async_checkpointing=False)
        manager.save(0, args=ocp.args.Composite(meta=ocp.args.JsonSave(saved)))
        manager.close()
        write_params(
            tmp / CHECKPOINT_DIR / "0" / PARAMS_DIR,
            params_abstract,
            dtypes,
            fill,
            stacked,
            progress,
        )


class CheckpointArrays:
    """The params of a checkpoint (Orbax's, OCDBT or not, or `write_params`'), each read a
    region at a time through TensorStore: nothing is read before it is asked for."""

    def __init__(self, step_dir: Path, params_abstract):
        self.item = step_dir / PARAMS_DIR
        metadata = json.loads((self.item / "_METADATA").read_text())
        self.ocdbt, self.zarr3 = metadata.get("use_ocdbt", True), metadata.get("use_zarr3", False)
        # Every chunk was written (even one equal to the fill value): a missing one is damage,
        # not zeros, as Orbax's restore reads it.
        self.whole = metadata.get("store_array_data_equal_to_fill_value", False)
        self.names = {p: ".".join(n) for p, n in orbax_names(params_abstract).items()}
        self.shapes = {p: tuple(v.shape) for p, v in nnx.to_flat_state(params_abstract)}
        self._open: dict[tuple, ts.TensorStore] = {}

    def array(self, path: tuple) -> ts.TensorStore:
        if path not in self._open:
            name = self.names[path]
            if self.ocdbt:
                kvstore = {"driver": "ocdbt", "base": f"file://{self.item.absolute()}/"}
                spec = {"kvstore": kvstore, "path": name}
            else:
                spec = {"kvstore": {"driver": "file", "path": str(self.item / name)}}
            spec["driver"] = "zarr3" if self.zarr3 else "zarr"
            spec["fill_missing_data_reads"] = not self.whole
            self._open[path] = ts.open(spec, open=True, read=True).result()
        return self._open[path]

    def dtype(self, path: tuple) -> np.dtype:
        return np.dtype(self.array(path).dtype.numpy_dtype)

    def read(self, path: tuple, index: tuple) -> np.ndarray:
        return self.array(path)[index].read().result()


def unreadable(e: BaseException) -> bool:
    """Whether `e` is TensorStore's failure to read an array (a missing or truncated file):
    a ValueError whose text starts with its status (NOT_FOUND: ..., DATA_LOSS: ...)."""
    return isinstance(e, ValueError) and re.match(r"[A-Z_]+: ", str(e)) is not None
