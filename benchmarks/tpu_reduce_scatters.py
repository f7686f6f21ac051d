"""Which reduce-scatters libtpu keeps, compiled on this CPU: the rule behind `weight_gather.steps`'
order and the down projections' leading shard axis (issue 23).

    python benchmarks/tpu_reduce_scatters.py                  # v5p-128, bf16
    python benchmarks/tpu_reduce_scatters.py --topology v6e-256 --dtype float32

Each row compiles one `psum_scatter` of a [rows, minor x group] array along its minor dim
(dim 1) or its major dim (dim 0), over groups of consecutive devices of one mesh axis
(`axis_index_groups`), and prints what the compiled step holds: a reduce-scatter (`RS`), an
`all-reduce-scatter` fusion (an all-reduce and each device's slice, counted as a
reduce-scatter by `moe_jax.aot.hlo`), or a plain all-reduce (`AR`: the whole gradient summed on
every device, then sliced). With libtpu 0.0.42 on v5p-128 a bf16 reduce-scatter along the
minor dim whose result is an odd multiple of 128 elements wide (128, 384, 640, ...) is the
all-reduce; along the major dim none is. About 1 s a compile.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import mesh_utils  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from moe_jax.aot.topology import get_topology  # noqa: E402

ROWS = 8192
MINOR = (80, 128, 160, 256, 384, 512, 640, 768, 896, 1024, 1152, 1280, 1536, 1920, 2560)


def compiled_as(mesh, rows: int, cols: int, dim: int, axis: str, size: int, dtype) -> str:
    """What the compiled step makes of a reduce-scatter of a per-device [rows, cols] array
    along `dim` over groups of `size` consecutive devices of `axis`."""
    n = mesh.shape[axis]
    groups = None if size == n else [list(range(b, b + size)) for b in range(0, n, size)]

    def scatter(x):
        return jax.lax.psum_scatter(
            x, axis, scatter_dimension=dim, tiled=True, axis_index_groups=groups
        )

    every = P(tuple(mesh.axis_names))
    step = jax.shard_map(scatter, mesh=mesh, in_specs=every, out_specs=every, check_vma=False)
    x = jax.ShapeDtypeStruct((rows * mesh.size, cols), dtype, sharding=NamedSharding(mesh, every))
    text = jax.jit(step).lower(x).compile().as_text()
    fused = len(re.findall(r"calls=%all-reduce-scatter", text))
    plain = len(re.findall(r" all-reduce(?:-start)?\(", text)) - fused  # the fusion's own
    kept = len(re.findall(r" reduce-scatter(?:-start)?\(", text))
    return "AR" if plain else "RS fusion" if fused else "RS" if kept else "?"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--topology", default="v5p-128")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--groups", default="2,4,8", help="group sizes (consecutive devices)")
    args = ap.parse_args()
    topo = get_topology(args.topology)
    # two axes as training's fsdp x expert: the groups are within the minor one
    n = len(topo.devices)
    devices = mesh_utils.create_device_mesh(
        (n // 16, 16), list(topo.devices), allow_split_physical_axes=True
    )
    mesh = Mesh(devices, ("fsdp", "expert"))
    dtype = jnp.dtype(args.dtype)
    sizes = [int(g) for g in args.groups.split(",")]
    print(f"{args.topology}, {dtype.name}, [{ROWS}, minor x group] per device, groups of `expert`")
    print(
        f"{'result minor':>12} {'x 128':>6}  "
        + "  ".join(f"dim1/{g:<2} dim0/{g:<2}" for g in sizes)
    )
    for minor in MINOR:
        cells = []
        for g in sizes:
            for dim in (1, 0):
                shape = (ROWS, minor * g) if dim == 1 else (minor * g, ROWS)
                cells.append(f"{compiled_as(mesh, *shape, dim, 'expert', g, dtype):>9}")
        ratio = f"{minor / 128:g}"
        print(f"{minor:>12} {ratio:>6}  " + "  ".join(cells), flush=True)


if __name__ == "__main__":
    main()
