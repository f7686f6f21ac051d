"""A Hugging Face directory read wherever a run is read: `sample.py --run HF_DIR`,
`python -m moe_jax.eval HF_DIR`, `python -m moe_jax.quantize HF_DIR --out RUN`,
`train.py init_from=HF_DIR`. Nothing is written: the weights stream from the safetensors
files straight onto the devices (`stream.py`), in the form asked for.

    is_hf_dir(path)                    # config.json and no run of ours there
    meta = hf_meta(path)               # as `load.read_run_meta` gives a run's: step 0, config...
    params = hf_params(path, target)   # nnx State laid out (shardings, dtypes) like `target`

The directory reads as a run at step 0 whose config is `config_from_hf`'s (the schema's
defaults for the rest), with `data.tokenizer` the directory itself where it holds tokenizer
files (which then are the run's tokenizer, as an import copies them), else the byte
tokenizer.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Collection
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from moe_jax.config import Config
from moe_jax.interop import gpt_oss
from moe_jax.interop.convert import config_from_hf, open_hf, read_hf_config
from moe_jax.interop.safetensors_io import InteropError
from moe_jax.model.int8 import Mxfp4Param
from moe_jax.run.layout import CHECKPOINT_DIR, CONFIG_FILE, RunError
from moe_jax.tokenizer import Tokenizer, load_tokenizer
from moe_jax.tokenizer.files import HF_FILE, SP_FILE


def is_hf_dir(path: str | Path) -> bool:
    """A Hugging Face model directory: config.json, and neither a run's config.yaml nor its
    checkpoints."""
    p = Path(path)
    return (
        (p / "config.json").is_file()
        and not (p / CONFIG_FILE).exists()
        and not (p / CHECKPOINT_DIR).exists()
    )


def hf_tokenizer(hf_dir: Path, cfg: Config) -> Tokenizer | None:
    """The directory's tokenizer (None where it has no tokenizer files); refused if it has
    more tokens than the model's embedding."""
    if not ((hf_dir / HF_FILE).is_file() or (hf_dir / SP_FILE).is_file()):
        return None
    tokenizer = load_tokenizer(str(hf_dir))
    if tokenizer.vocab_size > cfg.model.vocab_size:
        raise InteropError(
            f"the tokenizer in '{hf_dir}' has {tokenizer.vocab_size} tokens but the model's "
            f"embedding {cfg.model.vocab_size} (vocab_size in config.json); fix the directory, "
            "or import it with another tokenizer (data.tokenizer=byte)"
        )
    return tokenizer


def with_hf_architecture(
    hf_dir: str | Path, cfg: Config, mtp: bool = True, given: Collection[str] | None = None
) -> Config:
    """`cfg` with the architecture (model, attention, moe) of the checkpoint in `hf_dir`, its
    run-time keys (`with_run_keys`) the family's but those the user gave (`given`; None: all
    of cfg's), and `data.tokenizer` the directory where it holds tokenizer files."""
    try:
        hf = config_from_hf(hf_dir, cfg, mtp=mtp)
    except InteropError as e:
        raise RunError(str(e)) from None
    hf = with_run_keys(hf, cfg, given)
    if hf_tokenizer(Path(hf_dir), hf) is not None:
        hf = dataclasses.replace(hf, data=dataclasses.replace(hf.data, tokenizer=str(hf_dir)))
    return hf


def with_run_keys(hf: Config, cfg: Config, given: Collection[str] | None) -> Config:
    """`hf`, a checkpoint's config over `cfg`, with the run-time keys
    (`run.policy.RESUMABLE_CHANGES`: capacity factor, balancing weights, context, dtype...)
    that the user gave (`given`, dotted; None: all) taken from `cfg`. The others stay what the
    family sets wherever its checkpoint is read (an import, `init_from=HF_DIR`): no token
    dropped (capacity factor 0), its balancing (DeepSeek / Kimi / GLM: the correction bias,
    no Switch loss), config.json's context."""
    from moe_jax.run.policy import RESUMABLE_CHANGES

    keys = RESUMABLE_CHANGES if given is None else RESUMABLE_CHANGES & set(given)
    sections = {}
    for section in ("model", "attention", "moe"):
        own = getattr(cfg, section)
        keep = {k.split(".")[1] for k in keys if k.startswith(section + ".")}
        sections[section] = dataclasses.replace(
            getattr(hf, section), **{k: getattr(own, k) for k in keep}
        )
    return dataclasses.replace(hf, **sections)


