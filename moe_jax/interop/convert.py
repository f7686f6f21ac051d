"""`load_hf` / `save_hf`: Hugging Face checkpoint directory <-> (Config, Transformer).

Import streams (`stream.py`): each parameter of ours, or each shard or layer of it, is made
from the memory-mapped HF tensors in their own dtype as it is placed on its devices or
written, so the host holds about one tensor at a time. Export writes per-layer slices of
our (possibly stacked) parameters into size-capped safetensors shards.

Multi-token prediction (`model.mtp_depth`, families with `Family.mtp_maps`: DeepSeek-V3 and
GLM-4.5) travels both ways as the layers after the main ones, `model.layers.{n_layers + k}`:
an import takes the depth config.json gives (`num_nextn_predict_layers`) where the checkpoint
holds those layers, and 0 where it holds none of them (`save_pretrained` of transformers,
which does not run them, writes none though its config.json says 1) or the caller drops them
(`mtp=False`: their tensors are skipped unread).
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
from flax import nnx

from moe_jax.config import Config, ConfigError, validate
from moe_jax.interop import (
    deepseek,
    dsa,
    fp8,
    glm4_moe,
    gpt_oss,
    llama,
    llama4,
    mixtral,
    qwen3,
    qwen3_next,
)
from moe_jax.interop.common import Family, HFConfig, top_maps
from moe_jax.interop.safetensors_io import INDEX_FILE, InteropError, ShardWriter, TensorReader
from moe_jax.interop.stream import ImportPlan, Progress
from moe_jax.model import Transformer
from moe_jax.run.output import new_output
from moe_jax.tokenizer import Tokenizer
from moe_jax.tokenizer.as_hf import hf_files

FAMILIES: dict[str, Family] = {
    f.architecture: f
    for f in (
        llama4.FAMILY,
        mixtral.FAMILY,
        qwen3.MOE,
        gpt_oss.FAMILY,
        deepseek.FAMILY,
        dsa.V32,
        dsa.GLM5,
        glm4_moe.FAMILY,
        qwen3_next.NEXT,
        qwen3_next.QWEN35,
        llama.FAMILY,
        qwen3.DENSE,
    )
}
DEFAULT_SHARD_BYTES = 2 * 1024**3
# Tensors a checkpoint may carry that mean nothing to the model (old Llama checkpoints saved
# the RoPE frequencies, which we recompute from config.json).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def read_hf_config(directory: str | Path) -> tuple[Family, HFConfig, str]:
    """(family, config.json with the family's defaults, tensor name prefix) of a checkpoint."""
    path = Path(directory) / "config.json"
    if not path.is_file():
        raise InteropError(f"no config.json in '{directory}': not a Hugging Face model directory")
    try:
        values = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as e:
        raise InteropError(f"'{path}' is not valid JSON ({e})") from None
    if not isinstance(values, dict):
        raise InteropError(f"'{path}' must hold a JSON object of settings, not {values!r:.40}")
    architectures = values.get("architectures") or []
    if isinstance(architectures, str):  # a hand-written config may give the one name bare
        architectures = [architectures]
    if not isinstance(architectures, list) or not all(isinstance(a, str) for a in architectures):
        raise InteropError(f"'{path}' has architectures={architectures!r}: give a list of names")
    if not architectures:
        by_type = {f.model_type: a for a, f in FAMILIES.items()}
        architectures = [by_type.get(values.get("model_type"), values.get("model_type"))]
    arch = architectures[0]
    prefix = ""
    if arch == llama4.MULTIMODAL_ARCH:  # the text model of a multimodal Llama 4 checkpoint
        values, arch = values.get("text_config") or {}, llama4.ARCH
        prefix = llama4.MULTIMODAL_PREFIX
    if arch == qwen3_next.MULTIMODAL_ARCH:  # Qwen3.5's (tensor names: `_reader`)
        values, arch = qwen3_next.text_values(values), qwen3_next.QWEN35_ARCH
    if arch not in FAMILIES:
        supported = ", ".join([*FAMILIES, llama4.MULTIMODAL_ARCH, qwen3_next.MULTIMODAL_ARCH])
        raise InteropError(f"unsupported architecture '{arch}' in '{path}'; supported: {supported}")
    _check_quantization(values.get("quantization_config"), arch, path)
    family = FAMILIES[arch]
    return family, HFConfig(values, family.defaults, arch), prefix


def _reader(directory: str | Path) -> TensorReader:
    """The checkpoint's tensors, a multimodal Qwen3.5's under its text model's names (its
    config.json already read by `read_hf_config`)."""
    values = json.loads((Path(directory) / "config.json").read_text(encoding="utf-8"))
    architectures = values.get("architectures") or []
    arch = architectures if isinstance(architectures, str) else (architectures or [None])[0]
    rename = qwen3_next.text_name if arch == qwen3_next.MULTIMODAL_ARCH else None
    return TensorReader(directory, rename)


def _check_quantization(quant, arch: str, path: Path) -> None:
    """The quantised forms an import reads: gpt-oss's MXFP4 experts, and FP8 e4m3 weights in
    128 x 128 blocks (DeepSeek-V3, Kimi K2: `interop.fp8`); any other is refused."""
    if not quant:
        return
    method = quant.get("quant_method") if isinstance(quant, dict) else None
    if method == gpt_oss.QUANT_METHOD and arch == gpt_oss.ARCH:
        return
    if method == "fp8":
        fmt, block = quant.get("fmt", "e4m3"), quant.get("weight_block_size")
        if fmt == "e4m3" and block is not None and tuple(block) == fp8.BLOCK:
            return
        raise InteropError(
            f"'{path}' holds FP8 weights as fmt={fmt!r}, weight_block_size={block}; moe_jax "
            f"reads e4m3 in {list(fp8.BLOCK)} blocks (DeepSeek-V3's form) only"
        )
    raise InteropError(
        f"'{path}' describes a quantized checkpoint (quantization_config {method!r}); only float "
        "checkpoints, FP8 block-quantised weights and gpt-oss's MXFP4 experts can be imported; "
        "dequantize it first"
    )


def config_from_hf(
    directory: str | Path, base: Config | None = None, *, mtp: bool = True
) -> Config:
    """Our config for a HF checkpoint: its architecture over `base` (default: `Config()`),
    whose other sections (train, data, mesh, ...) and run-time model keys (dtype,
    scan_layers) are kept. The MoE capacity factor is 0: no token is ever dropped, as in
    transformers. `train.seq_len` is capped at the model's context. Training-only HF settings
    (dropout, router jitter) have no counterpart here; `router_aux_loss_coef` x top_k becomes
    `moe.lb_loss_weight`. `model.mtp_depth` is what `load_hf` imports (the module doc): 0
    with `mtp=False` or where the checkpoint's tensors hold no MTP layer (a directory of
    config.json alone: config.json's depth)."""
    family, hf, prefix = read_hf_config(directory)
    cfg, d = _our_config(family, hf, directory, base), Path(directory)
    weights = (d / INDEX_FILE).is_file() or any(d.glob("*.safetensors"))
    return _imported_mtp(cfg, _reader(d).names() if weights else None, prefix, mtp)[0]


def _imported_mtp(
    cfg: Config, names: list[str] | None, prefix: str, mtp: bool
) -> tuple[Config, tuple[str, ...]]:
    """`cfg` (config.json's MTP depth) with the depth imported from a checkpoint of tensors
    `names` (None: unknown, config.json alone), and the name prefixes of the MTP layers left
    out (skipped unread): all of them, and depth 0, with `mtp=False` or where the checkpoint
    holds no tensor of the first."""
    layers = _mtp_layers(cfg, prefix)
    if not layers or mtp and (names is None or any(n.startswith(layers[0]) for n in names)):
        return cfg, ()
    return dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, mtp_depth=0)), layers


