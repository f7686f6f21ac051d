"""Training throughput: moe_jax's train step vs the Hugging Face peer, side by side.

    python benchmarks/train_throughput.py                               # 2 sizes x 3 styles
    python benchmarks/train_throughput.py --sizes medium --styles qwen3 --steps 12
    python benchmarks/train_throughput.py --no-peer --set moe.capacity_factor=2.0
    python benchmarks/train_throughput.py --sizes medium --against 05676cc   # ours vs ours at REV

Ours is exactly what `train.py` runs: the config's mesh (one device unless `--set mesh.*`),
`moe_jax.train.step.init_state` + `make_train_step` on it (AdamW with clipping and weight-decay
mask, aux losses, donated state), on random byte windows [B, T+1]. The peer is the
`transformers` model of the same architecture (benchmarks/common.py builds its config from
ours), random init, torch CPU float32 on `torch.set_num_threads(2)`,
`torch.optim.AdamW` with gradient clipping and, for Mixtral/Qwen3, the router load-balance loss
(`output_router_logits=True`, as ours always computes its aux losses); it is fed [B, T] with
`labels=input_ids`, so both do B x T tokens of forward and backward per step.

Each side runs in its own worker process, so their peak RSS (`ru_maxrss`, the whole process:
interpreter, libraries, params, optimizer state, activations) does not mix. Both workers stay
alive and take turns (`--chunk` steps each), so both see the same machine load; per-step times
are medians over all `--steps` timed steps after `--warmup` untimed ones. Each turn starts with
`--settle` untimed steps on both sides, so the timed steps follow a step as they do in a
training loop: this VM reports memory that stays free for 2 s to its host (free page
reporting), which takes it back, and touching it again then costs the kernel ~2 s per GB. Our
step frees its 3.3 GB XLA temporary block after each step, so the first step after the other
side's turn paid 7 s instead of 4 s (CPU s and kernel `sys` s per step are in the JSON;
`--settle 0` shows it). `--against REV` puts moe_jax at git revision REV (a temporary worktree,
its own copy of this script as the worker) in the peer's place, to measure a change in turns.
`first_step_s` is the
first call (trace + compile + run for ours). The matmul peak (fastest of 5 jitted 2048^3 fp32
`jnp.dot`s, `moe_jax.summary.peaks.measure_peak_flops`) is measured in our worker before each turn
and its median is the MFU denominator; model FLOPs/token (active experts only) come from
`moe_jax.summary.counts.train_flops_per_token`, the same for both sides (the Llama 4 peer runs every
expert on every token, so it does more arithmetic than this counts).
Prints a table and, last, one JSON line with every figure.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import numpy as np
from common import SIZES, STYLES, bench_config, hf_model, machine, wait_until_idle

from moe_jax.config import ConfigError
from moe_jax.process_setup import reexec_with_hugepages

REPLY = "@@reply "  # prefix of the worker's protocol lines (libraries may print to stdout too)


# ----------------------------------------------------------------------------- the two sides


def real_train_step(cfg, n_batches: int = 4):
    """moe_jax's train step set up exactly as `train.py` does it: the config's mesh (one device
    by default), state created on it, the jitted step with that state layout, global batches.
    -> (step(state, tokens) that runs under the mesh, state, list of random token batches)."""
    import jax

    from moe_jax.sharding import global_batch, make_mesh
    from moe_jax.train.step import init_state, make_optimizer, make_train_step

    tx = make_optimizer(cfg.train)
    mesh = make_mesh(cfg)
    with jax.set_mesh(mesh):
        graphdef, state = init_state(cfg, tx, mesh=mesh)
        jitted = make_train_step(cfg, graphdef, tx, jax.tree.map(lambda a: a.sharding, state))
    B, T = cfg.train.batch_size, cfg.train.seq_len
    rng = np.random.default_rng(cfg.seed)
    batches = [
        global_batch(rng.integers(0, 256, (B, T + 1), dtype=np.int32), mesh)
        for _ in range(n_batches)
    ]

    def step(state, tokens):
        with jax.set_mesh(mesh):
            return jitted(state, tokens)

    step.jitted, step.mesh = jitted, mesh
    return step, state, batches


def ours(cfg):
    """-> (step() that blocks until done, a peak-FLOP/s probe) for moe_jax's real train step."""
    import jax

    from moe_jax.summary.peaks import measure_peak_flops

    train_step, state, batches = real_train_step(cfg)
    box = {"state": state, "i": 0}

    def step():
        box["state"], metrics = train_step(box["state"], batches[box["i"] % len(batches)])
        box["i"] += 1
        jax.block_until_ready(metrics)

    return step, measure_peak_flops


