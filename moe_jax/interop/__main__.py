"""Convert between Hugging Face checkpoints and moe_jax run directories.

    python -m moe_jax.interop import HF_DIR --out RUN_DIR [--dtype D] [--allow-nonfinite]
                                    [CONFIG.yaml] [key=value ...]
    python -m moe_jax.interop export RUN_DIR --out HF_DIR [--step N] [--arch A] [--dtype D]
    python -m moe_jax.interop export-adapter RUN_DIR --out ADAPTER_DIR [--step N] [--arch A]

import: the architecture comes from HF_DIR/config.json; CONFIG.yaml (default: the schema
defaults) and the overrides set everything else (train, data, mesh, ...) plus the run-time
model keys (model.dtype, model.scan_layers, model.max_seq_len, moe.capacity_factor, aux-loss
weights). RUN_DIR gets a step-0 checkpoint of the params only, in the checkpoint's own dtype
(bf16 stays bf16; --dtype float32 or bfloat16 to choose), streamed: each tensor is read
through a memory map and written a slice at a time, so host memory stays about one tensor
whatever the model's size (a progress line on stderr gives bytes, rate and ETA). A tensor
holding NaN or inf is refused by name as it is read (an MXFP4 weight as it is decoded: its
scale 255 gives inf); --allow-nonfinite imports it as it is. Fine-tune
it with `python train.py RUN_DIR/config.yaml [overrides]` (float32 master weights and a new
optimizer state made on the devices, data from the start) or sample from it. The HF
directory's tokenizer (tokenizer.json or tokenizer.model, with
tokenizer_config.json, special_tokens_map.json and chat_template.jinja/.json where present) is
copied into RUN_DIR/tokenizer/ and is the run's tokenizer (`data.tokenizer` names that copy),
so `python sample.py --run RUN_DIR --prompt "..."` takes text, and `--chat` renders it
through the chat template; a `data.tokenizer=...` override picks another tokenizer instead.
A DeepSeek-V3 / GLM-4.5 checkpoint's multi-token prediction layers come with it
(`model.mtp_depth` = num_nextn_predict_layers) where it holds them; `model.mtp_depth=0`
imports it without them.

export: writes the run's latest (or --step) checkpoint as safetensors + config.json for the
first HF architecture that represents its config exactly (or --arch), and the run's
tokenizer files, if it has any (a byte or char tokenizer has none). The tensors are in the
params' own dtype (float32 for a trained run, bf16 for a bf16 import; --dtype to choose),
config.json's torch_dtype says which (a tensor the import kept in another dtype keeps it, and
the router's correction bias stays float32 under --dtype bfloat16, as the releases keep it:
`interop.export`); streamed: one tensor read from the checkpoint and
written at a time, in shards of at most 2 GB. The multi-token
prediction layers (model.mtp_depth) are written as DeepSeek-V3 / GLM-4.5 checkpoints hold
them; the other architectures have none.

A LoRA run (lora.rank > 0) exports merged (each adapted weight W + alpha/r A B);
export-adapter writes its adapters alone in PEFT's format (adapter_model.safetensors +
adapter_config.json, PEFT's tensor names for the architecture), which PEFT loads onto the
HF base; `train.py init_from=BASE lora.init_adapter=ADAPTER_DIR` reads one back
(moe_jax/interop/peft.py).

Errors (unsupported architecture or setting, missing tensor, existing non-empty --out) print
one `error: ...` line and exit 2; nothing existing is overwritten.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

from flax import nnx
from omegaconf import OmegaConf

from moe_jax.config import (
    Config,
    ConfigError,
    config_from_yaml,
    config_to_yaml,
    given_keys,
    load_config,
)
from moe_jax.data import load_run_data
from moe_jax.interop.as_run import hf_tokenizer, with_run_keys
from moe_jax.interop.convert import FAMILIES, open_hf
from moe_jax.interop.export import export_run as stream_export
from moe_jax.interop.safetensors_io import InteropError
from moe_jax.interop.stream import ImportPlan, Progress
from moe_jax.model import Transformer
from moe_jax.run.door import HelpFormatter, command, writes
from moe_jax.run.layout import TOKENIZER_DIR
from moe_jax.run.policy import RESUMABLE_CHANGES
from moe_jax.run.stream_save import write_params_run
from moe_jax.tokenizer import Tokenizer


def _require_empty(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise InteropError(f"'{out}' exists and is not empty; choose a new --out directory")


def _import_config(
    hf_dir: Path,
    config: str | None,
    overrides: list[str],
    dtype: str = "source",
    allow_nonfinite: bool = False,
) -> tuple[Config, ImportPlan]:
    """The HF architecture over CONFIG.yaml + overrides, and the plan that streams its
    weights; overriding an architecture key that the HF config fixes is refused rather than
    silently ignored, but for `model.mtp_depth=0` (the multi-token prediction layers left
    out)."""
    mtp = True
    for item in overrides:
        key, _, value = item.partition("=")
        if key == "model.mtp_depth" and value.strip() == "0":
            mtp = False
        elif key.split(".")[0] in ("model", "attention", "moe") and key not in RESUMABLE_CHANGES:
            raise ConfigError(f"'{key}' is set by {hf_dir}/config.json and cannot be overridden")
    base = load_config(config, overrides)
    cfg, plan = open_hf(hf_dir, base, mtp=mtp, dtype=dtype, allow_nonfinite=allow_nonfinite)
    # The run-time model keys the HF config sets (max_seq_len, capacity_factor, balancing)
    # yield to the ones CONFIG.yaml or the overrides give explicitly, as `init_from=HF_DIR`'s.
    cfg = with_run_keys(cfg, base, given_keys(config, overrides))
    # the overrides again over what config.json caps (train.seq_len at its context)
    merged = OmegaConf.merge(
        OmegaConf.create(config_to_yaml(cfg)), OmegaConf.from_dotlist(overrides)
    )
    return config_from_yaml(OmegaConf.to_yaml(merged)), plan


def _hf_tokenizer(hf_dir: Path, cfg: Config, overrides: list[str]) -> Tokenizer | None:
    """The HF directory's tokenizer, or None where it has none or the overrides name
    `data.tokenizer`. Refused if it has more tokens than the model's embedding."""
    if any(item.partition("=")[0] == "data.tokenizer" for item in overrides):
        return None
    return hf_tokenizer(hf_dir, cfg)


