"""Convert between Hugging Face checkpoints and moe_jax run directories.

    python -m moe_jax.interop import HF_DIR --out RUN_DIR [CONFIG.yaml] [section.key=value ...]
    python -m moe_jax.interop export RUN_DIR --out HF_DIR [--step N] [--arch ARCHITECTURE]

import: the architecture comes from HF_DIR/config.json; CONFIG.yaml (default: the schema
defaults) and the overrides set everything else (train, data, mesh, ...) plus the run-time
model keys (model.dtype, model.scan_layers, model.max_seq_len, moe.capacity_factor, aux-loss
weights). RUN_DIR gets a step-0 checkpoint: fine-tune it with
`python train.py RUN_DIR/config.yaml [overrides]` (fresh optimizer, data from the start) or
sample from it. The HF directory's tokenizer (tokenizer.json or tokenizer.model, with
tokenizer_config.json, special_tokens_map.json and chat_template.jinja/.json where present) is
copied into RUN_DIR/tokenizer/ and is the run's tokenizer (`data.tokenizer` names that copy),
so `python sample.py --run RUN_DIR --prompt "..."` takes text, and `--chat` renders it
through the chat template; a `data.tokenizer=...` override picks another tokenizer instead.
A DeepSeek-V3 / GLM-4.5 checkpoint's multi-token prediction layers come with it
(`model.mtp_depth` = num_nextn_predict_layers) where it holds them; `model.mtp_depth=0`
imports it without them.

export: writes the run's latest (or --step) checkpoint as float32 safetensors + config.json
for the first HF architecture that represents its config exactly (or --arch), and the run's
tokenizer files, if it has any (a byte or char tokenizer has none). The multi-token
prediction layers (model.mtp_depth) are written as DeepSeek-V3 / GLM-4.5 checkpoints hold
them; the other architectures have none.

Errors (unsupported architecture or setting, missing tensor, existing non-empty --out) print
one `error: ...` line and exit 2; nothing existing is overwritten.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import jax
from flax import nnx
from omegaconf import OmegaConf

from moe_jax.config import Config, ConfigError, config_from_yaml, config_to_yaml, load_config
from moe_jax.data import load_run_data
from moe_jax.interop.convert import FAMILIES, load_hf, save_hf
from moe_jax.interop.safetensors_io import InteropError
from moe_jax.load import load_run
from moe_jax.model import Transformer
from moe_jax.run.layout import TOKENIZER_DIR, RunError
from moe_jax.run.output import Interrupted, cli_ending, new_output
from moe_jax.run.policy import RESUMABLE_CHANGES
from moe_jax.run.store import Checkpointer
from moe_jax.tokenizer import DataError, Tokenizer, load_tokenizer
from moe_jax.tokenizer.files import HF_FILE, SP_FILE
from moe_jax.train_step import make_optimizer


def _require_empty(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InteropError(f"'{out}' exists and is not empty; choose a new --out directory")


def _host_device() -> jax.Device | None:
    """Host memory rather than an accelerator: an imported model only passes through on its
    way to disk (None, i.e. the default device, where JAX runs without a CPU backend)."""
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return None


def _import_config(
    hf_dir: Path, config: str | None, overrides: list[str]
) -> tuple[Config, Transformer]:
    """The HF architecture over CONFIG.yaml + overrides; overriding an architecture key that
    the HF config fixes is refused rather than silently ignored, but for `model.mtp_depth=0`
    (the multi-token prediction layers left out)."""
    mtp = True
    for item in overrides:
        key, _, value = item.partition("=")
        if key == "model.mtp_depth" and value.strip() == "0":
            mtp = False
        elif key.split(".")[0] in ("model", "attention", "moe") and key not in RESUMABLE_CHANGES:
            raise ConfigError(f"'{key}' is set by {hf_dir}/config.json and cannot be overridden")
    base = load_config(config, overrides)
    cfg, model = load_hf(hf_dir, base, device=_host_device(), mtp=mtp)
    # The run-time model keys the HF config sets (max_seq_len, capacity_factor) yield to the
    # ones CONFIG.yaml or the overrides give explicitly.
    merged = OmegaConf.create(config_to_yaml(cfg))
    file_cfg = OmegaConf.load(config) if config is not None else OmegaConf.create({})
    for key in sorted(RESUMABLE_CHANGES):
        value = OmegaConf.select(file_cfg, key, default=None)
        if value is not None:
            OmegaConf.update(merged, key, value)
    merged = OmegaConf.merge(merged, OmegaConf.from_dotlist(overrides))
    return config_from_yaml(OmegaConf.to_yaml(merged)), model


def _hf_tokenizer(hf_dir: Path, cfg: Config, overrides: list[str]) -> Tokenizer | None:
    """The HF directory's tokenizer, or None where it has none or the overrides name
    `data.tokenizer`. Refused if it has more tokens than the model's embedding."""
    if any(item.partition("=")[0] == "data.tokenizer" for item in overrides):
        return None
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


