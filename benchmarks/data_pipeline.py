"""The input pipeline: prepare throughput, and the train step fed by prepared data vs synthetic.

    python benchmarks/data_pipeline.py                       # 32 MB, byte + BPE, 1 and 2 workers
    python benchmarks/data_pipeline.py --mb 64 --steps 30 --set train.batch_size=32

Prepare: tinyshakespeare (../shared/data, 1.1 MB) replicated to `--mb` MB in a temporary
directory, as a JSONL file of its paragraphs (one document a line: the usual form of a real
corpus) and as one text file split with `--separator`. Each is prepared (`moe_jax.prepare`,
exactly what `python -m moe_jax.prepare` runs, progress bar off) with the byte tokenizer and
with a byte-level BPE (vocabulary `--vocab`) that the script trains on tinyshakespeare with
`tokenizers`, on 1 and 2 worker processes. MB/s counts input bytes (the file sizes); the best
of `--repeats` runs is reported, since other load only ever slows a run down.

Train step: the tiny model (configs/tiny.yaml plus `--set`), its real jitted train step on one
device (as `train.py` runs it by default), on batches of the byte store packed into windows
with segment ids and positions. `synthetic`: the same step on one batch of the same form
with random tokens, made up front and already on the device (no input pipeline at all, as
train_throughput.py measures). `on device`: the prepared batches, all taken from the
iterator and put on the device up front (real text routes differently from random tokens,
and the MoE layers compute only the expert rows tokens fill, so `on device` - `synthetic` is
the content's effect). `prepared`: the same batches in the same order, but each step takes
the next one from a fresh Grain iterator (`data.num_workers` threads) and puts it on the
device, as the trainer's loop does: `prepared` - `on device` is the pipeline's cost.
The three take turns step by step, in a rotating order (all see the same machine load);
medians over `--steps` steps each after 3 untimed; `data ms` is the median time of
`next(iterator)` alone. Each step is waited for here, so a batch's preparation counts in its
step time (the trainer dispatches steps asynchronously, so there it overlaps the previous
step): the pipeline is no bottleneck when `prepared` equals `on device`. Prints two tables
and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from common import count

from moe_jax.process_setup import reexec_with_hugepages

SHAKESPEARE = Path(__file__).resolve().parents[2] / "shared/data/tinyshakespeare.txt"
SEPARATOR = "\n\n"  # tinyshakespeare's speeches are paragraphs


def make_inputs(directory: Path, mb: int) -> dict[str, Path]:
    """tinyshakespeare repeated to `mb` MB: a JSONL file of paragraphs and a text file."""
    text = SHAKESPEARE.read_text()
    copies = -(-mb * 2**20 // len(text.encode()))
    paragraphs = [p for p in text.split(SEPARATOR) if p]
    jsonl, txt = directory / "corpus.jsonl", directory / "corpus.txt"
    with open(jsonl, "w") as f:
        for _ in range(copies):
            f.writelines(json.dumps({"text": p}) + "\n" for p in paragraphs)
    txt.write_text(SEPARATOR.join([text] * copies))
    return {"jsonl": jsonl, "text": txt}


def train_bpe(directory: Path, vocab: int) -> Path:
    """A byte-level BPE trained on tinyshakespeare, with an EOS, as a tokenizer directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=["<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train([str(SHAKESPEARE)], trainer)
    out = directory / "bpe"
    out.mkdir()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return out


def bench_prepare(inputs, tokenizers, workers, repeats: int, scratch: Path) -> list[dict]:
    from moe_jax.prepare import prepare

    rows = []
    for kind, path in inputs.items():
        size = path.stat().st_size
        for name, tok in tokenizers.items():
            for w in workers:
                times = []
                for r in range(repeats):
                    out = scratch / f"{kind}-{name}-{w}-{r}"
                    separator = SEPARATOR if kind == "text" else None
                    t0 = time.perf_counter()
                    meta = prepare([str(path)], tok, out, separator=separator, workers=w)
                    times.append(time.perf_counter() - t0)
                best = min(times)
                rows.append(
                    {
                        "input": kind,
                        "tokenizer": name,
                        "workers": w,
                        "mb": size / 2**20,
                        "seconds": best,
                        "mb_s": size / 2**20 / best,
                        "mtok_s": meta["tokens"] / best / 1e6,
                        "store": str(out),
                    }
                )
                print(
                    f"{kind:6} {name:5} {w:7d} {rows[-1]['mb']:7.1f} {best:8.2f} "
                    f"{rows[-1]['mb_s']:8.1f} {rows[-1]['mtok_s']:8.2f}",
                    flush=True,
                )
    return rows


def bench_step(store: str, overrides: list[str], steps: int) -> dict:
    """Median step times: random tokens, prepared batches on the device up front, and the same
    batches through the iterator (see the module doc)."""
    import jax

    from moe_jax.config import load_config
    from moe_jax.data import load_data
    from moe_jax.sharding import make_mesh
    from moe_jax.train.loop import _on_mesh
    from moe_jax.train.step import init_state, make_optimizer, make_train_step

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "configs/tiny.yaml", [f"data.path={store}", *overrides])
    data = load_data(cfg)
    mesh = make_mesh(cfg)
    tx = make_optimizer(cfg.train)
    with jax.set_mesh(mesh):
        graphdef, state = init_state(cfg, tx, mesh=mesh)
        step = make_train_step(cfg, graphdef, tx, jax.tree.map(lambda a: a.sharding, state))
        n = steps + 3
        ahead = data.train_iterator(cfg)
        batches = [next(ahead) for _ in range(n)]
        placed = iter([_on_mesh(b, mesh) for b in batches])
        it = data.train_iterator(cfg)  # the same batches again, through the pipeline
        rng = np.random.default_rng(0)
        fake = {k: v.copy() for k, v in batches[0].items()}
        fake["tokens"] = rng.integers(0, 256, fake["tokens"].shape, dtype=np.int32)
        fake = _on_mesh(fake, mesh)

        def run(batch) -> float:
            nonlocal state
            t0 = time.perf_counter()
            state, metrics = step(state, batch())
            jax.block_until_ready(metrics)
            return time.perf_counter() - t0

        sources = {
            "synthetic": lambda: fake,
            "on_device": lambda: next(placed),
            "prepared": lambda: _on_mesh(next(it), mesh),
        }
        times = {name: [] for name in sources}
        names = list(sources)
        for i in range(n):  # in turns, so all three see the same machine load; the order
            for name in names[i % 3 :] + names[: i % 3]:  # rotates: no one always goes first
                seconds = run(sources[name])
                if i >= 3:
                    times[name].append(seconds)
    fetch = []
    for _ in range(steps):
        t0 = time.perf_counter()
        next(it)
        fetch.append(time.perf_counter() - t0)
    t = cfg.train
    return {
        "batch": t.batch_size,
        "seq_len": t.seq_len,
        "num_workers": cfg.data.num_workers,
        **{f"{name}_ms": 1e3 * statistics.median(ts) for name, ts in times.items()},
        "data_ms": 1e3 * statistics.median(fetch),
    }


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mb", type=count(1), default=32, help="input size in MB (default 32)")
    p.add_argument("--vocab", type=count(300), default=4096, help="BPE vocabulary (4096)")
    p.add_argument("--repeats", type=count(1), default=2, help="prepare runs, best taken (2)")
    p.add_argument("--steps", type=count(1), default=30, help="timed train steps each (30)")
    p.add_argument("--set", action="append", default=[], help="config override for the step")
    args = p.parse_args(argv)
    if not SHAKESPEARE.is_file():
        print(f"error: {SHAKESPEARE} not found", file=sys.stderr)
        return 2
    import jax

    from moe_jax.tokenizer import ByteTokenizer, load_tokenizer

    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        inputs = make_inputs(scratch, args.mb)
        tokenizers = {
            "byte": ByteTokenizer(),
            "bpe": load_tokenizer(str(train_bpe(scratch, args.vocab))),
        }
        workers = sorted({1, min(2, len(os.sched_getaffinity(0)))})
        print(f"prepare: tinyshakespeare x {args.mb} MB, best of {args.repeats}")
        print("input  tok   workers      MB  seconds     MB/s   Mtok/s")
        rows = bench_prepare(inputs, tokenizers, workers, args.repeats, scratch)
        store = next(r["store"] for r in rows if r["input"] == "jsonl" and r["tokenizer"] == "byte")
        step = bench_step(store, args.set, args.steps)
    print(
        f"\ntrain step: configs/tiny.yaml, batch {step['batch']} x {step['seq_len']}, "
        f"{jax.devices()[0].platform} x1, data.num_workers={step['num_workers']}"
    )
    print("batches      step ms  data ms")
    print(f"synthetic   {step['synthetic_ms']:8.1f}        -")
    print(f"on device   {step['on_device_ms']:8.1f}        -")
    print(f"prepared    {step['prepared_ms']:8.1f} {step['data_ms']:8.2f}")
    print(json.dumps({"prepare": rows, "step": step, "jax": jax.__version__}))
    return 0


if __name__ == "__main__":
    reexec_with_hugepages()
    sys.exit(main(sys.argv[1:]))
