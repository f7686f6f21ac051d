"""Training step across mesh shapes on 8 simulated CPU devices, with the compiled collectives.

    python benchmarks/mesh.py                      # medium, Mixtral style, all meshes
    python benchmarks/mesh.py --size small --steps 3 --meshes expert8 data2_expert4

What it shows: the same train step (the one `train.py` runs) compiled for each mesh, its median
step time and tokens/s, and how many of each collective the compiled program contains (per
step: the MoE layers' all-to-alls, gradient all-reduces, FSDP all-gathers...). On this machine
the 8 "devices" share 2 cores, so time reflects the partitioned program's overhead, not the
speed-up of real hardware: read the collective counts as the result, the times as a sanity
check. Capacity factor 1.25 (the default): each batch shard routes its own tokens, as in
training.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from moe_jax.process_setup import import_jax  # noqa: E402

import_jax()  # before this file's own jax import: without the CUDA plugin's no-driver lines
import jax  # noqa: E402
import numpy as np  # noqa: E402

from benchmarks.common import bench_config, median_time  # noqa: E402
from moe_jax.process_setup import reexec_with_hugepages  # noqa: E402
from moe_jax.sharding import global_batch, make_mesh  # noqa: E402
from moe_jax.train.step import init_state, make_optimizer, make_train_step  # noqa: E402

MESHES = {
    "single": [],
    "data8": ["mesh.data=8"],
    "expert8": ["mesh.expert=8"],
    "data2_expert4": ["mesh.data=2", "mesh.expert=4"],
    "fsdp2_expert2_tensor2": ["mesh.fsdp=2", "mesh.expert=2", "mesh.tensor=2"],
    "data2_fsdp2_expert2": ["mesh.data=2", "mesh.fsdp=2", "mesh.expert=2"],
}
COLLECTIVES = ("all-to-all", "all-reduce", "all-gather", "reduce-scatter", "collective-permute")


def count_collectives(hlo: str) -> dict[str, int]:
    """Collective instructions of a compiled module (async pairs counted once, by their start)."""
    counts = {}
    for op in COLLECTIVES:
        pattern = rf"^\s*%[\w.\-]+ = .*? {op}(-start)?\("
        counts[op] = len(re.findall(pattern, hlo, re.M))
    return counts


def bench_mesh(size: str, style: str, mesh_overrides: list[str], steps: int) -> dict:
    cfg = bench_config(size, style, *mesh_overrides)
    mesh = make_mesh(cfg)
    tx = make_optimizer(cfg.train)
    B, T = cfg.train.batch_size, cfg.train.seq_len
    batch = np.random.default_rng(0).integers(0, 256, (B, T + 1), dtype=np.int32)
    with jax.set_mesh(mesh):
        graphdef, state = init_state(cfg, tx, mesh=mesh)
        step = make_train_step(cfg, graphdef, tx, jax.tree.map(lambda a: a.sharding, state))
        tokens = global_batch(batch, mesh)
        t0 = time.perf_counter()
        compiled = step.lower(state, tokens).compile()
        compile_s = time.perf_counter() - t0
        holder = {"state": state}

        def one_step():
            holder["state"], metrics = compiled(holder["state"], tokens)
            jax.block_until_ready(metrics)

        one_step()  # warm-up
        step_s = median_time(one_step, steps)
    return {
        "mesh": dict(mesh.shape),
        "compile_s": round(compile_s, 1),
        "step_s": round(step_s, 3),
        "tokens_per_s": round(B * T / step_s),
        "collectives": count_collectives(compiled.as_text()),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="medium", choices=["small", "medium"])
    p.add_argument("--style", default="mixtral", choices=["mixtral", "qwen3", "llama4"])
    p.add_argument("--steps", type=int, default=3, help="timed steps per mesh (median)")
    p.add_argument("--meshes", nargs="+", default=list(MESHES), choices=list(MESHES))
    args = p.parse_args()

    print(f"{args.size} / {args.style}, 8 simulated CPU devices on {os.cpu_count()} cores")
    header = f"{'mesh':<24}{'compile s':>10}{'step s':>9}{'tok/s':>8}  collectives per step"
    print(header)
    results = {}
    for name in args.meshes:
        r = bench_mesh(args.size, args.style, MESHES[name], args.steps)
        results[name] = r
        coll = ", ".join(f"{k} {v}" for k, v in r["collectives"].items() if v)
        print(f"{name:<24}{r['compile_s']:>10}{r['step_s']:>9}{r['tokens_per_s']:>8}  {coll}")
    print(json.dumps({"benchmark": "mesh", "size": args.size, "style": args.style, **results}))


if __name__ == "__main__":
    reexec_with_hugepages()
    main()
