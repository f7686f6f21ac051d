"""Load balancing with the auxiliary loss against DeepSeek-V3's auxiliary-loss-free bias, at
equal steps (moe_jax/model/balancing.py).

    python benchmarks/balancing.py                    # ~10 min on 2 cores
    python benchmarks/balancing.py --steps 200 --rates 0.001
    python benchmarks/balancing.py --rates 0.001 --seeds 0 1 2    # mean and spread over seeds

Trains configs/tiny.yaml with 16 experts, top-2, sigmoid scores renormalised over the k
(DeepSeek-V3's routing without groups), dropless, on Tiny Shakespeare (characters), once with
the load-balance loss (moe.lb_loss_weight 0.01, no bias) and once per `--rates` with the
correction bias trained by moe.bias_update_rate instead (lb_loss_weight 0). Printed per run:
MaxVio per MoE layer, (max_e load_e - mean load) / mean load of each logged step's global
expert load, averaged over the last `--tail` logged steps (0 = perfectly even), and the final
validation loss; with several `--seeds` (the config's `seed`: initialisation and batch order),
each run's mean and standard deviation over them, and the val-loss difference to the loss's run
of the same seed. Last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

from moe_jax.config import load_config
from moe_jax.observe.writers import read_metrics
from moe_jax.train.loop import train

ROOT = Path(__file__).resolve().parents[1]
SHAKESPEARE = ROOT.parent / "shared/data/tinyshakespeare.txt"
ROUTING = [
    "moe.n_experts=16",
    "moe.top_k=2",
    "moe.score=sigmoid",
    "moe.renormalize=true",
    "moe.capacity_factor=0",
]


def run(run_dir: Path, steps: int, overrides: list[str]) -> dict:
    cfg = load_config(
        ROOT / "configs/tiny.yaml",
        [
            f"run_dir={run_dir}",
            f"data.path={SHAKESPEARE}",
            "data.tokenizer=char",
            *ROUTING,
            f"train.steps={steps}",
            f"train.eval_every={steps}",
            "train.log_every=10",
            *overrides,
        ],
    )
    result = train(cfg)
    return {"val_loss": result.val_loss, "records": read_metrics(run_dir)}


def max_vio(records: list[dict], tail: int) -> list[float]:
    """Per MoE layer: MaxVio of each logged step's load, averaged over the last `tail`."""
    loads = np.array([r["expert_load"] for r in records if r["kind"] == "train"])[-tail:]
    mean = loads.mean(-1, keepdims=True)  # [steps, layers, 1]
    return ((loads.max(-1, keepdims=True) - mean) / mean)[..., 0].mean(0).tolist()


def summarise(rows: list[dict]) -> dict:
    """Per run name: the mean and standard deviation (ddof 0) over seeds of MaxVio per layer
    and of the val loss, and of its difference to the aux-loss run of the same seed."""
    base = {r["seed"]: r["val_loss"] for r in rows if r["run"] == "aux loss 0.01"}
    out = {}
    for name in dict.fromkeys(r["run"] for r in rows):
        mine = [r for r in rows if r["run"] == name]
        vio = np.array([r["max_vio"] for r in mine])
        loss = np.array([r["val_loss"] for r in mine])
        delta = np.array([r["val_loss"] - base[r["seed"]] for r in mine])
        out[name] = {
            "max_vio": vio.mean(0).tolist(),
            "max_vio_std": vio.std(0).tolist(),
            "val_loss": float(loss.mean()),
            "val_loss_std": float(loss.std()),
            "val_loss_delta": float(delta.mean()),
            "val_loss_delta_std": float(delta.std()),
        }
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=600)
    p.add_argument("--rates", type=float, nargs="+", default=[0.001, 0.01])
    p.add_argument("--tail", type=int, default=20, help="logged steps MaxVio is averaged over")
    p.add_argument("--seeds", type=int, nargs="+", default=[0], help="one run per seed each")
    args = p.parse_args(argv)
    if not SHAKESPEARE.is_file():
        print(f"error: {SHAKESPEARE} not found (the shared corpus)", file=sys.stderr)
        return 2
    runs = {"aux loss 0.01": ["moe.lb_loss_weight=0.01"]}
    for rate in args.rates:
        runs[f"aux-loss-free {rate}"] = [
            "moe.lb_loss_weight=0",
            "moe.correction_bias=true",
            f"moe.bias_update_rate={rate}",
        ]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for seed in args.seeds:
            for name, overrides in runs.items():
                out = run(Path(tmp) / f"{name}-{seed}", args.steps, [*overrides, f"seed={seed}"])
                vio = max_vio(out["records"], args.tail)
                rows.append(
                    {"run": name, "seed": seed, "max_vio": vio, "val_loss": out["val_loss"]}
                )
                print(f"{name:<22} seed {seed}: MaxVio {vio}, val loss {out['val_loss']:.4f}",
                      flush=True)  # fmt: skip
    summary = summarise(rows)
    print(f"\n{'run':<22} {'MaxVio per MoE layer':<28} val loss ({args.steps} steps, "
          f"{len(args.seeds)} seeds: mean +- std)   vs the aux loss, same seed")  # fmt: skip
    for name, r in summary.items():
        pairs = zip(r["max_vio"], r["max_vio_std"], strict=True)
        vio = ", ".join(f"{v:.3f}+-{d:.3f}" for v, d in pairs)
        print(f"{name:<22} {vio:<28} {r['val_loss']:.4f} +- {r['val_loss_std']:.4f}"
              f"{'':>22}{r['val_loss_delta']:+.4f} +- {r['val_loss_delta_std']:.4f}")  # fmt: skip
    print(json.dumps({"steps": args.steps, "seeds": args.seeds, "results": rows,
                      "summary": summary}))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