def _our_config(family: Family, hf: HFConfig, directory, base: Config | None) -> Config:
    cfg = family.to_config(hf, base or Config())
    if cfg.train.seq_len > cfg.model.max_seq_len:
        cfg = dataclasses.replace(
            cfg, train=dataclasses.replace(cfg.train, seq_len=cfg.model.max_seq_len)
        )
    try:
        validate(cfg)
    except ConfigError as e:
        raise InteropError(f"{hf.architecture} config in '{directory}' does not fit: {e}") from None
    return cfg


def _mtp_layers(cfg: Config, prefix: str = "") -> tuple[str, ...]:
    """The tensor name prefixes of the MTP layers: the layers after the main ones."""
    L = cfg.model.n_layers
    return tuple(f"{prefix}model.layers.{L + k}." for k in range(cfg.model.mtp_depth))


def _path(name: str) -> tuple:
    """A param path from its dotted name (`mtp.0.enorm.scale`: list indices are ints)."""
    return tuple(int(p) if p.isdigit() else p for p in name.split("."))


def _layer_path(cfg: Config, layer: int) -> tuple[tuple, int | None]:
    """Where layer `layer` lives: (path prefix, index into the stacked block axis or None)."""
    P, k = cfg.layer_period, cfg.prefix_layers
    if layer < k:  # the prefix (moe.first_dense_layers, then moe.hash_layers)
        return ("prefix", layer), None
    n_blocks = (cfg.model.n_layers - k) // P
    b, j = divmod(layer - k, P)
    if b < n_blocks:
        return ("blocks", "layers", j), b
    return ("tail", layer - k - n_blocks * P), None