def import_run(hf_dir: Path, out: Path, config: str | None, overrides: list[str]) -> Config:
    """Import HF_DIR into a new run directory `out` holding a step-0 checkpoint, and the HF
    tokenizer's files (see the module doc)."""
    _require_empty(out)
    cfg, model = _import_config(hf_dir, config, overrides)
    tokenizer = _hf_tokenizer(hf_dir, cfg, overrides)
    if tokenizer is not None:  # the run's own copy, written with its checkpoint
        cfg = dataclasses.replace(
            cfg, data=dataclasses.replace(cfg.data, tokenizer=str(out / TOKENIZER_DIR))
        )
    cfg = dataclasses.replace(cfg, run_dir=str(out))
    # The run's tokenizer and data position, as train.py would start them.
    data = load_run_data(cfg, tokenizer)
    params = nnx.state(model, nnx.Param)
    opt_state = make_optimizer(cfg.train).init(params)
    it = data.train_iterator(cfg)
    meta = {"config": cfg, "tokenizer": data.tokenizer, "fingerprint": data.fingerprint}
    with new_output(out, f"--out '{out}'") as tmp:  # the whole run, or nothing
        ckpt = Checkpointer(cfg, run_dir=tmp)
        try:
            ckpt.save(0, params, opt_state, it, meta)
        finally:
            ckpt.close()
    return cfg


def export_run(run_dir: Path, out: Path, step: int | None, arch: str | None) -> tuple[str, Config]:
    """-> (the architecture written, the run's config)."""
    _require_empty(out)
    cfg, model, tokenizer = load_run(run_dir, step)
    return save_hf(cfg, model, out, architecture=arch, tokenizer=tokenizer), cfg


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m moe_jax.interop",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser(
        "import",
        help="HF checkpoint directory -> moe_jax run directory",
        usage="%(prog)s HF_DIR --out RUN_DIR [CONFIG.yaml] [section.key=value ...]",
    )
    imp.add_argument("hf_dir", type=Path)
    imp.add_argument("--out", type=Path, required=True, help="new run directory")
    exp = sub.add_parser("export", help="moe_jax run directory -> HF checkpoint directory")
    exp.add_argument("run_dir", type=Path)
    exp.add_argument("--out", type=Path, required=True, help="new HF model directory")
    exp.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    exp.add_argument("--arch", choices=list(FAMILIES), default=None)
    # CONFIG.yaml and key=value overrides may come before or after --out.
    args, rest = parser.parse_known_args(argv)
    if args.command == "export" and rest or any(r.startswith("-") for r in rest):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        if args.command == "import":
            config = rest.pop(0) if rest and "=" not in rest[0] else None
            cfg = import_run(args.hf_dir, args.out, config, rest)
            print(f"imported {args.hf_dir} into {cfg.run_dir} (step 0)")
        else:
            arch, cfg = export_run(args.run_dir, args.out, args.step, args.arch)
            print(f"exported {args.run_dir} as {arch} to {args.out}")
            if cfg.moe.n_experts and cfg.moe.capacity_factor > 0:
                print(
                    "note: transformers never drops a token; the exported model computes what "
                    f"this run does with moe.capacity_factor=0 (it trained with "
                    f"{cfg.moe.capacity_factor})"
                )
            if cfg.model.mtp_depth and FAMILIES[arch].mtp_rules is None:
                print(
                    "note: the multi-token prediction module (model.mtp_depth) is not written; "
                    "the exported model is the main model, which is all transformers runs"
                )
    except (InteropError, ConfigError, DataError, RunError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (Exception, KeyboardInterrupt, Interrupted) as e:  # signals, a full disk: one line
        if (code := cli_ending(e, args.out)) is None:
            raise
        return code
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
