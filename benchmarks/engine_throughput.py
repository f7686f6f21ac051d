"""Engine throughput: continuous batching (`moe_jax.inference.engine`) at 1, 8 and 64
concurrent requests against sample.py's sampler, one request at a time and in static batches,
on the same model and requests.

    python benchmarks/engine_throughput.py                          # small mixtral, 64 requests
    python benchmarks/engine_throughput.py --concurrency 1,8 --requests 16 --new-tokens 32

Requests: `--requests` prompts of random bytes, their lengths spread evenly over
`--prompt-lens` (min,max), each generating `--new-tokens` greedy tokens (no stop). One at a
time: a `Sampler.generate([prompt], N)` call per request, one after another. Static batches:
the requests in arrival order, `slots` at a time, a `Sampler.generate` call each (the
baseline continuous batching must beat). The engine: a closed loop keeping `c` requests in
flight (the next submitted as one ends), with `--slots` slots (default: the largest
concurrency). Tokens/s = generated tokens / wall time of the whole workload, after a warm-up
pass (compiles excluded); every engine pass sends prompts of the same lengths and new tokens
(none found in the prefix cache: the sampler has none). The JSON line also has the process'
CPU seconds (`cpu_s`), steadier than wall time on a loaded machine, and the load average at
the start and end (`load_avg`). Time to first token: from a request's submission to its
first token; inter-token latency: between its successive tokens; p50 / p90 / p99 over all
requests. KV memory per request: the pages it held at its peak (every layer's k and v)
against a full-context allocation (model.max_seq_len positions) and against the sampler's
(its prompt bucket + new tokens). `--peer`: transformers' continuous batching
(`generate_batch`, its default config, greedy, every token generated) on the same model
shape (random init, float32, sdpa attention: both recorded) and the whole workload at once,
timed on a second call (slow on CPU: keep the workload small).
`--speculative`: the same with speculative decoding (`Engine(speculative=True)`) beside the
plain engine, on a model with `--draft-depth` MTP layers trained `--train-steps` steps on
tinyshakespeare (../shared/data; else the Python standard library's sources) so that its
drafts are worth checking, prompts cut from that text (`--concurrency` 1,8 by default): tokens/s
and the drafts kept per depth, with and without speculation (a random model's drafts are
almost never kept: `--train-steps 0` measures what speculation costs then).
Prints a table and, last, one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
import sysconfig
import time
from pathlib import Path

import jax
import numpy as np
from common import STYLES, bench_config, count, counts, hf_model, machine, wait_until_idle
from flax import nnx

from moe_jax.data.windows import bucket
from moe_jax.inference.engine import Engine, SamplingParams
from moe_jax.inference.sampling import Sampler
from moe_jax.model import Transformer
from moe_jax.train.step import init_state, make_optimizer, make_train_step

SHAKESPEARE = Path(__file__).resolve().parents[1] / "../shared/data/tinyshakespeare.txt"


def workload(n: int, lo: int, hi: int, tokens_seed: int = 0) -> list[list[int]]:
    """n prompts, lengths spread over [lo, hi] in one shuffled order whatever the seed (so
    every pass runs the same shapes), random tokens drawn by `tokens_seed`."""
    lengths = np.linspace(lo, hi, n).round().astype(int)
    np.random.default_rng(0).shuffle(lengths)
    rng = np.random.default_rng(tokens_seed)
    return [rng.integers(0, 256, int(L)).tolist() for L in lengths]


def corpus_bytes() -> np.ndarray:
    """tinyshakespeare's bytes, else the standard library's top-level sources'."""
    if SHAKESPEARE.exists():
        raw = SHAKESPEARE.read_bytes()
    else:
        stdlib = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
        raw = b"".join(p.read_bytes() for p in stdlib[:50])
    return np.frombuffer(raw, np.uint8).astype(np.int32)


def text_workload(text, n: int, lo: int, hi: int, seed: int) -> list[list[int]]:
    """`workload`'s lengths, each prompt a window of `text` at a random start."""
    rng = np.random.default_rng(seed)
    lengths = [len(p) for p in workload(n, lo, hi)]
    starts = rng.integers(0, len(text) - hi, n)
    return [text[s : s + L].tolist() for s, L in zip(starts, lengths, strict=True)]


def trained_model(cfg, text, steps: int):
    """The model after `steps` steps on random windows of `text` (its MTP loss weighted 1)."""
    tx = make_optimizer(cfg.train)
    graphdef, state = init_state(cfg, tx)
    step = make_train_step(cfg, graphdef, tx)
    rng, T, B = np.random.default_rng(0), cfg.train.seq_len, cfg.train.batch_size
    for _ in range(steps):
        starts = rng.integers(0, len(text) - T - 1, B)
        state, _ = step(state, np.stack([text[s : s + T + 1] for s in starts]))
    return nnx.merge(graphdef, state["params"])