def _placements(cfg: Config, family: Family):
    """(tensor name prefix, tensor map, our param paths, block index) for every tensor map of
    the model."""
    for tensor_map in top_maps(cfg):
        yield "", tensor_map, [tuple(n.split(".")) for n in tensor_map.ours], None
    for i in range(cfg.model.n_layers):
        base, b = _layer_path(cfg, i)
        for tensor_map in family.layer_maps(cfg, i):
            yield (
                f"model.layers.{i}.",
                tensor_map,
                [base + tuple(n.split(".")) for n in tensor_map.ours],
                b,
            )
    # The MTP layers last: their copies of the embedding and head read the main model's.
    for k, layer in enumerate(_mtp_layers(cfg) if family.mtp_maps else ()):
        for tensor_map in family.mtp_maps(cfg, k):
            yield layer, tensor_map, [_path(n) for n in tensor_map.ours], None


def _abstract_params(cfg: Config):
    abstract = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(abstract, nnx.Param)
    return graphdef, dict(nnx.to_flat_state(params))


def open_hf(
    directory: str | Path,
    base: Config | None = None,
    *,
    mtp: bool = True,
    dtype="float32",
    allow_nonfinite: bool = False,
) -> tuple[Config, ImportPlan]:
    """Our config for a HF checkpoint directory and the `ImportPlan` that makes any slice of
    any of its parameters (`stream.py`), every tensor checked (names, shapes, dtypes, the MTP
    layers' copies) before anything is read in bulk, and for NaN / inf as it is read unless
    `allow_nonfinite`. `dtype`: "float32", "bfloat16" or "source" (each parameter in its
    tensors' dtype). Raises `InteropError` as `load_hf`."""
    family, hf, prefix = read_hf_config(directory)
    cfg = _our_config(family, hf, directory, base)
    reader = _reader(directory)
    cfg, dropped = _imported_mtp(cfg, reader.names(), prefix, mtp)
    _, variables = _abstract_params(cfg)
    shapes = {p: tuple(v.shape) for p, v in variables.items()}
    plan = ImportPlan(reader, prefix, _placements(cfg, family), shapes, dtype, not allow_nonfinite)
    plan.run_checks()
    ignored = {prefix + "lm_head.weight"} if cfg.model.tie_embeddings else set()
    skipped = dropped + tuple(prefix + p for p in family.ignored)
    unused = plan.unused(
        lambda n: n in ignored or n.endswith(_IGNORED_SUFFIXES) or n.startswith(skipped)
    )
    if unused:
        raise InteropError(
            f"{len(unused)} tensor(s) in '{directory}' have no place in the {hf.architecture} "
            f"mapping, e.g. '{unused[0]}'; the checkpoint uses a setting moe_jax does not support"
        )
    return cfg, plan


def load_hf(
    directory: str | Path,
    base: Config | None = None,
    device: jax.Device | None = None,
    *,
    mtp: bool = True,
    dtype: str = "float32",
    shardings: dict | None = None,
    progress: Progress | None = None,
    allow_nonfinite: bool = False,
) -> tuple[Config, Transformer]:
    """Import a HF checkpoint directory (config.json + safetensors, single file or sharded).

    Returns our config (see `config_from_hf`) and a `Transformer` holding the weights as
    `dtype` arrays ("float32", "bfloat16", or "source": each in its checkpoint's dtype) on
    `device` (default: JAX's default device), or laid out by `shardings` ({param path:
    Sharding}, e.g. a mesh's: each process reads only the slices its devices hold). The
    tensors are streamed slice by slice (`stream.py`): the host never holds more than about
    one tensor. Raises `InteropError` (one line) for an unsupported architecture or setting,
    a missing, truncated or unreadable tensor or file, a tensor of the wrong shape, or a
    tensor the mapping does not use (a setting we would otherwise ignore). `mtp=False`:
    without the multi-token prediction layers (`model.mtp_depth` 0), their tensors skipped
    unread. A tensor holding NaN or inf is refused by name unless `allow_nonfinite`.
    """
    cfg, plan = open_hf(directory, base, mtp=mtp, dtype=dtype, allow_nonfinite=allow_nonfinite)
    graphdef, variables = _abstract_params(cfg)
    if shardings is None:
        one = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
        shardings = dict.fromkeys(variables, one)
    arrays = plan.to_devices(shardings, progress)
    params = nnx.from_flat_state([(p, variables[p].copy(arrays[p])) for p in sorted(variables)])
    return cfg, nnx.merge(graphdef, params)


