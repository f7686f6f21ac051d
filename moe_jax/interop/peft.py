"""LoRA adapters in PEFT's format, both ways, and merged into a streaming export.

    export_adapter(run_dir, out)       # out/adapter_model.safetensors + adapter_config.json
    save_adapter(cfg, params, out)     # the same, of params in memory
    pairs = adapters_from_peft(cfg, adapter_dir)  # {our A / B path: array}: a PEFT adapter read
    read = merged_reader(read, shapes, scale)     # interop.export: W + (alpha / r) A B

An adapter comes onto a run or a Hugging Face directory as a new run starts from it:
`train.py init_from=BASE lora.init_adapter=ADAPTER_DIR` (`posttrain.lora.start_adapters`).

PEFT names a Linear's pair `base_model.model.<module>.lora_A.weight` [r, in] and
`...lora_B.weight` [out, r], with update x A^T B^T (alpha / r). Our pair is A [in..., r],
B [r, out...] for a weight [in..., out...], the Linear's transpose: the family's own tensor
map for the weight (`interop.common.linear`: [in..., out...] <-> [out, in]) maps A as a
weight of `in` inputs and r outputs, and B as one of r inputs (its output dims after
size-1 input dims), so every family that writes the weight as one Linear gets PEFT's
names and layout from its own mapping. The routed experts' stacked pairs go out through
the families' per-expert tensor map the same way, one Linear's pair per expert
(`mlp.experts.{e}.gate_proj` for Qwen-MoE, `block_sparse_moe.experts.{e}.w1` for Mixtral):
the names vLLM reads, which PEFT folds into its adapter of transformers' fused experts.
Each pair is checked: the tensor map applied to A B must give lora_B lora_A, which refuses a
weight whose Hugging Face form is not a Linear per weight (or per expert: gpt-oss's fused,
biased experts), to be exported merged instead (`python -m moe_jax.interop export`).
Reading an adapter back applies the same tensor map to arrays of their own flat indices: where
each index lands says where each PEFT entry goes.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from flax import nnx

from moe_jax.config import Config
from moe_jax.interop.convert import _placements, pick_family
from moe_jax.interop.lazy import Deferred
from moe_jax.interop.safetensors_io import SINGLE_FILE, InteropError, ShardWriter, TensorReader
from moe_jax.model import Transformer
from moe_jax.model.lora import PREFIX, product
from moe_jax.run.checkpoints import open_checkpoints, read_meta
from moe_jax.run.layout import CHECKPOINT_DIR
from moe_jax.run.output import new_output
from moe_jax.run.stream_save import CheckpointArrays

WEIGHTS_FILE = "adapter_model.safetensors"
CONFIG_FILE = "adapter_config.json"
PEFT_PREFIX = "base_model.model."


def adapter_of(path: tuple) -> tuple:
    """The adapter's path of a weight's path (`.../attn/wq` -> `.../attn/lora_wq`)."""
    return path[:-1] + (PREFIX + path[-1],)


def _n_lead(path: tuple) -> int:
    """A block's adapter's leading dims before its input: the routed experts' axis."""
    return 1 if len(path) >= 2 and path[-2] == "experts" else 0


def merged_reader(read, shapes: dict, scale: float):
    """`read(path, block)` (`interop.export`'s: a Deferred param, or one layer of a stacked
    one) with each adapted weight read as W + `scale` A B in float32, computed where used."""

    def merged(path: tuple, block):
        w = read(path, block)
        ad = adapter_of(path)
        if ad + ("a",) not in shapes:
            return w
        ab = product(np.asarray(read(ad + ("a",), block)), np.asarray(read(ad + ("b",), block)),
                     _n_lead(path))  # fmt: skip
        compute = lambda index: np.asarray(w.compute(index), np.float32) + scale * ab[index]
        return Deferred(w.shape, compute, np.float32)

    return merged