def peer(cfg, style: str):
    """-> step() for the transformers model of `cfg` with torch AdamW (same hyperparameters)."""
    import torch

    model = hf_model(cfg, style).train()
    t = cfg.train
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": t.weight_decay}, {"params": no_decay}]
    opt = torch.optim.AdamW(
        groups,
        weight_decay=0.0,
        lr=t.lr,
        betas=(t.b1, t.b2),
        eps=t.eps,
    )
    kwargs = {}
    if style in ("mixtral", "qwen3"):  # router load-balance loss, as ours always computes
        kwargs = {"output_router_logits": True}
        model.config.router_aux_loss_coef = cfg.moe.lb_loss_weight
    B, T = t.batch_size, t.seq_len
    gen = torch.Generator().manual_seed(cfg.seed)
    batches = [torch.randint(0, 256, (B, T), generator=gen) for _ in range(4)]
    box = {"i": 0}

    def step():
        ids = batches[box["i"] % len(batches)]
        box["i"] += 1
        loss = model(input_ids=ids, labels=ids, **kwargs).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)

    return step, None


def worker(side: str, size: str, style: str, overrides: list[str]) -> None:
    """Serve commands from stdin: `first`, `run N`, `peak`, `rss`, `quit` -> one reply each."""
    out = os.fdopen(os.dup(sys.stdout.fileno()), "w", buffering=1)
    sys.stdout = sys.stderr  # keep library chatter off the protocol channel
    cfg = bench_config(size, style, *overrides)
    step, peak = ours(cfg) if side == "ours" else peer(cfg, style)
    for line in sys.stdin:
        cmd, *arg = line.split()
        if cmd == "first":
            t0 = time.perf_counter()
            step()
            reply = time.perf_counter() - t0
        elif cmd == "run":  # -> per step: wall seconds, CPU seconds, of which in the kernel
            reply = []
            for _ in range(int(arg[0])):
                r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
                step()
                wall, r1 = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_SELF)
                sys_s = r1.ru_stime - r0.ru_stime
                reply.append({"s": wall, "cpu": r1.ru_utime - r0.ru_utime + sys_s, "sys": sys_s})
        elif cmd == "peak":
            reply = peak() if peak else None
        elif cmd == "rss":
            reply = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        else:
            return
        out.write(REPLY + json.dumps(reply) + "\n")


class Worker:
    """A worker process (this file with --worker) and its command channel."""

    def __init__(self, side: str, size: str, style: str, overrides: list[str], tree: str = ""):
        """`tree`: a checkout of another revision whose moe_jax and worker script to run."""
        script, env = __file__, None
        if tree:
            script = os.path.join(tree, "benchmarks", os.path.basename(__file__))
            env = os.environ | {"PYTHONPATH": tree}
        cmd = [sys.executable, script, "--worker", "ours" if tree else side]
        cmd += ["--sizes", size, "--styles", style] + [f"--set={o}" for o in overrides]
        self.proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env
        )
        self.side = side

    def ask(self, command: str):
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        for line in self.proc.stdout:
            if line.startswith(REPLY):
                return json.loads(line[len(REPLY) :])
        raise RuntimeError(f"the {self.side} worker died (exit {self.proc.wait()}); see stderr")

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.close()
            self.proc.wait()


# ----------------------------------------------------------------------------- measuring


