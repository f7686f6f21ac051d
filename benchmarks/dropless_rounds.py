"""How many rounds the dropless ragged exchange needs at a `moe.recv_factor`: the imbalance
between expert shards of a router as it trains (moe_jax/model/exchange_rounds.py).

    python benchmarks/dropless_rounds.py            # ~6 min on 2 cores
    python benchmarks/dropless_rounds.py --steps 100 --every 50 --windows 4

Trains configs/tiny.yaml with 16 experts, top-2, dropless, on Tiny Shakespeare (characters),
twice: with the load-balance loss (moe.lb_loss_weight=0.01, the default) and without it (0:
the router left to itself), a checkpoint every `--every` steps. At each checkpoint it routes
`--windows` validation windows of `--tokens` tokens per batch shard as an expert-parallel step
does: `ep` batch shards, shard q owning experts [q E/ep, (q+1) E/ep). An owner receives its
experts' assignments from every shard; one round fits when that is at most recv_factor x the
average (tokens x top_k, what every shard sends). Printed per run, checkpoint and ep: the
factor the fullest owner needs (median and max over windows and MoE layers) and the share of
(window, layer) exchanges that one round holds at each candidate factor. Last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from moe_jax.config import load_config
from moe_jax.inference.load import load_run
from moe_jax.train.loop import train

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = ROOT.parent / "shared/data/tinyshakespeare.txt"
FACTORS = (1.0, 1.1, 1.25, 1.5, 2.0)
EXPERTS, TOP_K = 16, 2


def train_run(run_dir: Path, lb_weight: float, steps: int, every: int) -> None:
    cfg = load_config(
        ROOT / "configs/tiny.yaml",
        [
            f"run_dir={run_dir}",
            f"data.path={SHAKESPEARE}",
            "data.tokenizer=char",
            f"moe.n_experts={EXPERTS}",
            f"moe.top_k={TOP_K}",
            "moe.capacity_factor=0",
            f"moe.lb_loss_weight={lb_weight}",
            f"train.steps={steps}",
            f"checkpoint.every={every}",
            f"train.eval_every={steps}",
            "train.log_every=50",
            f"checkpoint.keep={steps // every + 1}",
        ],
    )
    train(cfg)


@nnx.jit
def shard_loads(model, tokens_bT):
    """Each MoE layer's assignments per expert, [L, E], for one batch shard's tokens."""
    _, aux = model(tokens_bT)
    b, T = tokens_bT.shape
    return aux["expert_load"] * b * T * TOP_K


def needed_factors(model, windows_WST: np.ndarray, ep: int) -> np.ndarray:
    """[windows, MoE layers]: the fullest owner's rows over the average rows."""
    out = []
    for shards_ST in windows_WST:  # one step's batch shards, one row each
        rows_SLE = np.stack([np.asarray(shard_loads(model, s[None])) for s in shards_ST])
        rows_LQ = rows_SLE.sum(0).reshape(rows_SLE.shape[1], ep, EXPERTS // ep).sum(-1)
        out.append(rows_LQ.max(-1) / (shards_ST.shape[1] * TOP_K))
    return np.array(out)


def windows(tokens: np.ndarray, n: int, shards: int, T: int, seed: int = 0) -> np.ndarray:
    starts = np.random.default_rng(seed).integers(0, len(tokens) - T, size=(n, shards))
    return np.stack([[tokens[s : s + T] for s in row] for row in starts])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--windows", type=int, default=8, help="steps' worth of windows routed")
    p.add_argument("--tokens", type=int, default=512, help="tokens per batch shard")
    p.add_argument("--ep", type=int, nargs="+", default=[4, 8, 16])
    args = p.parse_args(argv)
    if not SHAKESPEARE.is_file():
        print(f"error: {SHAKESPEARE} not found (the shared corpus)", file=sys.stderr)
        return 2
    text = SHAKESPEARE.read_text()
    val = text[int(0.95 * len(text)) :]
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for lb in (0.01, 0.0):
            run = Path(tmp) / f"lb{lb}"
            train_run(run, lb, args.steps, args.every)
            for step in range(args.every, args.steps + 1, args.every):
                _, model, tok = load_run(run, step)
                ids = np.array(tok.encode(val), np.int32)
                for ep in args.ep:
                    w = windows(ids, args.windows, ep, min(args.tokens, len(ids) - 1))
                    need = needed_factors(model, jax.device_get(w), ep)
                    row = {
                        "lb_loss_weight": lb,
                        "step": step,
                        "ep": ep,
                        "median": float(np.median(need)),
                        "max": float(need.max()),
                        "one_round": {f: float(np.mean(need <= f)) for f in FACTORS},
                    }
                    results.append(row)
                    share = " ".join(f"{f}:{100 * v:5.1f}%" for f, v in row["one_round"].items())
                    print(
                        f"lb {lb:<5} step {step:4d} ep {ep:2d} | needed factor median "
                        f"{row['median']:.2f} max {row['max']:.2f} | one round at {share}",
                        flush=True,
                    )
    print(json.dumps({"tokens_per_shard": args.tokens, "results": results}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
