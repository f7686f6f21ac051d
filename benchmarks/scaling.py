"""How training throughput scales: experts, sequence length, capacity factor; compile time.

    python benchmarks/scaling.py                                  # all four sweeps (~15 min)
    python benchmarks/scaling.py --sweeps experts,compile --steps 6
    python benchmarks/scaling.py --size small --style qwen3
    python benchmarks/scaling.py --set model.scan_layers=true --set model.remat=dots
    python benchmarks/scaling.py --compare '' --compare model.scan_layers=false,model.remat=none

Sweeps (each point is our real train step in a worker process of its own, timed as in
train_throughput.py: median of `--steps` steps after a compile step and a warm-up step; the
points of a sweep take turns, 2 steps each after an untimed settle step, so they share the
host's drifts; all of a sweep's workers are alive at once, so memory adds up):
- experts: n_experts 8 -> 16 -> 32 at the style's top-k and expert hidden size, so the active
  FLOPs per token stay constant (capacity per expert shrinks as E grows, the buffers' total
  rows E x C stay the same); what grows is the parameter count (weights, gradients, AdamW).
- seq: seq_len 256 -> 512 -> 1024 at batch 8 (attention FLOPs per token grow with T).
- capacity: capacity_factor 1.0 / 1.25 / 2.0 / no-drop (0: C = all tokens of the group).
- compare (`--compare`, instead of the sweeps): any sets of config overrides, side by side.
- compile: first-call compile time of the train step for 4 and 16 layers, with and without
  `model.scan_layers` (trace + lower, and XLA compile, from abstract shapes in a fresh process).
Prints one table per sweep and, last, one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from common import STYLES, bench_config, machine
from train_throughput import Worker, figures, shared_figures, take_turns

from moe_jax.config import ConfigError
from moe_jax.process_setup import reexec_with_hugepages

SWEEPS = {
    "experts": ("moe.n_experts", [8, 16, 32]),
    "seq": ("train.seq_len", [256, 512, 1024]),
    "capacity": ("moe.capacity_factor", [1.0, 1.25, 2.0, 0.0]),
}
COMPILE_LAYERS = (4, 16)


def compile_time(size: str, style: str, n_layers: int, scan: bool) -> dict:
    """(trace + lower s, compile s) of the train step, from abstract shapes (nothing runs)."""
    import jax
    import jax.numpy as jnp

    from moe_jax.train.step import init_state, make_optimizer, make_train_step

    cfg = bench_config(size, style, f"model.n_layers={n_layers}", f"model.scan_layers={scan}")
    tx = make_optimizer(cfg.train)
    graphdef, state = init_state(cfg, tx, abstract=True)
    B, T = cfg.train.batch_size, cfg.train.seq_len
    tokens = jax.ShapeDtypeStruct((B, T + 1), jnp.int32)
    t0 = time.perf_counter()
    lowered = make_train_step(cfg, graphdef, tx).lower(state, tokens)
    t1 = time.perf_counter()
    lowered.compile()
    t2 = time.perf_counter()
    return {"n_layers": n_layers, "scan": scan, "lower_s": t1 - t0, "compile_s": t2 - t1}


def compile_sweep(size: str, style: str) -> list[dict]:
    rows = []
    print(f"\ncompile time of the train step ({size} {style}; fresh process each)")
    print(f"{'layers':>6s} {'scan':>5s} {'trace+lower s':>13s} {'compile s':>9s} {'total s':>8s}")
    for scan in (False, True):
        for n in COMPILE_LAYERS:
            cmd = [sys.executable, __file__, "--compile-worker", f"{n},{int(scan)}",
                   "--size", size, "--style", style]  # fmt: skip
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            r = json.loads(out.strip().splitlines()[-1])
            rows.append(r)
            total = r["lower_s"] + r["compile_s"]
            print(f"{n:6d} {str(scan):>5s} {r['lower_s']:13.1f} {r['compile_s']:9.1f} {total:8.1f}",
                  flush=True)  # fmt: skip
    for scan in (False, True):
        t = {r["n_layers"]: r["lower_s"] + r["compile_s"] for r in rows if r["scan"] == scan}
        lo, hi = COMPILE_LAYERS
        print(f"scan={scan}: {hi} layers / {lo} layers = {t[hi] / t[lo]:.2f}x")
    return rows


def throughput_sweep(
    title: str, key: str, points: list[tuple], size: str, style: str, steps: int
) -> list[dict]:
    """Every point (value, its overrides) in its own worker process, all alive at once and
    timed in turns (train_throughput.take_turns), so a drift of the host's speed hits every
    point alike."""
    print(f"\n{title} ({size} {style}, ours only, points timed in turns)")
    workers = {str(v): Worker("ours", size, style, point) for v, point in points}
    try:
        timed = take_turns(workers, steps, warmup=1, chunk=2, settle=1)
    finally:
        for w in workers.values():
            w.close()
    w = max(20, *(len(str(v)) for v, _ in points))
    print(f"{key:>{w}s} {'tok/s':>7s} {'s/step':>7s} {'vs first':>8s} {'MFU':>6s} {'RSS GB':>6s} "
          f"{'first s':>7s}")  # fmt: skip
    rows = []
    for v, point in points:
        cfg = bench_config(size, style, *point)
        r = {"value": v, "overrides": point} | shared_figures(cfg, timed)
        r |= figures(cfg, timed, str(v), "ours")
        rows.append(r)
        rel = r["ours_tok_s"] / rows[0]["ours_tok_s"]
        print(f"{v!s:>{w}s} {r['ours_tok_s']:7.0f} {r['ours_step_s']:7.2f} {rel:8.2f} "
              f"{100 * r['ours_mfu']:5.1f}% {r['ours_peak_rss_gb']:6.2f} "
              f"{r['ours_first_step_s']:7.1f}", flush=True)  # fmt: skip
    print(f"matmul peak {rows[0]['peak_flops'] / 1e9:.0f} GFLOP/s; "
          f"1-min load avg up to {rows[0]['load_avg_1m']:.1f}")  # fmt: skip
    return rows


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--size", default="medium", choices=("small", "medium"))
    p.add_argument("--style", default="mixtral", choices=tuple(STYLES))
    p.add_argument("--sweeps", default="experts,seq,capacity,compile")
    p.add_argument("--steps", type=int, default=6, help="timed steps per point (median)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override for the throughput sweeps; repeatable")  # fmt: skip
    p.add_argument("--compare", action="append", metavar="K=V,K=V",
                   help="a set of overrides ('' for none) to time in turns with the other "
                   "--compare sets; repeatable; runs instead of --sweeps")  # fmt: skip
    p.add_argument("--compile-worker", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.compile_worker:
        n, scan = args.compile_worker.split(",")
        print(json.dumps(compile_time(args.size, args.style, int(n), bool(int(scan)))))
        return 0
    sweeps = args.sweeps.split(",")
    unknown = [s for s in sweeps if s not in (*SWEEPS, "compile")]
    if unknown or args.steps < 1:
        what = f"unknown sweep {', '.join(unknown)}" if unknown else "--steps must be >= 1"
        print(f"error: {what}; sweeps: {', '.join([*SWEEPS, 'compile'])}", file=sys.stderr)
        return 2

    where = (args.size, args.style)
    runs = []  # (result name, title, key, points)
    if args.compare:
        sets = [[*args.set, *filter(None, c.split(","))] for c in args.compare]
        points = [(c or "(as configured)", o) for c, o in zip(args.compare, sets, strict=True)]
        runs.append(("compare", "compare: override sets", "overrides", points))
    for s in [] if args.compare else [s for s in sweeps if s != "compile"]:
        key, values = SWEEPS[s]
        points = [(v, [*args.set, f"{key}={v}"]) for v in values]
        runs.append((s, f"{s}: {key} in {values}", key, points))
    try:  # every point's config, before any worker starts
        for *_, points in runs:
            for _, overrides in points:
                bench_config(*where, *overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    info = machine()
    print(f"# {info['cpu']}, {info['cores']} cores; jax {info['jax']}; fp32; "
          f"median of {args.steps} steps")  # fmt: skip
    results = {}
    for name, title, key, points in runs:
        results[name] = throughput_sweep(title, key, points, *where, args.steps)
    if "compile" in sweeps and not args.compare:
        results["compile"] = compile_sweep(args.size, args.style)
    print(json.dumps({"benchmark": "scaling", **info, "size": args.size, "style": args.style,
                      "results": results}))  # fmt: skip
    return 0


if __name__ == "__main__":
    reexec_with_hugepages()
    sys.exit(main(sys.argv[1:]))