def import_run(
    hf_dir: Path,
    out: Path,
    config: str | None,
    overrides: list[str],
    dtype: str = "source",
    allow_nonfinite: bool = False,
) -> Config:
    """Import HF_DIR into a new run directory `out` holding a params-only step-0 checkpoint
    in `dtype` ("source": the checkpoint's own), written slice by slice, and the HF
    tokenizer's files (see the module doc); a tensor holding NaN or inf is refused unless
    `allow_nonfinite`."""
    _require_empty(out)
    cfg, plan = _import_config(hf_dir, config, overrides, dtype, allow_nonfinite)
    tokenizer = _hf_tokenizer(hf_dir, cfg, overrides)
    if tokenizer is not None:  # the run's own copy, written with its checkpoint
        cfg = dataclasses.replace(
            cfg, data=dataclasses.replace(cfg.data, tokenizer=str(out / TOKENIZER_DIR))
        )
    cfg = dataclasses.replace(cfg, run_dir=str(out))
    data = load_run_data(cfg, tokenizer)  # the run's tokenizer and corpus, as train.py's
    abstract = nnx.state(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))), nnx.Param)
    meta = {
        "config": cfg,
        "tokenizer": data.tokenizer,
        "fingerprint": data.fingerprint,
        "imported_from": str(hf_dir),
    }
    total = sum(plan.nbytes(p) for p in plan.shapes)
    progress = Progress(total, "import", _stderr)
    write_params_run(out, meta, abstract, plan.dtypes, plan.fill, plan.stacked, progress)
    return cfg