def take_turns(workers: dict, steps: int, warmup: int, chunk: int, settle: int) -> dict:
    """Time `steps` steps on every worker, `chunk` at a time in turn, so that all of them see
    the same machine load (this host's speed drifts by 30% over minutes). The first worker
    that can (ours) measures the matmul peak before each round. -> {"first", "times",
    "peaks", "load", "rss"}, each per worker name except the peaks and the 1-min load."""
    first = {s: w.ask("first") for s, w in workers.items()}
    for w in workers.values():
        w.ask(f"run {warmup}")
    times = {s: [] for s in workers}
    peaks, load = [], [os.getloadavg()[0]]
    prober = next((w for w in workers.values() if w.side == "ours"), None)
    done = 0
    while done < steps:
        n = min(chunk, steps - done)
        if prober:
            peaks.append(prober.ask("peak"))
        for s, w in workers.items():
            if settle:
                w.ask(f"run {settle}")  # untimed: see --settle
            times[s] += w.ask(f"run {n}")
        done += n
        load.append(os.getloadavg()[0])
    rss = {s: w.ask("rss") for s, w in workers.items()}
    return {"first": first, "times": times, "peaks": peaks, "load": load, "rss": rss}


def shared_figures(cfg, timed: dict) -> dict:
    """The figures of a `take_turns` run that are the same for every worker."""
    from moe_jax.summary.counts import train_flops_per_token

    return {
        "tokens_per_step": cfg.train.batch_size * cfg.train.seq_len,
        "flops_per_token": train_flops_per_token(cfg),
        "peak_flops": statistics.median(timed["peaks"]),
        "load_avg_1m": max(timed["load"]),
    }


def figures(cfg, timed: dict, name: str, side: str) -> dict:
    """Worker `name`'s figures from `take_turns` as `side`_* columns (tok/s, MFU, RSS, ...)."""
    from moe_jax.summary.counts import train_flops_per_token

    tokens = cfg.train.batch_size * cfg.train.seq_len
    times = timed["times"][name]
    step_s = statistics.median(t["s"] for t in times)
    flops, peak = train_flops_per_token(cfg), statistics.median(timed["peaks"])
    return {
        f"{side}_step_s": step_s,
        f"{side}_tok_s": tokens / step_s,
        f"{side}_mfu": tokens / step_s * flops / peak,
        f"{side}_first_step_s": timed["first"][name],
        f"{side}_peak_rss_gb": timed["rss"][name] / 1e9,
        f"{side}_cpu_s": statistics.median(t["cpu"] for t in times),
        f"{side}_sys_s": statistics.median(t["sys"] for t in times),
        f"{side}_step_times": [t["s"] for t in times],
    }


def measure(size, style, overrides, steps, warmup, chunk, settle, with_peer, tree=""):
    """One side-by-side measurement -> dict of figures (ours_*, peer_*, ratio, mfu); the peer
    is moe_jax checked out at `tree` when that is given."""
    cfg = bench_config(size, style, *overrides)
    workers = {"ours": Worker("ours", size, style, overrides)}
    if with_peer:
        workers["peer"] = Worker("peer", size, style, overrides, tree)
    try:
        timed = take_turns(workers, steps, warmup, chunk, settle)
    finally:
        for w in workers.values():
            w.close()

    row = {"size": size, "style": style, "overrides": list(overrides)}
    row |= shared_figures(cfg, timed)
    for s in workers:
        row |= figures(cfg, timed, s, s)
    if with_peer:
        row["ratio"] = row["ours_tok_s"] / row["peer_tok_s"]
        row["rss_ratio"] = row["ours_peak_rss_gb"] / row["peer_peak_rss_gb"]
    return row


def print_row(r: dict) -> None:
    peer = (
        f"{r['peer_tok_s']:9.0f} {r['ratio']:5.2f}x {r['peer_step_s']:7.2f} "
        f"{r['peer_peak_rss_gb']:6.2f}"
        if "peer_tok_s" in r
        else " " * 32
    )
    print(
        f"{r['size']:7s} {r['style']:8s} {r['ours_tok_s']:9.0f} {peer} {r['ours_step_s']:7.2f} "
        f"{100 * r['ours_mfu']:5.1f}% {r['ours_first_step_s']:7.1f} {r['ours_peak_rss_gb']:6.2f} "
        f"{r['peak_flops'] / 1e9:6.0f} {r['load_avg_1m']:5.1f}",
        flush=True,
    )