def _b_as_weight(b, n_in: int, lead: int):
    """B [lead..., r, out...] as a weight of r inputs whose tensor map expects `n_in` input dims
    (size-1 dims after the rank)."""
    return b.reshape(b.shape[: lead + 1] + (1,) * (n_in - 1) + b.shape[lead + 1 :])


def _pairs(
    tensor_map, paths, a_list, b_list, where: str
) -> list[tuple[str, np.ndarray, np.ndarray]]:
    """[(a Linear's module name, lora_A [r, in], lora_B [out, r])] of our pairs (A [lead...,
    in..., r], B [lead..., r, out...] for each of the tensor map's weights) through the tensor
    map: A as a weight of r outputs, B as one of r inputs, checked against the tensor map
    applied to A B (which must give lora_B lora_A under the same name); InteropError where it
    does not."""
    leads = [_n_lead(p) for p in paths]
    bs = [_b_as_weight(b, a.ndim - 1 - k, k) for a, b, k in zip(a_list, b_list, leads, strict=True)]
    try:
        got_a = [(n, np.asarray(t)) for n, t in tensor_map.save(*a_list)]
        got_b = [(n, np.asarray(t)) for n, t in tensor_map.save(*bs)]
        abs_ = [product(a, b, k) for a, b, k in zip(a_list, b_list, leads, strict=True)]
        got_w = [(n, np.asarray(t)) for n, t in tensor_map.save(*abs_)]
    except (ValueError, TypeError):
        got_a = got_b = got_w = []
    out = []
    for (na, la), (nb, lb), (nw, w) in zip(got_a, got_b, got_w, strict=False):
        ok = na == nb == nw and na.endswith(".weight") and la.ndim == lb.ndim == 2
        ok = ok and w.shape == (lb.shape[0], la.shape[1])
        tol = 1e-6 * max(1.0, float(np.abs(w).max())) if ok else 0
        if not (ok and np.allclose(w, lb @ la, rtol=1e-4, atol=tol)):
            got_a = []
            break
        out.append((na[: -len(".weight")], la, lb))
    if not got_a or len(out) != len(got_w):
        raise InteropError(
            f"{where}: its Hugging Face form is not a Linear (or one per expert); export it merged"
        )
    return out


def _adapted_maps(cfg: Config, family, shapes: dict):
    """(tensor name prefix, tensor map, its weights' paths, block, where) of every tensor map
    whose weights have adapters; InteropError where only some of a tensor map's weights have
    them."""
    for prefix, tensor_map, paths, block in _placements(cfg, family):
        adapted = [adapter_of(p) + ("a",) in shapes for p in paths]
        if not any(adapted):
            continue
        where = ".".join(map(str, paths[0])) + ("" if block is None else f" (block {block})")
        if not all(adapted):
            raise InteropError(
                f"{where}: one Hugging Face tensor group holds weights with and without "
                "adapters; adapt all of them (lora.targets) or export the run merged"
            )
        yield prefix, tensor_map, paths, block, where


def export_adapter(
    run_dir: str | Path, out: str | Path, step: int | None = None, architecture: str | None = None
) -> tuple[str, Config]:
    """Write the adapters of checkpoint `step` (default: the latest) of a LoRA run as the
    PEFT adapter directory `out` (through a temporary sibling: whole or absent), for the
    Hugging Face architecture of `interop export` (or `architecture`). -> (it, the config)."""
    run_dir, out = Path(run_dir), Path(out)
    manager, step = open_checkpoints(run_dir, step)
    try:
        cfg = read_meta(manager, step, run_dir)["config"]
    finally:
        manager.close()
    if cfg.lora.rank == 0:
        raise InteropError(f"'{run_dir}' has no LoRA adapters (lora.rank is 0); export it whole")
    abstract = nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    arrays = CheckpointArrays(run_dir / CHECKPOINT_DIR / str(step), abstract)

    def read(path, block):
        lead = () if block is None else (block,)
        shape = arrays.shapes[path][len(lead) :]
        return arrays.read(path, lead + tuple(slice(0, n) for n in shape))

    return _write_adapter(cfg, read, arrays.shapes, out, architecture), cfg