def hf_meta(hf_dir: str | Path) -> dict:
    """What `read_run_meta` gives for a run: "step" 0, "config" (`config_from_hf` over the
    defaults), "tokenizer" (the directory's, else the byte tokenizer), "hf_dir"."""
    hf_dir = Path(hf_dir)
    try:
        cfg = config_from_hf(hf_dir)
        tokenizer = hf_tokenizer(hf_dir, cfg)
    except InteropError as e:
        raise RunError(str(e)) from None
    if tokenizer is not None:
        cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, tokenizer=str(hf_dir)))
    else:
        tokenizer = load_tokenizer(cfg.data.tokenizer)
    return {
        "step": 0,
        "config": cfg,
        "tokenizer": tokenizer,
        "fingerprint": "",
        "hf_dir": str(hf_dir),
    }


def hf_params(hf_dir: str | Path, target, base: Config | None = None) -> nnx.State:
    """The checkpoint's params as an nnx State laid out like `target` (abstract params whose
    values carry their sharding and dtype; its MTP layers where it has them): each tensor
    read in its own dtype, streamed onto the shards of its devices (each process only its
    own), then cast there to the target's dtype (fp32 master weights for training are made
    on the devices). MXFP4 experts in `target` (`sample.weights=mxfp4`) are taken packed
    from a gpt-oss checkpoint's own blocks and scales, never decoded. `base`: the config
    whose run-time keys the params follow."""
    flat = dict(nnx.to_flat_state(target))
    raw = {p: v.get_raw_value() for p, v in flat.items()}
    packed = {p for p, v in flat.items() if isinstance(v, Mxfp4Param)}
    mtp = any(p[0] == "mtp" for p in flat)
    try:
        _, plan = open_hf(hf_dir, base, mtp=mtp, dtype="source")
        if plan.shapes.keys() != flat.keys():
            raise RunError(f"'{hf_dir}' does not hold the params of this config")
        arrays = plan.to_devices({p: raw[p].sharding for p in flat if p not in packed})
        arrays |= {p: _packed_experts(plan, p, raw[p]) for p in packed}
    except InteropError as e:
        raise RunError(str(e)) from None
    cast = []
    for p, v in flat.items():
        want, array = raw[p], arrays[p]
        if p not in packed and array.dtype != want.dtype:
            array = _cast(want.dtype, want.sharding)(array)
        cast.append((p, v.copy(array)))
    return nnx.from_flat_state(cast)


@functools.lru_cache(maxsize=32)
def _cast(dtype, sharding):
    return jax.jit(lambda x: x.astype(dtype), out_shardings=sharding)


def packs_mxfp4(hf_dir: str | Path) -> bool:
    """Whether the checkpoint stores its experts as MXFP4 (gpt-oss as released)."""
    family, hf, _ = read_hf_config(hf_dir)
    quant = hf.values.get("quantization_config") or {}
    return family.architecture == gpt_oss.ARCH and quant.get("quant_method") == "mxfp4"


# Our packed expert weight <- (the gpt-oss tensor, its rows): gate and up interleave in rows.
_PACKED = {
    "w_gate": ("gate_up_proj", slice(0, None, 2)),
    "w_up": ("gate_up_proj", slice(1, None, 2)),
    "w_down": ("down_proj", slice(None)),
}


def _packed_experts(plan, path: tuple, raw: dict) -> dict:
    """{"blocks", "scales"} of our MXFP4 expert weight `path` (`model.fp4`'s layout: blocks
    [..., E, G, 16, F], scales [..., E, G, F]) from the checkpoint's `*_blocks [E, R, G, 16]`
    and `*_scales [E, R, G]` (`interop.mxfp4`), whose rows are our output axis: the same
    codes and scales, re-laid, each device's slice only."""
    hf, rows = _PACKED[path[-1]]

    def part(kind: str) -> jax.Array:
        order = (0, 2, 3, 1) if kind == "blocks" else (0, 2, 1)

        def layer(block, index):
            piece, _ = plan.pieces[path][block]
            name = f"{plan.prefix}{piece.prefix}mlp.experts.{hf}_{kind}"
            if not plan.reader.has(name):
                raise InteropError(f"'{name}' is missing: the experts are not MXFP4")
            return plan.reader.raw(name)[:, rows].transpose(order)[index]

        def make(index):
            if not plan.stacked(path):
                return np.ascontiguousarray(layer(None, index))
            index = tuple(
                slice(*s.indices(n)[:2]) for s, n in zip(index, raw[kind].shape, strict=True)
            )
            lead, rest = index[0], index[1:]
            return np.stack([layer(b, rest) for b in range(lead.start, lead.stop)])

        return jax.make_array_from_callback(raw[kind].shape, raw[kind].sharding, make)

    return {"blocks": part("blocks"), "scales": part("scales")}
