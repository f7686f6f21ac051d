"""Decode throughput: moe_jax's compiled sampler vs Hugging Face `generate`, side by side.

    python benchmarks/decode.py                                  # everything (~10 min)
    python benchmarks/decode.py --sizes small --styles mixtral   # a part
    python benchmarks/decode.py --path-sweep --no-peer           # the decode MoE path's cost

New tokens/s = batch * new tokens / wall time of one whole generate call (prefill included),
greedy, median of `--repeats` calls after a warm-up; ours and the peer's calls alternate so
both see the same machine load. Prompts are random bytes of `--prompt-len`; the peer is forced
to generate every token (`min_new_tokens`). Our first call (trace + compile + run) is reported
separately as `compile_s` (the call minus a warm run). Ours is also split into the prefill
(a generate of one token) and the per-token decode step.

`--path-sweep` times the decode step at batch 1..4 and 8 (Mixtral-like, top-2 of 8 experts):
batches 1-3 put fewer than 8 assignments in flight, so the MoE layer gathers just the picked
experts' weights; from batch 4 it runs the [E, C, D] buffers, reading every expert.
Prints a table and, last, one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
from common import (
    SIZES,
    STYLES,
    bench_config,
    count,
    counts,
    hf_model,
    machine,
    median_time,
    wait_until_idle,
)
from flax import nnx

from moe_jax.inference.sampling import Sampler
from moe_jax.model import Transformer
from moe_jax.process_setup import reexec_with_hugepages


def ours(sampler: Sampler, B: int, P: int, N: int, seed: int = 0):
    """A generate call for random prompts [B, P] -> the blocking thunk."""
    prompts = np.random.default_rng(seed).integers(0, 256, (B, P)).tolist()
    return lambda n=N: sampler.generate(prompts, n, temperature=0).tokens


def peer(model, B: int, P: int, N: int, seed: int = 0):
    import torch

    ids = torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (B, P)))
    mask = torch.ones_like(ids)

    def run():
        with torch.inference_mode():
            out = model.generate(
                ids, attention_mask=mask, max_new_tokens=N, min_new_tokens=N, do_sample=False
            )
        assert out.shape == (B, P + N)
        return out

    return run


def measure(sampler, hf, B, P, N, repeats, wait_s) -> dict:
    run = ours(sampler, B, P, N)
    t0 = time.perf_counter()
    run()
    first = time.perf_counter() - t0
    run(1)  # compile the prefill-only program too
    peer_run = peer(hf, B, P, N) if hf is not None else None
    if peer_run is not None:
        peer_run()  # warm-up
    our_t, peer_t, prefill_t, quiet = [], [], [], []
    for _ in range(repeats):  # alternate, so both see the same machine load
        quiet.append(wait_until_idle(timeout_s=wait_s) if wait_s > 0 else False)
        our_t.append(median_time(run, 1))
        prefill_t.append(median_time(lambda: run(1), 1))
        if peer_run is not None:
            peer_t.append(median_time(peer_run, 1))
    t, pre = float(np.median(our_t)), float(np.median(prefill_t))
    row = {
        "batch": B,
        "tok_s": B * N / t,
        "compile_s": first - t,
        "prefill_ms": 1e3 * pre,
        "step_ms": 1e3 * (t - pre) / (N - 1),
        "quiet_repeats": sum(quiet),
    }
    if peer_t:
        row["peer_tok_s"] = B * N / float(np.median(peer_t))
        row["ratio"] = row["tok_s"] / row["peer_tok_s"]
    return row


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--sizes", default=",".join(SIZES))
    p.add_argument("--styles", default=",".join(STYLES))
    p.add_argument("--batches", type=counts, default="1,8")
    p.add_argument("--prompt-len", type=count(), default=64)
    p.add_argument("--new-tokens", type=count(2), default=128)  # a step follows the prefill's
    p.add_argument("--repeats", type=count(), default=3)
    p.add_argument("--no-peer", action="store_true", help="time moe_jax only")
    p.add_argument("--path-sweep", action="store_true", help="decode step vs batch 1-4, 8")
    p.add_argument(
        "--wait-s",
        type=float,
        default=60,
        help="before each timed pair, wait up to this long for the CPUs to go quiet (0 = no)",
    )
    args = p.parse_args(argv)
    P, N = args.prompt_len, args.new_tokens
    sizes, styles, batches = args.sizes.split(","), args.styles.split(","), args.batches
    if args.path_sweep:
        styles, batches = ["mixtral"], [1, 2, 3, 4, 8]
    if bad := [s for s in sizes if s not in SIZES] + [s for s in styles if s not in STYLES]:
        print(f"error: unknown size/style {', '.join(bad)}; sizes: {', '.join(SIZES)}, "
              f"styles: {', '.join(STYLES)}", file=sys.stderr)  # fmt: skip
        return 2
    if min(bench_config(size, "mixtral").model.max_seq_len for size in sizes) < P + N:
        print(f"error: --prompt-len {P} + --new-tokens {N} exceed the benchmark models' "
              "context (model.max_seq_len); shorten them", file=sys.stderr)  # fmt: skip
        return 2

    info = machine()
    print(
        f"# {info['cpu']}, {info['cores']} cores; jax {info['jax']}, torch {info['torch']} "
        f"({info['torch_threads']} threads), transformers {info['transformers']}; "
        f"prompt {P}, {N} new tokens, greedy, fp32; load average {os.getloadavg()[0]:.1f}"
    )
    header = (
        f"{'size':7s} {'style':8s} {'B':>2s} {'ours tok/s':>10s} {'peer tok/s':>10s} "
        f"{'ratio':>6s} {'compile s':>9s} {'prefill ms':>10s} {'step ms':>8s}"
    )
    print(header)
    rows = []
    for size in sizes:
        for style in styles:
            cfg = bench_config(size, style)
            sampler = Sampler(Transformer(cfg, rngs=nnx.Rngs(0)))
            hf = None if args.no_peer or args.path_sweep else hf_model(cfg, style)
            for B in batches:
                r = measure(sampler, hf, B, P, N, args.repeats, args.wait_s)
                r = {"size": size, "style": style, **r}
                rows.append(r)
                peer_s = f"{r['peer_tok_s']:10.0f} {r['ratio']:5.2f}x" if hf else " " * 17
                print(f"{size:7s} {style:8s} {B:2d} {r['tok_s']:10.0f} {peer_s} "
                      f"{r['compile_s']:9.1f} {r['prefill_ms']:10.1f} {r['step_ms']:8.2f}",
                      flush=True)  # fmt: skip
    # Other processes on the machine slow both sides (the peer's OpenMP threads far more).
    load = os.getloadavg()[0]
    print(f"# load average at the end {load:.1f}")
    print(json.dumps({"benchmark": "decode", "prompt_len": P, "new_tokens": N, **info,
                      "load_average_end": load, "results": rows}))  # fmt: skip
    return 0


if __name__ == "__main__":
    reexec_with_hugepages()
    sys.exit(main(sys.argv[1:]))
