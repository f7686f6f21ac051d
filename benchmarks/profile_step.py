"""Where the time of one training step goes: a jax.profiler trace + XLA's cost analysis.

    python benchmarks/profile_step.py                          # medium, Mixtral-like
    python benchmarks/profile_step.py --size small --style llama4 --top 40
    python benchmarks/profile_step.py --set model.scan_layers=true --trace-dir /tmp/trace

Profiles the train step as `train.py` runs it (train_throughput.real_train_step: the
config's mesh, one device by default, and `moe_jax.train.step.make_train_step`). Before tracing, the
model's parts are wrapped in `jax.named_scope`s (attention core, projections, RoPE, norms,
aux statistics, loss) by patching them from outside, beside the model's own (router,
dispatch, experts, combine, ...: moe_jax/named_scopes.py): the scopes only rename HLO ops, the
computation is unchanged. Each XLA op the CPU runtime executed
is then charged, through its `op_name` metadata, to a part and to forward or backward
(`transpose(...)` in the name), and the optimizer update is what lies outside the gradient.
Times are the ops' own trace events, summed over the `--repeats` traced steps and divided by
their number. Ops overlap on the runtime's threads, so the column sums can exceed the step's
wall time. Caveat: XLA:CPU runs some ops (Eigen's `dot_general`, copies, some slices and pads)
asynchronously on its thread pool, and their events cover only the dispatch. A last table
gives those ops' time from dispatch to the runtime's `end:` event for them: an upper bound,
as it includes time spent queued behind other ops (the experts' weight-gradient dots are
Eigen dots: ~0.1 s of events, up to ~1.8 s until done in the medium step).

XLA's cost analysis (of the whole compiled step) gives the FLOPs and bytes XLA counts: it
compares with the model FLOPs of `moe_jax.summary.counts.train_flops_per_token` and gives the
step's arithmetic intensity. Caveat: XLA counts the body of a nested loop (the per-expert
`lax.map` inside the layer scan) once, so with MoE layers its totals undercount; the model
FLOPs are the reference. Prints tables and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import collections
import functools
import glob
import gzip
import json
import re
import statistics
import sys
import tempfile
import time

from moe_jax.process_setup import import_jax

import_jax()  # before this file's own jax import: without the CUDA plugin's no-driver lines
import jax  # noqa: E402
from common import STYLES, bench_config, count, machine  # noqa: E402
from train_throughput import real_train_step  # noqa: E402

import moe_jax.model.attention as attention_mod  # noqa: E402
import moe_jax.model.norm as norm_mod  # noqa: E402
import moe_jax.model.transformer as transformer_mod  # noqa: E402
import moe_jax.train.step as train_step_mod  # noqa: E402
from moe_jax.config import ConfigError  # noqa: E402
from moe_jax.named_scopes import PARTS  # noqa: E402
from moe_jax.process_setup import reexec_with_hugepages  # noqa: E402
from moe_jax.summary.counts import train_flops_per_token  # noqa: E402
from moe_jax.summary.peaks import measure_peak_flops  # noqa: E402

# Scope name -> (owner, attribute) wrapped in jax.named_scope(scope). An op is charged to the
# innermost scope in its name (see `_part`): these, or the model's own (PACKAGE_PARTS, named
# in moe_jax/named_scopes.py for every MoE path: router, dispatch, combine, ...).
SCOPES = {
    "attn_core": (attention_mod, "block_attention"),
    "attn_decode": (attention_mod, "attend"),
    "attn_mask": (attention_mod, "attention_mask"),
    "rope": (attention_mod, "apply_rope"),
    "qk_norm": (attention_mod, "rms_norm"),
    "attn_proj": (attention_mod.Attention, "__call__"),
    "norm": (norm_mod.RMSNorm, "__call__"),
    "aux": (transformer_mod.Transformer, "_aux"),
    "embed_head": (transformer_mod.Transformer, "__call__"),
    "loss": (train_step_mod, "loss_fn"),
}


# The model's own named parts that these finer scopes do not split (attention: attn_*).
PACKAGE_PARTS = set(PARTS) - {"attention"}


def add_scopes() -> None:
    """Wrap every SCOPES target in its named scope (the names show up in HLO op_name)."""
    for scope, (owner, attr) in SCOPES.items():
        fn = getattr(owner, attr)

        @functools.wraps(fn)
        def scoped(*a, _fn=fn, _scope=scope, **k):
            with jax.named_scope(_scope):
                return _fn(*a, **k)

        setattr(owner, attr, scoped)


def _part(op_name: str) -> str:
    """The innermost scope in an op's name; `optimizer` outside the gradient, else `other`.
    `embed_head` scopes the whole forward, so its ops inside the layer scan's loop (the slices
    of stacked weights and residuals, the gradients' stacking, residual adds) are `layer_loop`."""
    tokens = re.split(r"[/();]", op_name)
    for i in reversed(range(len(tokens))):
        if tokens[i] == "embed_head" and "while" in tokens[i + 1 :]:
            return "layer_loop"
        if tokens[i] in SCOPES or tokens[i] in PACKAGE_PARTS:
            return tokens[i]
    return "other" if "while/body" in op_name or "transpose(" in op_name else "optimizer"


