"""Accelerator figures of the shipped full-size configs, compiled on this CPU (`moe_jax.aot`).

    python benchmarks/aot_figures.py                        # every config x topology below
    python benchmarks/aot_figures.py --only mixtral:v5p-128 --out figures.jsonl

For each pair it runs `python -m moe_jax.aot CONFIG --topology T --max-batch` on the
expert-parallel mesh below (the config's own model, remat and precision settings; the mesh
keys are the only overrides) and prints one row: the largest per-device batch that fits, the
per-device bytes at that batch, compiled / model FLOPs and collective bytes per step, next to
MaxText's figure where `shared/ACCELERATORS.md` has one. One full-depth compile takes minutes
and up to ~12 GiB of host memory, so the pairs run one after another; --out keeps each
result as it comes (a JSON line per pair) and a rerun skips the pairs already there.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
GIB = 1 << 30

CONFIGS = {
    "mixtral": ("configs/mixtral_8x7b.yaml", 8),
    "qwen3": ("configs/qwen3_30b_a3b.yaml", 16),
    "llama4": ("configs/llama4_scout_17b_16e.yaml", 16),
}
TOPOLOGIES = ("v5p-128", "h100:8x8", "v6e-256")
# MaxText 0.2.5, Mixtral-8x7B seq 4096, fsdp 64, full remat (shared/ACCELERATORS.md): its
# largest batch per chip that compiles on v5p-128, and its per-chip temporaries at 1 sequence.
PEER = {("mixtral", "v5p-128"): "MaxText (fsdp 64, remat full): 32 seq/chip; 13.5 GiB temps at 1"}


def mesh_overrides(expert: int) -> list[str]:
    """Expert parallelism over `expert` devices, FSDP over the rest; the axes may split the
    torus's (v5p-128's 4x4x4 holds no 8 x 8 otherwise)."""
    return ["mesh.fsdp=-1", f"mesh.expert={expert}", "mesh.split_physical_axes=true"]


def run_pair(model: str, topology: str, extra: list[str]) -> dict:
    path, expert = CONFIGS[model]
    cmd = [sys.executable, "-m", "moe_jax.aot", path, "--topology", topology, "--max-batch"]
    cmd += mesh_overrides(expert) + extra
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    for line in lines[:-1] if proc.returncode == 0 else lines:  # the probes and the table
        print(f"  {line}", flush=True)
    result = {"model": model, "topology": topology, "exit": proc.returncode}
    result["wall_s"] = round(time.perf_counter() - t0)
    if proc.returncode == 0:
        result["report"] = json.loads(lines[-1])
    else:
        result["message"] = lines[-1] if lines else proc.stderr.strip().splitlines()[-1]
    return result


def row(r: dict) -> str:
    head = f"{r['model']:<8} {r['topology']:<9}"
    if r["exit"] != 0:
        return f"{head} none fits: {r['message']}"
    rep = r["report"]
    b = rep["bytes"]
    coll = rep["collectives"]
    gib = {op: coll.get(op, {}).get("bytes", 0) / GIB for op in coll}
    ratio = rep["flops_per_device"] / rep["model_flops_per_device"]
    text = (
        f"{head} {rep['batch_per_device']:>5g} {b['arguments'] / GIB:7.1f} {b['temps'] / GIB:7.1f} "
        f"{b['peak'] / GIB:7.1f} {ratio:7.3f}  "
        + " ".join(f"{op} {v:.1f}" for op, v in sorted(gib.items()))
    )
    peer = PEER.get((r["model"], r["topology"]))
    return text + (f"\n{'':18} peer: {peer}" if peer else "")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--only", nargs="*", help="MODEL:TOPOLOGY pairs (default: all)")
    p.add_argument("--out", type=Path, help="JSON lines of the results, appended as they come")
    p.add_argument(
        "overrides", nargs="*", help="for every pair: section.key=value, or after -- aot flags"
    )
    args = p.parse_args(argv)
    pairs = [(m, t) for t in TOPOLOGIES for m in CONFIGS]
    if args.only:
        wanted = [tuple(x.split(":", 1)) for x in args.only]
        bad = [w for w in wanted if w not in pairs]
        if bad:
            print(f"error: unknown pair(s) {bad}; use MODEL:TOPOLOGY from {pairs}", file=sys.stderr)
            return 2
        pairs = wanted
    done = {}
    if args.out and args.out.exists():
        for line in args.out.read_text().splitlines():
            r = json.loads(line)
            done[(r["model"], r["topology"])] = r
    results = []
    for model, topology in pairs:
        if (model, topology) in done:
            results.append(done[(model, topology)])
            continue
        print(f"{model} on {topology}:", flush=True)
        r = run_pair(model, topology, args.overrides)
        results.append(r)
        if args.out:
            with args.out.open("a") as f:
                f.write(json.dumps(r) + "\n")
    print(
        "\nmodel    topology  seq/dev  args GiB temps GiB peak GiB  FLOPs c/m  collective GiB "
        "per step"
    )
    for r in results:
        print(row(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())