def one_at_a_time(sampler: Sampler, prompts, N: int) -> dict:
    """Each request alone through the sampler; one prompt per bucket first, to compile."""
    buckets = {}
    for p in prompts:
        buckets.setdefault(bucket(len(p), 10**9), p)
    for p in buckets.values():
        sampler.generate([p], N, temperature=0)
    start, cpu = time.perf_counter(), time.process_time()
    for p in prompts:
        sampler.generate([p], N, temperature=0)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"tok_s": len(prompts) * N / wall, "wall_s": wall, "cpu_s": cpu}


def static_batches(sampler: Sampler, prompts, N: int, batch: int) -> dict:
    """The requests in arrival order, `batch` at a time, each batch one `Sampler.generate`
    call (padded to its longest prompt's bucket, every row generating N tokens): static
    batching, what continuous batching must beat. Each batch's shape compiled first."""
    groups = [prompts[i : i + batch] for i in range(0, len(prompts), batch)]
    shapes = {}
    for g in groups:
        shapes.setdefault((len(g), bucket(max(map(len, g)), 10**9)), g)
    for g in shapes.values():
        sampler.generate(g, N, temperature=0)
    start, cpu = time.perf_counter(), time.process_time()
    for g in groups:
        sampler.generate(g, N, temperature=0)
    wall, cpu = time.perf_counter() - start, time.process_time() - cpu
    return {"batch": batch, "tok_s": len(prompts) * N / wall, "wall_s": wall, "cpu_s": cpu}