def save_adapter(cfg: Config, params, out: str | Path, architecture: str | None = None) -> str:
    """`export_adapter` of params in memory (a model's `nnx.State` of params with adapters).
    -> the architecture whose names it uses."""
    flat = {p: v[...] for p, v in nnx.to_flat_state(params)}
    read = lambda p, block: np.asarray(flat[p] if block is None else flat[p][block])
    return _write_adapter(cfg, read, {p: a.shape for p, a in flat.items()}, out, architecture)


def _write_adapter(cfg: Config, read, shapes: dict, out, architecture) -> str:
    family, _ = pick_family(cfg, architecture)
    tensors, modules = {}, set()
    for prefix, tensor_map, paths, block, where in _adapted_maps(cfg, family, shapes):
        a_list = [read(adapter_of(p) + ("a",), block) for p in paths]
        b_list = [read(adapter_of(p) + ("b",), block) for p in paths]
        for name, lora_a, lora_b in _pairs(tensor_map, paths, a_list, b_list, where):
            tensors[f"{PEFT_PREFIX}{prefix}{name}.lora_A.weight"] = lora_a
            tensors[f"{PEFT_PREFIX}{prefix}{name}.lora_B.weight"] = lora_b
            modules.add(name.rsplit(".", 1)[-1])
    _write(Path(out), tensors, _adapter_config(cfg, sorted(modules)))
    return family.architecture


def _adapter_config(cfg: Config, modules: list[str]) -> dict:
    """PEFT's LoraConfig for these adapters. target_modules by their last name, as PEFT
    writes them: a module of that name the file holds no pair for (say a shared expert's
    gate_proj where only the dense MLPs were adapted) gets PEFT's fresh pair, B = 0,
    which changes nothing."""
    lc = cfg.lora
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": lc.rank,
        "lora_alpha": lc.alpha,
        "lora_dropout": lc.dropout,
        "target_modules": modules,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "inference_mode": True,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "base_model_name_or_path": None,
    }