def pick_family(cfg: Config, architecture: str | None = None) -> tuple[Family, dict]:
    """The HF family that can represent `cfg` (the one named, or the first that fits) and
    its config.json; `InteropError` saying why each candidate does not fit otherwise."""
    if cfg.model.vision:
        raise InteropError(
            "the image projection (model.vision) has no counterpart in the supported Hugging "
            "Face text architectures; export a run without model.vision"
        )
    if architecture is not None:
        if architecture not in FAMILIES:
            supported = ", ".join(FAMILIES)
            raise InteropError(f"unknown architecture '{architecture}'; choose one of {supported}")
        family = FAMILIES[architecture]
        return family, family.from_config(cfg)
    reasons = {}
    for arch, family in FAMILIES.items():
        try:
            return family, family.from_config(cfg)
        except InteropError as e:
            reasons[arch] = str(e).split(": ", 1)[-1]  # past "cannot write ARCH: "
    # The family this config misses by the fewest settings, and those: a run trained with them
    # exports (`--arch ARCH` says what another family needs).
    closest = min(reasons, key=lambda arch: reasons[arch].count("; "))
    raise InteropError(
        f"no Hugging Face architecture fits this config; the closest is {closest}: "
        f"{reasons[closest]} (a run trained so exports; --arch ARCH lists another's terms)"
    )


def save_hf(
    cfg: Config,
    model_or_params,
    directory: str | Path,
    *,
    architecture: str | None = None,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    tokenizer: Tokenizer | None = None,
) -> str:
    """Write a directory that `transformers` loads with `AutoModelForCausalLM.from_pretrained`.

    `model_or_params`: a `Transformer` or its `nnx.State` of params. The family is
    `architecture` or the first that represents `cfg` exactly (else `InteropError`); float32
    weights in `save_pretrained`'s layout and file names; with a `tokenizer` that has files
    (Hugging Face, SentencePiece), those files beside them and its BOS / EOS ids in
    config.json (where generation stops). The multi-token prediction module (model.mtp_depth)
    is written by the families that have it (DeepSeek-V3, GLM-4.5: `Family.mtp_maps`), as
    the layers after the main ones; the others leave it out. `directory` must not exist or be
    empty; it is written through a temporary sibling and renamed at the end, so a failure
    leaves nothing behind. Returns the architecture written.
    """
    out = Path(directory)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InteropError(f"'{out}' exists and is not empty; choose a new output directory")
    family, hf_config = pick_family(cfg, architecture)
    if tokenizer is not None and tokenizer.files:
        hf_config |= {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eos_id}
    params = (
        nnx.state(model_or_params, nnx.Param)
        if isinstance(model_or_params, nnx.Module)
        else model_or_params
    )
    flat = dict(nnx.to_flat_state(params))
    _, expected = _abstract_params(cfg)
    got = {p: tuple(v.shape) for p, v in flat.items()}
    want = {p: tuple(v.shape) for p, v in expected.items()}
    if got != want:
        diff = sorted(got.keys() ^ want.keys()) or [p for p in want if got[p] != want[p]]
        where = ".".join(map(str, diff[0]))
        raise InteropError(f"the params do not match the config (first difference at {where})")

    read = lambda p, block: np.asarray(flat[p][...] if block is None else flat[p][block])
    write_hf(cfg, family, hf_config, read, out, max_shard_bytes, tokenizer)
    return family.architecture


def write_hf(
    cfg: Config,
    family: Family,
    hf_config: dict,
    read,
    out: Path,
    max_shard_bytes: int = DEFAULT_SHARD_BYTES,
    tokenizer: Tokenizer | None = None,
    dtype=np.float32,
    progress: Progress | None = None,
    tensor_dtype=None,
) -> None:
    """The HF directory `out` (through a temporary sibling: whole or absent) of the params
    that `read(path, block)` gives one at a time (a param, or one layer of a stacked one;
    arrays or `lazy.Deferred`s), every tensor written as soon as it is made, in `dtype` or
    in `tensor_dtype(paths)` (the dtype of a tensor made of params `paths`) where given,
    with config.json (`torch_dtype` set to `dtype`) and the tokenizer's files."""
    name = "bfloat16" if np.dtype(dtype) == np.dtype(ml_dtypes.bfloat16) else np.dtype(dtype).name
    hf_config = hf_config | {"dtype": name, "torch_dtype": name}
    tensor_dtype = tensor_dtype or (lambda paths: np.dtype(dtype))
    with new_output(out, f"'{out}'") as tmp:
        writer = ShardWriter(tmp, max_shard_bytes, dtype)
        for name_prefix, tensor_map, paths, block in _placements(cfg, family):
            out_dtype = tensor_dtype(tuple(paths))
            for tensor_name, tensor in tensor_map.save(*[read(p, block) for p in paths]):
                writer.add(name_prefix + tensor_name, tensor, out_dtype)
                if progress is not None:
                    progress.add(math.prod(tensor.shape) * out_dtype.itemsize)
        writer.close()
        (tmp / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
        # the run's tokenizer files; the built-in byte / char tokenizers as a tokenizer.json
        for fname, data in (hf_files(tokenizer) if tokenizer is not None else {}).items():
            (tmp / fname).write_bytes(data)
