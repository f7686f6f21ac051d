"""AdamW against Muon at equal steps, and the attention's max logit with and without QK-clip
(train.optimizer, train.qk_clip; moe_jax/train/muon.py, qk_clip.py).

    python benchmarks/muon.py --data ../shared/data/tinyshakespeare.txt     # ~7 min, 2 cores
    python benchmarks/muon.py --data FILE --steps 200 --hot-lr 0.03 --tau 8

Trains configs/tiny.yaml (4 layers, 2 MoE with 4 experts top-2; QK-norm off, which QK-clip
refuses and which would bound the logits by itself) on the text file's characters, one run
each, the same seed, data order and LR schedule:
- adamw and muon at train.lr (`--lr`, tiny.yaml's 3e-3: Muon's 0.2 sqrt(max(A, B)) update
  scale is meant to carry AdamW's LR over unchanged);
- muon at `--hot-lr`, where the max logit grows, without QK-clip (train.qk_clip set above any
  logit, `NO_CLIP`: the statistic is logged, nothing clipped) and with train.qk_clip=`--tau`.
Printed per run: the train loss (mean of the last 5 logged steps), the final validation loss,
the heads QK-clip scaled per step, and the largest max logit over layers at every `--every`-th
logged step; then AdamW's and Muon's tokens/s, their jitted train steps timed taking turns
(`--turns` each: a shared machine's load falls on both alike; both take the max-logit
statistic, as every run here does); then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import jax
import numpy as np

from moe_jax.config import load_config
from moe_jax.observe.writers import read_metrics
from moe_jax.train.loop import train
from moe_jax.train.step import init_state, make_optimizer, make_train_step

ROOT = Path(__file__).resolve().parents[1]
NO_CLIP = 1e30  # a threshold no logit reaches: the max logit logged, no head clipped


def config(run_dir: Path, args, overrides: list[str]):
    return load_config(
        ROOT / "configs/tiny.yaml",
        [
            f"run_dir={run_dir}",
            f"data.path={args.data}",
            "data.tokenizer=char",
            "attention.qk_norm=none",
            f"train.steps={args.steps}",
            f"train.eval_every={args.steps}",
            "train.log_every=10",
            f"checkpoint.every={args.steps}",
            "train.trackers=[]",
            *overrides,
        ],
    )


def step_times(args, runs: dict, turns: int) -> dict:
    """Tokens/s of each run's jitted train step, the runs taking turns step by step (one
    step each per turn), so that a load that comes and goes on a shared machine falls on all
    of them alike: tokens per step / the median step time."""
    steps, states = {}, {}
    tokens = None
    for name, overrides in runs.items():
        cfg = config(Path("unused"), args, overrides)
        tx = make_optimizer(cfg.train)
        graphdef, states[name] = init_state(cfg, tx)
        steps[name] = make_train_step(cfg, graphdef, tx)
        B, T = cfg.train.batch_size, cfg.train.seq_len
        tokens = jax.random.randint(jax.random.key(0), (B, T + 1), 0, cfg.model.vocab_size)
        states[name], m = steps[name](states[name], tokens)  # compiles
        jax.block_until_ready(m["loss"])
    times = {name: [] for name in runs}
    for _ in range(turns):
        for name in runs:
            start = time.perf_counter()
            states[name], m = steps[name](states[name], tokens)
            jax.block_until_ready(m["loss"])
            times[name].append(time.perf_counter() - start)
    return {name: tokens.size / statistics.median(t) for name, t in times.items()}


def run(run_dir: Path, args, overrides: list[str]) -> dict:
    result = train(config(run_dir, args, overrides))
    train_records = [r for r in read_metrics(run_dir) if r["kind"] == "train"]
    curve = [
        (r["step"], round(float(np.max(r["max_logit"])), 2))
        for r in train_records
        if "max_logit" in r
    ]
    return {
        "train_loss": float(np.mean([r["loss"] for r in train_records[-5:]])),
        "val_loss": result.val_loss,
        "max_logit": curve[:: args.every] + curve[-1:] if curve else [],
        # heads clipped per step, over the run (each record holds its window's mean)
        "clipped_per_step": float(np.mean([r.get("qk_clipped", 0) for r in train_records])),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", required=True, help="a text file (Tiny Shakespeare)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW's and Muon's LR")
    p.add_argument("--hot-lr", type=float, default=3e-2, help="Muon's LR for the max logit")
    p.add_argument("--tau", type=float, default=10.0, help="QK-clip's threshold")
    p.add_argument("--every", type=int, default=2, help="print every N-th logged max logit")
    p.add_argument("--turns", type=int, default=20, help="timed steps per run, taking turns")
    args = p.parse_args()
    if not Path(args.data).is_file():
        p.error(f"--data {args.data} is not a file")
    runs = {
        "adamw": ["train.optimizer=adamw", f"train.lr={args.lr}", f"train.qk_clip={NO_CLIP}"],
        "muon": ["train.optimizer=muon", f"train.lr={args.lr}", f"train.qk_clip={NO_CLIP}"],
        "muon hot, no clip": ["train.optimizer=muon", f"train.lr={args.hot_lr}",
                              f"train.qk_clip={NO_CLIP}"],
        f"muon hot, qk_clip {args.tau:g}": ["train.optimizer=muon", f"train.lr={args.hot_lr}",
                                            f"train.qk_clip={args.tau}"],
    }  # fmt: skip
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for i, (name, overrides) in enumerate(runs.items()):
            results[name] = r = run(Path(tmp) / str(i), args, overrides)
            print(
                f"{name:24s} lr {overrides[1].split('=')[1]:>6s}  train loss {r['train_loss']:.4f}"
                f"  val loss {r['val_loss']:.4f}  heads clipped/step {r['clipped_per_step']:.2f}",
                flush=True,
            )
            print(f"{'':24s} max logit (step, value): {r['max_logit']}", flush=True)
    timed = {name: runs[name] for name in ("adamw", "muon")}
    for name, tok_s in step_times(args, timed, args.turns).items():
        results[name]["tokens_per_s"] = tok_s
        print(f"{name:24s} {tok_s:,.0f} tok/s (the train step alone, median of {args.turns})")
    print(json.dumps({"steps": args.steps, "runs": results}))


if __name__ == "__main__":
    main()