def _write(out: Path, tensors: dict, config: dict) -> None:
    with new_output(out, f"'{out}'") as tmp:
        writer = ShardWriter(tmp, max_shard_bytes=1 << 62)
        for name in sorted(tensors):
            writer.add(name, tensors[name])
        writer.close()
        (tmp / SINGLE_FILE).rename(tmp / WEIGHTS_FILE)
        (tmp / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")


def read_adapter_config(adapter_dir: Path) -> dict:
    """adapter_config.json, checked to be a plain LoRA that our adapters can hold."""
    path = adapter_dir / CONFIG_FILE
    if not path.is_file():
        raise InteropError(f"no {CONFIG_FILE} in '{adapter_dir}': not a PEFT adapter directory")
    try:
        conf = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise InteropError(f"'{path}' is not valid JSON ({e})") from None
    if conf.get("peft_type") != "LORA":
        raise InteropError(f"'{path}' holds a {conf.get('peft_type')} adapter; only LORA is read")
    for key, plain in (("use_rslora", False), ("use_dora", False), ("fan_in_fan_out", False),
                       ("rank_pattern", {}), ("alpha_pattern", {}), ("bias", "none")):  # fmt: skip
        if conf.get(key, plain) not in (plain, None):
            raise InteropError(f"'{path}' sets {key}={conf[key]!r}, which moe_jax has no form for")
    if conf.get("modules_to_save"):
        raise InteropError(f"'{path}' trains whole modules too (modules_to_save); not supported")
    return conf


def adapters_from_peft(cfg: Config, adapter_dir: Path, architecture: str | None = None) -> dict:
    """{adapter leaf path (ours): array} of a PEFT adapter for the model of `cfg` (whose lora
    section says which weights have adapters), each pair read through its weight's tensor map;
    InteropError for a pair the model has no place for, or a place the file does not fill."""
    conf = read_adapter_config(adapter_dir)
    if (int(conf.get("r", 0)), float(conf.get("lora_alpha", 0))) != (cfg.lora.rank, cfg.lora.alpha):
        raise InteropError(
            f"'{adapter_dir}' holds r={conf.get('r')}, lora_alpha={conf.get('lora_alpha')}; set "
            f"lora.rank and lora.alpha to those (they are {cfg.lora.rank}, {cfg.lora.alpha})"
        )
    family, _ = pick_family(cfg, architecture)
    abstract = nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    shapes = {p: tuple(v.shape) for p, v in nnx.to_flat_state(abstract)}
    reader = TensorReader(adapter_dir)
    names, used, out = set(reader.names()), set(), {}
    for prefix, tensor_map, paths, block, where in _adapted_maps(cfg, family, shapes):
        lead = 0 if block is None else 1
        for leaf, side in (("a", "A"), ("b", "B")):
            want = [shapes[adapter_of(p) + (leaf,)][lead:] for p in paths]
            n_ins = [len(shapes[adapter_of(p) + ("a",)]) - lead - 1 - _n_lead(p) for p in paths]
            read = _peft_reader(reader, f"{PEFT_PREFIX}{prefix}", side, adapter_dir, where, used)
            arrays = _placed(tensor_map, paths, want, n_ins if leaf == "b" else None, where, read)
            for p, x in zip(paths, arrays, strict=True):
                out.setdefault(adapter_of(p) + (leaf,), {})[block] = x
    if names - used:
        extra = sorted(names - used)[0]
        raise InteropError(
            f"'{adapter_dir}' has {len(names - used)} tensor(s) with no adapter here, e.g. "
            f"'{extra}'; set lora.targets to the layers it adapts"
        )
    # a layer of the stack per block, stacked in block order; an unstacked layer's as it is
    stack = lambda by_block: (
        by_block[None] if None in by_block else np.stack([by_block[i] for i in sorted(by_block)])
    )
    return {p: stack(by_block) for p, by_block in out.items()}


def _peft_reader(reader: TensorReader, prefix: str, side: str, adapter_dir, where, used):
    """module name -> its lora_{side} tensor (float32), recorded as used."""

    def read(module: str, shape: tuple) -> np.ndarray:
        name = f"{prefix}{module}.lora_{side}.weight"
        if not reader.has(name):
            raise InteropError(f"'{adapter_dir}' has no tensor '{name}' (for {where})")
        if reader.shape(name) != tuple(shape):
            raise InteropError(
                f"tensor '{name}' has shape {list(reader.shape(name))}; this model's adapter "
                f"(lora.rank) needs {list(shape)}"
            )
        used.add(name)
        return reader.get(name).astype(np.float32)

    return read


def _placed(tensor_map, paths, shapes: list, n_ins, where: str, read) -> list[np.ndarray]:
    """Our A (or, with `n_ins`, its weights' input dims, B) arrays of `shapes` for the tensor
    map's weights, from PEFT's tensors: the tensor map
    applied to arrays of their own flat indices says where each tensor's entries go (it only
    moves entries: transposes, reshapes, one matrix per expert)."""
    sizes = [int(np.prod(s)) for s in shapes]
    starts = np.concatenate([[0], np.cumsum(sizes)])
    index = [np.arange(a, a + n, dtype=np.float64).reshape(s)
             for a, n, s in zip(starts[:-1], sizes, shapes, strict=True)]  # fmt: skip
    if n_ins is not None:  # B: a weight of r inputs
        index = [
            _b_as_weight(x, n, _n_lead(p)) for x, n, p in zip(index, n_ins, paths, strict=True)
        ]
    flat = np.full(starts[-1], np.nan, np.float32)
    for name, idx in tensor_map.save(*index):
        idx = np.asarray(idx)
        flat[idx.astype(np.int64)] = read(name[: -len(".weight")], idx.shape)
    if np.isnan(flat).any():
        raise InteropError(f"{where}: the adapter does not fill this model's pairs")
    return [flat[a:b].reshape(s) for a, b, s in zip(starts[:-1], starts[1:], shapes, strict=True)]