def export_run(
    run_dir: Path, out: Path, step: int | None, arch: str | None, dtype: str | None = None
) -> tuple[str, Config]:
    """-> (the architecture written, the run's config); streamed (`interop.export`)."""
    _require_empty(out)
    progress = lambda total: Progress(total, "export", _stderr)
    return stream_export(run_dir, out, step, arch, dtype, progress)


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    """The command's parser: its import, export and export-adapter subcommands."""
    parser = argparse.ArgumentParser(
        prog="moe-jax interop",
        description=__doc__,
        formatter_class=HelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    imp = sub.add_parser(
        "import",
        formatter_class=HelpFormatter,
        help="HF checkpoint directory -> moe_jax run directory",
        usage="%(prog)s HF_DIR --out RUN_DIR [--dtype D] [--allow-nonfinite] [CONFIG.yaml] "
        "[section.key=value ...]",
    )
    imp.add_argument("hf_dir", type=Path)
    imp.add_argument("--out", type=Path, required=True, help="new run directory")
    imp.add_argument(
        "--dtype",
        choices=["source", "float32", "bfloat16"],
        default="source",
        help="the params' dtype in the run (default: the checkpoint's own, bf16 stays bf16)",
    )
    imp.add_argument(
        "--allow-nonfinite",
        action="store_true",
        help="import tensors holding NaN or inf as they are (refused by default)",
    )
    exp = sub.add_parser(
        "export",
        help="moe_jax run directory -> HF checkpoint directory",
        formatter_class=HelpFormatter,
    )
    exp.add_argument("run_dir", type=Path)
    exp.add_argument("--out", type=Path, required=True, help="new HF model directory")
    exp.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    exp.add_argument("--arch", choices=list(FAMILIES), default=None)
    exp.add_argument(
        "--dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="the tensors' dtype (default: the run's params', e.g. bf16 for a bf16 import)",
    )
    ada = sub.add_parser(
        "export-adapter",
        help="LoRA run directory -> PEFT adapter directory",
        formatter_class=HelpFormatter,
    )
    ada.add_argument("run_dir", type=Path)
    ada.add_argument("--out", type=Path, required=True, help="new adapter directory")
    ada.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    ada.add_argument("--arch", choices=list(FAMILIES), default=None)
    return parser


@command
def main(argv: list[str]) -> int:
    parser = build_parser()
    # CONFIG.yaml and key=value overrides may come before or after --out.
    args, rest = parser.parse_known_args(argv)
    if args.command != "import" and rest or any(r.startswith("-") for r in rest):
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    writes(args.out)
    if args.command == "import":
        config = rest.pop(0) if rest and "=" not in rest[0] else None
        cfg = import_run(args.hf_dir, args.out, config, rest, args.dtype, args.allow_nonfinite)
        print(f"imported {args.hf_dir} into {cfg.run_dir} (step 0)")
    elif args.command == "export-adapter":
        from moe_jax.interop.peft import export_adapter

        _require_empty(args.out)
        arch, _ = export_adapter(args.run_dir, args.out, args.step, args.arch)
        print(f"exported the LoRA adapters of {args.run_dir} for {arch} to {args.out}")
    else:
        arch, cfg = export_run(args.run_dir, args.out, args.step, args.arch, args.dtype)
        print(f"exported {args.run_dir} as {arch} to {args.out}")
        if cfg.moe.n_experts and cfg.moe.capacity_factor > 0:
            print(
                "note: transformers never drops a token; the exported model computes what "
                f"this run does with moe.capacity_factor=0 (it trained with "
                f"{cfg.moe.capacity_factor})"
            )
        if cfg.model.mtp_depth and FAMILIES[arch].mtp_maps is None:
            print(
                "note: the multi-token prediction module (model.mtp_depth) is not written; "
                "the exported model is the main model, which is all transformers runs"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
