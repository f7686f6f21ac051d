"""Activation memory of one attention layer's forward + backward, by kernel, compiled on this
CPU for accelerators (no accelerator needed; `moe_jax.aot.topology`).

    python benchmarks/attention_memory.py                  # Mixtral's layer at 8k and 32k
    python benchmarks/attention_memory.py --packed         # with packed documents (segments)

One `Attention` layer of configs/mixtral_8x7b.yaml (d_model 4096, 32 heads over 8 key/value
heads of 128, bf16 compute, float32 weights), batch 1: its forward, and its backward from a
given bf16 gradient of its output to its weights' and input's, on one device of each target:

    splash   v5p (one chip of v5p-8)      the Pallas TPU kernel
    cudnn    h100 (h100:1x1)              cuDNN flash attention (needs nvidia-cudnn-cu12)
    blocked  v5p and h100                 `Attention._blocked`, the CPU's path, for scale

It prints the compiler's temporaries (`memory_analysis().temp_size_in_bytes`) and its peak
(`peak_memory_in_bytes`: arguments, outputs and temporaries by their lifetimes) at each length,
and the temporaries' 32k / 8k ratio: 4x is linear in the sequence (the projections'
activations), 16x quadratic (logits). A program over the chip's HBM prints what libtpu says it
needs. The compiles run one after another (up to a minute and several GiB of host memory each).
"""

from __future__ import annotations

import argparse

from moe_jax.process_setup import held_stderr, import_jax

import_jax()  # JAX_PLATFORMS=cpu without an accelerator, quietly (the topologies need it)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from moe_jax import backends  # noqa: E402
from moe_jax.aot.command import _oom_bytes  # noqa: E402
from moe_jax.aot.topology import get_topology  # noqa: E402
from moe_jax.config import load_config  # noqa: E402
from moe_jax.model.attention import Attention  # noqa: E402
from moe_jax.sharding import MESH_AXES  # noqa: E402

GIB = 1 << 30
LENGTHS = (8192, 32768)
RUNS = (("splash", "v5p-8"), ("blocked", "v5p-8"), ("cudnn", "h100:1x1"), ("blocked", "h100:1x1"))


def compile_layer(impl: str, topology: str, T: int, packed: bool):
    """-> (temporaries, peak) in bytes, or (None, what went wrong), for one layer's step."""
    cfg = load_config("configs/mixtral_8x7b.yaml", [f"attention.impl={impl}"])
    topo = get_topology(topology)
    mesh = Mesh(np.array(topo.devices[:1]).reshape((1,) * len(MESH_AXES)), MESH_AXES)
    whole = NamedSharding(mesh, P())
    abstract = nnx.eval_shape(lambda: Attention(cfg, 0, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(abstract, nnx.Param)
    params = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=whole), params)
    x = jax.ShapeDtypeStruct((1, T, cfg.model.d_model), jnp.bfloat16, sharding=whole)
    ints = jax.ShapeDtypeStruct((1, T), jnp.int32, sharding=whole)

    def step(params, x_BTD, positions_BT, dy_BTD, *segments):
        """The layer's forward and its backward from the output's gradient `dy_BTD`, as in a
        training step: the weights' and the input's gradients."""
        layer = lambda p, x: nnx.merge(graphdef, p)(x, positions_BT, None, *segments)[0]
        _, backward = jax.vjp(layer, params, x_BTD)
        return backward(dy_BTD)

    with held_stderr(), backends.targeting(topo.platform), jax.set_mesh(mesh):
        try:
            compiled = jax.jit(step).lower(params, x, ints, x, *(ints,) * packed).compile()
        except Exception as e:  # report and go on to the next program
            text = str(e)
            need = _oom_bytes(text)
            if need is not None:
                return None, f"needs {need / GIB:.1f} GiB (> HBM)"
            return None, text.strip().splitlines()[0][:100]
    mem = compiled.memory_analysis()
    return (mem.temp_size_in_bytes, mem.peak_memory_in_bytes), ""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--packed", action="store_true", help="pass segment ids (packed documents)")
    ap.add_argument("--only", help="one impl:topology, e.g. splash:v5p-8")
    args = ap.parse_args()
    runs = [r for r in RUNS if args.only in (None, ":".join(r))]
    if not runs:
        ap.error(f"--only {args.only}: not one of {', '.join(':'.join(r) for r in RUNS)}")
    print(
        f"Mixtral attention layer fwd+bwd, batch 1, bf16, {'packed' if args.packed else 'causal'}"
    )
    cols = [f"{what} {t // 1024}k" for t in LENGTHS for what in ("temps", "peak")]
    print(f"{'kernel':8} {'target':9}" + "".join(f"{c:>12}" for c in cols) + "  temps 32k/8k")
    for impl, topology in runs:
        sizes, notes = [], []
        for T in LENGTHS:
            size, note = compile_layer(impl, topology, T, args.packed)
            sizes.append(size)
            notes.append(note)
        cells = "".join(
            f"{b / GIB:8.2f} GiB" if size else f"{'-':>12}"
            for size in sizes
            for b in (size or (0, 0))
        )
        ratio = f"{sizes[1][0] / sizes[0][0]:.2f}x" if all(sizes) else "-"
        note = "; ".join(n for n in notes if n)
        print(
            f"{impl:8} {topology:9}{cells}  {ratio:>11}" + (f"  {note}" if note else ""), flush=True
        )


if __name__ == "__main__":
    main()
