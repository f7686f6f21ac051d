"""int8 (or MXFP4-expert) copies of run directories, for inference.

    python -m moe_jax.quantize RUN_DIR --out RUN_DIR_INT8 [--step N] [--mode int8|mxfp4]
    python sample.py --run RUN_DIR_INT8   # or: python sample.py --run RUN_DIR sample.weights=int8
    qmodel = quantize_model(model)            # in Python: a new Transformer, `model` unchanged

The quantised model itself (which weights, the scheme, how it runs) is moe_jax/model/int8.py;
its API is re-exported here.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from flax import nnx

from moe_jax.config.checks import check_mxfp4
from moe_jax.inference.load import load_model, newest_again, open_run
from moe_jax.model.int8 import (
    QUANTIZATIONS,
    Int8Param,
    QuantizeError,
    check_quantization,
    is_quantized,
    param_bytes,
    quantize_model,
    quantize_tensor,
)
from moe_jax.run.checkpoints import write_inference_run
from moe_jax.run.door import HelpFormatter, command, writes

__all__ = [
    "QUANTIZATIONS",
    "Int8Param",
    "QuantizeError",
    "check_quantization",
    "is_quantized",
    "main",
    "param_bytes",
    "quantize_model",
    "quantize_run",
    "quantize_tensor",
]


def quantize_run(
    run_dir: str | Path, out_dir: str | Path, step: int | None = None, mode: str = "int8"
) -> str:
    """Write an int8 copy (`mode` "mxfp4": the routed experts MXFP4, the rest as trained) of
    `run_dir`'s checkpoint (latest or `step`) as the new run directory `out_dir` (same config,
    tokenizer and step; params only). Sampling restores it in that form straight away, where
    the float run would be restored whole first. -> a one-line report."""
    check_quantization(mode)
    run_dir, out_dir = Path(run_dir), Path(out_dir)
    if out_dir.exists():
        raise QuantizeError(f"--out '{out_dir}' already exists; choose a new directory")

    def read(step):  # the meta read once, the model from the same checkpoint
        run = open_run(run_dir, step)
        if run.meta.get("quantization"):
            raise QuantizeError(
                f"'{run_dir}' is already {run.meta['quantization']}-quantised; quantise the "
                f"float run it came from ({run.meta.get('source', 'unknown')})"
            )
        if mode == "mxfp4":  # the dims, from the config: before the weights are read
            check_mxfp4(run.meta["config"])
        return run.meta, *load_model(run)

    meta, cfg, model, tokenizer = newest_again(read, step)
    qmodel = quantize_model(model, mode)
    write_inference_run(
        out_dir,
        meta["step"],
        nnx.state(qmodel, nnx.Param),
        {
            "config": cfg,
            "tokenizer": tokenizer,
            "fingerprint": meta.get("fingerprint", ""),
            "quantization": mode,
            "source": f"{run_dir.absolute()} step {meta['step']}",
        },
    )
    float_bytes, int8_bytes = param_bytes(model), param_bytes(qmodel)
    return (
        f"wrote {out_dir}: {mode} copy of {run_dir} step {meta['step']}, parameters "
        f"{float_bytes / 2**20:.1f} MiB -> {int8_bytes / 2**20:.1f} MiB "
        f"({int8_bytes / float_bytes:.2f}x)"
    )


@command
def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="moe-jax quantize",
        formatter_class=HelpFormatter,
        description="Write a quantised copy of a run's checkpoint as a new run directory: int8 "
        "weights, or MXFP4 experts (--mode).",
    )
    p.add_argument("--mode", default="int8", choices=QUANTIZATIONS,
                   help="int8 (every matmul weight) or mxfp4 (the routed experts)")  # fmt: skip
    p.add_argument("run", help="run directory written by train.py")
    p.add_argument("--out", required=True, help="new run directory for the quantised copy")
    p.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    args = p.parse_args(argv)
    writes(args.out)
    print(quantize_run(args.run, args.out, args.step, args.mode))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