def op_metadata(hlo_text: str) -> dict[str, str]:
    """Instruction name -> op_name, for the instructions of the compiled module."""
    meta = {}
    for line in hlo_text.splitlines():
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*?op_name=\"([^\"]*)\"", line)
        if m:
            meta[m.group(1)] = m.group(2)
    return meta


def control_flow(hlo_text: str) -> set[str]:
    """Names of the module's `conditional` and `while` instructions. The CPU runtime's event
    for one spans the ops of its bodies, which have events of their own: counting both would
    charge those ops twice."""
    pattern = r"^\s*(?:ROOT )?%?([\w.\-]+) = .*? (?:conditional|while)\("
    return set(re.findall(pattern, hlo_text, re.M))


def op_spans(events: list[dict]) -> list[dict]:
    """The XLA ops among a trace's events (complete events with an `hlo_op`; the rest are
    runtime / Python frames), each with `done`: the time from its start to its `end:` event,
    longer than `dur` where the op ran asynchronously (see the module docstring)."""
    complete = sorted((e for e in events if e.get("ph") == "X"), key=lambda e: e["ts"])
    ops, running = [], {}
    for e in complete:
        name = e["name"]
        if name.startswith("end: "):
            start = running.pop(name[len("end: ") :], None)
            if start is not None:
                start["done"] = max(start["dur"], e["ts"] - start["ts"])
        elif "hlo_op" in e.get("args", {}):
            ops.append({**e, "done": e["dur"]})
            running[name] = ops[-1]
    return ops


