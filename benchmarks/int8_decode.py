"""int8 weight-only vs float decode: tokens/s and memory of the compiled sampler.

    python benchmarks/int8_decode.py                         # small, Mixtral style, batch 1 and 8
    python benchmarks/int8_decode.py --size medium --styles mixtral,llama4

The same random-init model, float32 and `quantize_model`'d, each through `Sampler`: new
tokens/s of one whole greedy `generate` call (prefill of a random 64-token prompt + 128 new
tokens), median of `--repeats` warm calls, the two models' calls alternating so both see the
same machine load; `step ms` is the per-token decode step ((call - prefill-only call) / 127).
Memory: the parameters as stored (`param_bytes`), and the compiled generate program's argument
and temporary buffers (XLA's `memory_analysis`), which show whether anything holds a float
copy of the int8 weights. Prints a table and, last, one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
from common import STYLES, bench_config, count, counts, machine, median_time, wait_until_idle
from flax import nnx

from moe_jax.inference.sampling import Sampler
from moe_jax.model import Transformer
from moe_jax.process_setup import reexec_with_hugepages
from moe_jax.quantize import param_bytes, quantize_model


def program_memory(sampler: Sampler, B: int, P: int, N: int) -> dict:
    """Argument and temporary bytes of the compiled greedy generate program."""
    lowered = sampler.lower([[0] * P] * B, N, temperature=0)
    m = lowered.compile().memory_analysis()
    return {"argument_bytes": m.argument_size_in_bytes, "temp_bytes": m.temp_size_in_bytes}


def measure(samplers: dict, B: int, P: int, N: int, repeats: int, wait_s: float) -> dict:
    """Per model: (median whole-call s, median prefill-only s, compile s)."""
    prompts = np.random.default_rng(0).integers(0, 256, (B, P)).tolist()
    runs = {
        name: lambda n=N, s=s: s.generate(prompts, n, temperature=0).tokens
        for name, s in samplers.items()
    }
    compile_s = {}
    for name, run in runs.items():
        t0 = time.perf_counter()
        run()  # compiles the whole program
        run(1)  # and the prefill-only one
        compile_s[name] = time.perf_counter() - t0
    times = {name: ([], []) for name in runs}
    for _ in range(repeats):  # alternate, so both models see the same machine load
        if wait_s > 0:
            wait_until_idle(timeout_s=wait_s)
        for name, run in runs.items():
            times[name][0].append(median_time(run, 1))
            times[name][1].append(median_time(lambda run=run: run(1), 1))
    out = {}
    for name, (whole, pre) in times.items():
        t, t_pre = float(np.median(whole)), float(np.median(pre))
        out[name] = (t, t_pre, compile_s[name] - t - t_pre)
    return out


def format_row(r: dict) -> str:
    mib = lambda b: f"{b / 2**20:9.1f}"
    return (
        f"{r['style']:8s} {r['weights']:7s} {mib(r['param_bytes'])} {r['batch']:2d} "
        f"{r['tok_s']:8.1f} {r['step_ms']:8.2f} {mib(r['argument_bytes'])} "
        f"{mib(r['temp_bytes'])} {r['compile_s']:9.1f}"
    )


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--size", default="small", choices=("small", "medium"))
    p.add_argument("--styles", default="mixtral", help=f"comma-separated: {', '.join(STYLES)}")
    p.add_argument("--batches", type=counts, default="1,8")
    p.add_argument("--prompt-len", type=count(), default=64)
    p.add_argument("--new-tokens", type=count(2), default=128)  # a step follows the prefill's
    p.add_argument("--repeats", type=count(), default=3)
    p.add_argument("--wait-s", type=float, default=30, help="wait for quiet CPUs (0 = no)")
    args = p.parse_args(argv)
    P, N = args.prompt_len, args.new_tokens
    styles = args.styles.split(",")
    if unknown := [s for s in styles if s not in STYLES]:
        print(f"error: unknown style {unknown[0]!r}; use {', '.join(STYLES)}", file=sys.stderr)
        return 2
    if bench_config(args.size, styles[0]).model.max_seq_len < P + N:
        print(f"error: --prompt-len {P} + --new-tokens {N} exceed the {args.size} model's "
              "context (model.max_seq_len); shorten them", file=sys.stderr)  # fmt: skip
        return 2

    info = machine()
    print(
        f"# {info['cpu']}, {info['cores']} cores; jax {info['jax']}; {args.size}, prompt {P}, "
        f"{N} new tokens, greedy; load average {os.getloadavg()[0]:.1f}"
    )
    print(
        f"{'style':8s} {'weights':7s} {'param MiB':>9s} {'B':>2s} {'tok/s':>8s} {'step ms':>8s} "
        f"{'args MiB':>9s} {'temp MiB':>9s} {'compile s':>9s}"
    )
    rows = []
    for style in styles:
        model = Transformer(bench_config(args.size, style), rngs=nnx.Rngs(0))
        models = {"float32": model, "int8": quantize_model(model)}
        samplers = {name: Sampler(m) for name, m in models.items()}
        for B in args.batches:
            timed = measure(samplers, B, P, N, args.repeats, args.wait_s)
            for name, (t, t_pre, compile_s) in timed.items():
                row = {
                    "style": style,
                    "weights": name,
                    "batch": B,
                    "param_bytes": param_bytes(models[name]),
                    "tok_s": B * N / t,
                    "step_ms": 1e3 * (t - t_pre) / (N - 1),
                    "compile_s": compile_s,
                    **program_memory(samplers[name], B, P, N),
                }
                rows.append(row)
                print(format_row(row), flush=True)
    load = os.getloadavg()[0]
    print(f"# load average at the end {load:.1f}")
    record = {"benchmark": "int8_decode", "size": args.size, "prompt_len": P, "new_tokens": N}
    print(json.dumps({**record, **info, "load_average_end": load, "results": rows}))
    return 0


if __name__ == "__main__":
    reexec_with_hugepages()
    sys.exit(main(sys.argv[1:]))