HEADER = (
    f"{'size':7s} {'style':8s} {'ours tok/s':>9s} {'peer tok/s':>9s} {'ratio':>6s} "
    f"{'peer s':>7s} {'p RSS':>6s} {'ours s':>7s} {'MFU':>6s} {'first s':>7s} {'RSS GB':>6s} "
    f"{'GF/s':>6s} {'load':>5s}"
)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("--sizes", default=",".join(SIZES), help="comma list of: small, medium")
    p.add_argument("--styles", default=",".join(STYLES), help="comma list of: " + ",".join(STYLES))
    p.add_argument("--steps", type=int, default=10, help="timed steps per side (median)")
    p.add_argument("--warmup", type=int, default=1, help="untimed steps after the first")
    p.add_argument("--chunk", type=int, default=2, help="steps per turn before the other side")
    p.add_argument("--settle", type=int, default=1,
                   help="untimed steps starting each turn, both sides (see the doc)")  # fmt: skip
    p.add_argument("--no-peer", action="store_true", help="time moe_jax only")
    p.add_argument("--against", metavar="REV", help="the peer is moe_jax at git revision REV")
    p.add_argument("--wait-idle", type=float, default=120, metavar="S",
                   help="before each measurement wait up to S s for an idle machine")  # fmt: skip
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="config override (the peer follows where it maps); repeatable")  # fmt: skip
    p.add_argument("--worker", choices=("ours", "peer"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    sizes, styles = args.sizes.split(","), args.styles.split(",")
    bad = [s for s in sizes if s not in SIZES] + [s for s in styles if s not in STYLES]
    if bad or args.steps < 1 or args.chunk < 1 or min(args.warmup, args.settle) < 0:
        what = (
            f"unknown size/style {', '.join(bad)}"
            if bad
            else "--steps/--chunk must be >= 1, --warmup/--settle >= 0"
        )
        print(f"error: {what}; sizes: {', '.join(SIZES)}, styles: {', '.join(STYLES)}",
              file=sys.stderr)  # fmt: skip
        return 2
    if args.worker:
        worker(args.worker, sizes[0], styles[0], args.set)
        return 0
    try:  # every config, before any worker starts
        for size in sizes:
            for style in styles:
                bench_config(size, style, *args.set)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2

    tree = checkout(args.against) if args.against else ""
    if tree is None:
        print(f"error: no git revision {args.against!r} here; name a commit of this repository",
              file=sys.stderr)  # fmt: skip
        return 2
    try:
        return run_all(args, sizes, styles, tree)
    finally:
        if tree:
            git("worktree", "remove", "--force", tree)


def git(*args: str) -> bool:
    """Run git in this repository -> whether it succeeded."""
    here = os.path.dirname(os.path.abspath(__file__))
    return subprocess.run(["git", "-C", here, *args], capture_output=True).returncode == 0


def checkout(rev: str) -> str | None:
    """A temporary detached worktree of this repository at `rev` -> its path (None: no such
    revision)."""
    import tempfile

    tree = tempfile.mkdtemp(prefix="moe_jax-rev-")
    if git("worktree", "add", "--detach", "-f", tree, rev):
        return tree
    os.rmdir(tree)
    return None


def run_all(args, sizes: list[str], styles: list[str], tree: str) -> int:
    """Measure every size x style and print the table and the JSON line."""
    info = machine()
    if tree:
        print(f"# peer: moe_jax at {args.against} ({tree})")
    print(
        f"# {info['cpu']}, {info['cores']} cores; jax {info['jax']}, torch {info['torch']} "
        f"({info['torch_threads']} threads), transformers {info['transformers']}; fp32; "
        f"median of {args.steps} steps; load avg {os.getloadavg()[0]:.1f}"
    )
    print(HEADER)
    rows = []
    for size in sizes:
        for style in styles:
            peer = not args.no_peer
            idle = wait_until_idle(timeout_s=args.wait_idle) if args.wait_idle > 0 else False
            timing = (args.steps, args.warmup, args.chunk, args.settle)
            r = measure(size, style, args.set, *timing, peer, tree)
            r["started_idle"] = idle
            rows.append(r)
            print_row(r)
    info |= {"against": args.against} if tree else {}
    print(json.dumps({"benchmark": "train_throughput", **info, "results": rows}))
    return 0


if __name__ == "__main__":
    reexec_with_hugepages()
    sys.exit(main(sys.argv[1:]))