def trace_ops(fn, repeats: int, trace_dir: str) -> tuple[list[dict], float]:
    """Run `fn` `repeats` times under the profiler -> (op events, median wall s)."""
    walls = []
    with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            walls.append(time.perf_counter() - t0)
    path = sorted(glob.glob(f"{trace_dir}/**/perfetto_trace.json.gz", recursive=True))[-1]
    with gzip.open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return op_spans(events), statistics.median(walls)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--size", default="medium", choices=("small", "medium"))
    p.add_argument("--style", default="mixtral", choices=tuple(STYLES))
    p.add_argument("--repeats", type=count(), default=3, help="traced steps (after 2 warm-ups)")
    p.add_argument("--top", type=count(), default=25, help="how many single ops to list")
    p.add_argument("--trace-dir", default=None, help="keep the trace here (default: temp dir)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE")
    args = p.parse_args(argv)

    try:
        cfg = bench_config(args.size, args.style, *args.set)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    add_scopes()
    step, state, (tokens, *_) = real_train_step(cfg, n_batches=1)
    B, T = cfg.train.batch_size, cfg.train.seq_len
    with jax.set_mesh(step.mesh):
        compiled = step.jitted.lower(state, tokens).compile()
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list) else cost
    hlo_text = compiled.as_text()
    meta, nested = op_metadata(hlo_text), control_flow(hlo_text)
    box = {"state": state}

    def run():
        box["state"], metrics = step(box["state"], tokens)
        jax.block_until_ready(metrics)

    for _ in range(2):
        run()
    with tempfile.TemporaryDirectory() as tmp:
        ops, wall = trace_ops(run, args.repeats, args.trace_dir or tmp)
    peak = measure_peak_flops()

    n = args.repeats
    by_part = collections.defaultdict(lambda: [0.0, 0.0])  # part -> [fwd s, bwd s]
    by_op = collections.defaultdict(float)
    by_kind = collections.defaultdict(float)
    by_async_kind = collections.defaultdict(lambda: [0.0, 0.0])  # kind -> [events s, done s]
    cond_s = sum(e["dur"] for e in ops if e["name"] in nested) * 1e-6 / n
    for e in ops:
        name, s = e["name"], e["dur"] * 1e-6 / n
        if name in nested:
            continue
        op_name = meta.get(name, "")
        by_part[_part(op_name)]["transpose(" in op_name] += s
        by_op[name] += s
        kind = re.sub(r"[.\d]+$", "", name)
        by_kind[kind] += s
        if e["done"] > e["dur"] * 1.5 + 20:  # us: ran asynchronously, not just a late end event
            by_async_kind[kind][0] += s
            by_async_kind[kind][1] += e["done"] * 1e-6 / n
    total = sum(by_op.values())
    model_flops = train_flops_per_token(cfg) * B * T

    print(f"# {args.size} {args.style} train step, B={B} T={T}; wall {wall:.3f} s/step "
          f"(median of {n} traced), ops {total:.3f} s; MFU {model_flops / wall / peak:.1%} of "
          f"{peak / 1e9:.0f} GFLOP/s")  # fmt: skip
    print(f"XLA cost analysis: {cost.get('flops', 0) / 1e9:.0f} GFLOP, "
          f"{cost.get('bytes accessed', 0) / 1e9:.2f} GB accessed per step; model FLOPs "
          f"{model_flops / 1e9:.0f} GFLOP (active experts, no capacity slack)")  # fmt: skip
    print(f"Not counted: {cond_s:.3f} s of `conditional` and `while` events, which span their "
          "bodies' ops")  # fmt: skip
    print(f"\n{'part':16s} {'fwd s':>7s} {'bwd s':>7s} {'total':>7s} {'share':>6s}")
    parts = sorted(by_part.items(), key=lambda kv: -sum(kv[1]))
    for part, (f, b) in parts:
        print(f"{part:16s} {f:7.3f} {b:7.3f} {f + b:7.3f} {(f + b) / total:6.1%}")
    print(f"\n{'op kind':28s} {'s':>7s} {'share':>6s}")
    for kind, s in sorted(by_kind.items(), key=lambda kv: -kv[1])[:12]:
        print(f"{kind:28s} {s:7.3f} {s / total:6.1%}")
    print(f"\n{'op':28s} {'s':>7s}  op_name")
    top = sorted(by_op.items(), key=lambda kv: -kv[1])[: args.top]
    for name, s in top:
        print(f"{name:28s} {s:7.3f}  {meta.get(name, '')[:90]}")
    print(f"\nasync ops (events cover the dispatch; 'until done' includes time queued)\n"
          f"{'op kind':28s} {'events s':>8s} {'until done s':>12s}")  # fmt: skip
    async_kinds = sorted(by_async_kind.items(), key=lambda kv: -kv[1][1])
    for kind, (s, done) in async_kinds[:8]:
        print(f"{kind:28s} {s:8.3f} {done:12.3f}")
    print(json.dumps({
        "benchmark": "profile_step", **machine(), "size": args.size, "style": args.style,
        "overrides": args.set, "wall_s": wall, "op_s": total, "peak_flops": peak,
        "model_flops": model_flops, "conditional_s": cond_s, "xla_flops": cost.get("flops"),
        "xla_bytes": cost.get("bytes accessed"),
        "parts": {k: {"fwd_s": f, "bwd_s": b} for k, (f, b) in parts},
        "top_ops": [{"op": k, "s": s, "op_name": meta.get(k, "")} for k, s in top],
        "async_kinds": {k: {"events_s": s, "done_s": d} for k, (s, d) in async_kinds},
    }))  # fmt: skip
    return 0


if __name__ == "__main__":
    reexec_with_hugepages()
    sys.exit(main(sys.argv[1:]))