def peer(cfg, style: str, prompts, N: int) -> dict:
    """transformers' `generate_batch` over the whole workload (a first call warms up), with
    the dtype and attention implementation it ran (`hf_model`: float32, the model's default
    attention, sdpa)."""
    import transformers

    model = hf_model(cfg, style)
    config = transformers.GenerationConfig(
        max_new_tokens=N, min_new_tokens=N, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    model.generate_batch(prompts, generation_config=config)
    start = time.perf_counter()
    out = model.generate_batch(prompts, generation_config=config)
    wall = time.perf_counter() - start
    tokens = sum(len(o.generated_tokens) for o in out.values())
    dtype = str(next(model.parameters()).dtype).removeprefix("torch.")
    # What generate_batch ran: the model's own (sdpa), but eager, which it runs as paged
    # eager; it would switch to flash attention where installed (never on CPU), and it
    # restores the model's own after.
    attention = model.config._attn_implementation
    attention = "paged|eager" if attention == "eager" else attention
    return {"tok_s": tokens / wall, "wall_s": wall, "dtype": dtype, "attention": attention}


def closed_loop(engine: Engine, prompts, N: int, c: int) -> dict:
    """The workload with `c` requests in flight -> wall time, token times, peak pages."""
    params = SamplingParams(max_tokens=N)
    pending, inflight = list(prompts), set()
    submitted, times, peak = {}, {}, {}
    start, cpu = time.perf_counter(), time.process_time()
    while pending or engine.has_work():
        while pending and len(inflight) < c:
            rid = engine.submit(pending.pop(0), params)
            inflight.add(rid)
            submitted[rid], times[rid] = time.perf_counter(), []
        events = engine.step()
        now = time.perf_counter()
        for seq in filter(None, engine.slots):
            peak[seq.rid] = max(peak.get(seq.rid, 0), len(seq.pages))
        for e in events:
            times[e.rid].append(now)
            if e.finish_reason is not None:
                inflight.discard(e.rid)
    return {"wall": time.perf_counter() - start, "cpu": time.process_time() - cpu,
            "submitted": submitted, "times": times, "peak_pages": peak}  # fmt: skip


def percentiles(values) -> dict:
    if not len(values):
        return {}
    p = np.percentile(np.asarray(values) * 1e3, [50, 90, 99])
    return {"p50_ms": float(p[0]), "p90_ms": float(p[1]), "p99_ms": float(p[2])}


def engine_figures(engine: Engine, passes, N: int, c: int) -> dict:
    """`passes`: two workloads of the same lengths, other tokens (a prompt seen before would
    find its pages in the prefix cache, which the sampler one at a time has not)."""
    closed_loop(engine, next(passes), N, c)  # warm-up: every shape this workload needs compiles
    spec = engine.speculation
    before = None if spec is None else (spec.drafted.copy(), spec.accepted.copy())
    r = closed_loop(engine, next(passes), N, c)
    tokens = sum(len(t) for t in r["times"].values())
    ttft = [r["times"][rid][0] - t for rid, t in r["submitted"].items()]
    itl = [d for t in r["times"].values() for d in np.diff(t)]
    drafts = {}
    if spec is not None:  # this pass's drafts checked and kept, per depth
        drafted, accepted = spec.drafted - before[0], spec.accepted - before[1]
        drafts = {"drafted": drafted.tolist(), "accepted": accepted.tolist(),
                  "acceptance": float(accepted.sum() / max(drafted.sum(), 1))}  # fmt: skip
    return drafts | {
        "concurrency": c,
        "tok_s": tokens / r["wall"],
        "wall_s": r["wall"],
        "cpu_s": r["cpu"],
        "ttft": percentiles(ttft),
        "itl": percentiles(itl),
        "peak_pages_mean": float(np.mean(list(r["peak_pages"].values()))),
    }


def kv_bytes_per_position(engine: Engine) -> float:
    pages = jax.tree.leaves(engine.programs.pages)
    return sum(a.nbytes for a in pages) / engine.pool.n_pages / engine.page_size


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--size", default="small", choices=("small", "medium"))
    p.add_argument("--style", default="mixtral", choices=tuple(STYLES))
    p.add_argument("--requests", type=count(), default=64)
    p.add_argument("--concurrency", type=counts, default="1,8,64")
    p.add_argument("--prompt-lens", type=counts, default="16,256", help="min,max")
    p.add_argument("--new-tokens", type=count(2), default=64)
    p.add_argument("--slots", type=count(), default=None)
    p.add_argument("--page-size", type=count(), default=16)
    p.add_argument("--chunk", type=count(), default=128)
    p.add_argument("--prefill-rows", type=count(), default=4, help="slots prefilled a call")
    p.add_argument("--no-baseline", action="store_true", help="skip the sampler's baselines")
    p.add_argument("--peer", action="store_true", help="also time transformers' generate_batch")
    p.add_argument("--speculative", action="store_true", help="with and without speculation")
    p.add_argument("--draft-depth", type=count(), default=1, help="MTP depths (--speculative)")
    p.add_argument("--train-steps", type=count(0), default=100, help="(--speculative)")
    args = p.parse_args(argv)
    lo, hi = (args.prompt_lens * 2)[:2]
    # --speculative: the MTP layers' loss weighted as the main one's (drafts worth checking)
    mtp = [f"model.mtp_depth={args.draft_depth}", "train.mtp_loss_weight=1"]
    overrides = mtp if args.speculative else []
    cfg = bench_config(args.size, args.style, *overrides)
    if hi + args.new_tokens > cfg.model.max_seq_len:
        print(f"error: --prompt-lens max {hi} + --new-tokens {args.new_tokens} exceed the "
              f"model's context ({cfg.model.max_seq_len})", file=sys.stderr)  # fmt: skip
        return 2
    idle = wait_until_idle(timeout_s=120)  # recorded: a loaded machine's figures say so
    if args.speculative:
        return speculation(args, cfg, lo, hi, idle)
    sampler = Sampler(Transformer(cfg, rngs=nnx.Rngs(0)))
    prompts, N = workload(args.requests, lo, hi), args.new_tokens
    slots = args.slots or max(args.concurrency)
    engine = Engine(
        sampler,
        max_slots=slots,
        page_size=args.page_size,
        chunk=args.chunk,
        prefill_rows=args.prefill_rows,
    )
    load = [os.getloadavg()]  # the cores may be shared: the figures' load, start and end
    base = None if args.no_baseline else one_at_a_time(sampler, prompts, N)
    static = None if args.no_baseline else static_batches(sampler, prompts, N, slots)
    fresh = (workload(args.requests, lo, hi, tokens_seed=k) for k in itertools.count(1))
    rows = [engine_figures(engine, fresh, N, c) for c in args.concurrency]
    hf = peer(cfg, args.style, prompts, N) if args.peer else None
    load.append(os.getloadavg())
    per_pos = kv_bytes_per_position(engine)
    kv = {
        "engine_peak_mib": float(np.mean([r["peak_pages_mean"] for r in rows]))
        * args.page_size * per_pos / 2**20,
        "full_context_mib": cfg.model.max_seq_len * per_pos / 2**20,
        "sampler_mib": float(np.mean([bucket(len(q), 10**9) + N for q in prompts]))
        * per_pos / 2**20,
    }  # fmt: skip
    print(f"{args.size} {args.style}: {args.requests} requests, prompts {lo}-{hi}, {N} new")
    print_rows(base, static, rows, hf, load)
    print(f"KV per request: engine {kv['engine_peak_mib']:.2f} MiB at its peak, sampler "
          f"{kv['sampler_mib']:.2f}, full context {kv['full_context_mib']:.2f}")  # fmt: skip
    print(json.dumps({"benchmark": "engine_throughput", "size": args.size, "style": args.style,
                      "requests": args.requests, "prompt_lens": [lo, hi], "new_tokens": N,
                      "slots": slots, "chunk": args.chunk, "prefill_rows": args.prefill_rows,
                      "one_at_a_time": base, "static_batch": static, "engine": rows, "kv": kv,
                      "transformers_generate_batch": hf, "load_avg": load,
                      "machine_idle_at_start": idle, **machine()}))  # fmt: skip
    return 0


def print_rows(base, static, rows, hf, load) -> None:
    """The table: the sampler's baselines, the engine at each concurrency against them, the
    peer, and the load the figures were taken under."""
    if base:
        print(f"one at a time (sampler): {base['tok_s']:8.1f} tok/s")
        print(f"static batches of {static['batch']} (sampler): {static['tok_s']:8.1f} tok/s")
    print(" conc    tok/s  vs 1-at-a-time  vs static  ttft p50/p99 ms    itl p50/p99 ms")
    for r in rows:
        ratio = f"{r['tok_s'] / base['tok_s']:6.2f}x" if base else "   -   "
        vs_static = f"{r['tok_s'] / static['tok_s']:6.2f}x" if static else "   -   "
        t, i = r["ttft"], r["itl"]
        ttft = f"{t['p50_ms']:7.1f}/{t['p99_ms']:7.1f}"
        itl = f"{i['p50_ms']:7.1f}/{i['p99_ms']:7.1f}"
        print(f"{r['concurrency']:5d} {r['tok_s']:8.1f}  {ratio:>14s}  {vs_static:>9s}  {ttft}  "
              f"{itl}")  # fmt: skip
    if hf:
        print(f"transformers generate_batch ({hf['dtype']}, {hf['attention']} attention): "
              f"{hf['tok_s']:8.1f} tok/s")  # fmt: skip
    print(f"load average (1/5/15 min) at start {load[0]}, at end {load[1]}")


def speculation(args, cfg, lo: int, hi: int, idle: bool) -> int:
    """`--speculative`: the plain engine and the speculative one on a trained MTP model
    (module doc)."""
    text = corpus_bytes()
    t0 = time.perf_counter()
    model = trained_model(cfg, text, args.train_steps)
    train_s = time.perf_counter() - t0
    sampler, N = Sampler(model), args.new_tokens
    concurrency = args.concurrency if args.concurrency != [1, 8, 64] else [1, 8]
    slots = args.slots or max(concurrency)
    sizes = dict(max_slots=slots, page_size=args.page_size, chunk=args.chunk,
                 prefill_rows=args.prefill_rows)  # fmt: skip
    prompts = text_workload(text, args.requests, lo, hi, seed=0)
    base = None if args.no_baseline else one_at_a_time(sampler, prompts, N)
    rows = {}
    for name, spec in (("plain", False), ("speculative", True)):
        engine = Engine(sampler, **sizes, speculative=spec, draft_depth=args.draft_depth)
        # the same workloads for both: other windows of the text each pass
        passes = (text_workload(text, args.requests, lo, hi, k) for k in itertools.count(1))
        rows[name] = [engine_figures(engine, passes, N, c) for c in concurrency]
    print(f"{args.size} {args.style} + {args.draft_depth} MTP depth(s), trained "
          f"{args.train_steps} steps ({train_s:.0f} s): {args.requests} requests, prompts "
          f"{lo}-{hi} of text, {N} new")  # fmt: skip
    if base:
        print(f"one at a time (sampler): {base['tok_s']:8.1f} tok/s")
    print(" conc  plain tok/s (cpu s)  speculative tok/s (cpu s)  speedup  drafts kept")
    for plain, spec in zip(rows["plain"], rows["speculative"], strict=True):
        kept = ", ".join(f"{a}/{d}" for a, d in zip(spec["accepted"], spec["drafted"], strict=True))
        speedup = spec["tok_s"] / plain["tok_s"]
        print(f"{plain['concurrency']:5d} {plain['tok_s']:10.1f} ({plain['cpu_s']:6.1f})"
              f"  {spec['tok_s']:15.1f} ({spec['cpu_s']:6.1f})"
              f"  {speedup:6.2f}x  {spec['acceptance']:.1%} ({kept})")  # fmt: skip
    print(json.dumps({"benchmark": "engine_throughput_speculative", "size": args.size,
                      "style": args.style, "draft_depth": args.draft_depth,
                      "train_steps": args.train_steps, "train_s": train_s,
                      "corpus": "tinyshakespeare" if SHAKESPEARE.exists() else "stdlib",
                      "requests": args.requests, "prompt_lens": [lo, hi], "new_tokens": N,
                      "slots": slots, "chunk": args.chunk, "prefill_rows": args.prefill_rows,
                      "one_at_a_time": base, "engine": rows["plain"],
                      "speculative": rows["speculative"],
                      "machine_idle_at_start": idle, **machine()}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
