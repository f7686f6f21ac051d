"""The GPU kit's peer: the same model in Hugging Face transformers (torch), on the same GPU,
in a process of its own started after ours has exited (JAX holds most of the GPU's memory
while it lives).

    python benchmarks/gpu/hf_peer.py train|decode [--dry-run]

train: `Qwen3MoeForCausalLM` built from the kit's config (benchmarks/common.py's `hf_config`:
same shapes, routing and attention), float32 parameters under bf16 autocast (as ours: float32
parameters, bf16 compute), sdpa attention, fused AdamW, the router's load-balance loss;
the batch halves on an out-of-memory error. decode: the model in bf16, greedy `generate`
forced to `new` tokens, with the dynamic cache and then the static one (batch 1).
Records as stages.py's (`@@record {json}`).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH / "gpu"))

from stages import GPU_CONFIG, SIZES, error_text, record  # noqa: E402


def _model(cfg, dtype):
    import torch
    import transformers
    from common import hf_config

    hf = hf_config(cfg, "qwen3")
    hf._attn_implementation = "sdpa"
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = transformers.Qwen3MoeForCausalLM(hf).to(dtype=dtype, device=device)
    return model, device


def train(S: dict) -> None:
    import torch

    from moe_jax.config import load_config
    from moe_jax.summary.counts import train_flops_per_token

    cfg = load_config(GPU_CONFIG, S["train_overrides"])
    t = cfg.train
    model, device = _model(cfg, torch.float32)
    model.train()
    model.config.router_aux_loss_coef = cfg.moe.lb_loss_weight
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=t.lr,
        betas=(t.b1, t.b2),
        eps=t.eps,
        weight_decay=t.weight_decay,
        fused=device == "cuda",
    )
    B, T = t.batch_size, t.seq_len
    rec = dict(
        kind="train",
        side="transformers",
        seq=T,
        flops_per_token=train_flops_per_token(cfg),
        versions={
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
        },
    )
    while True:
        try:
            gen = torch.Generator().manual_seed(0)
            ids = torch.randint(0, cfg.model.vocab_size, (B, T), generator=gen).to(device)

            def step(ids=ids):
                with torch.autocast(device, dtype=torch.bfloat16):
                    loss = model(input_ids=ids, labels=ids, output_router_logits=True).loss
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), t.clip_norm)
                opt.step()
                opt.zero_grad(set_to_none=True)
                return loss

            times = []
            for i in range(S["train_steps"] + 2):
                t0 = time.perf_counter()
                loss = float(step())
                if device == "cuda":
                    torch.cuda.synchronize()
                if i >= 2:
                    times.append(time.perf_counter() - t0)
            break
        except torch.OutOfMemoryError:
            opt.zero_grad(set_to_none=True)
            torch.cuda.empty_cache()
            if B == 1:
                record(**rec, error="out of memory at batch 1")
                return
            B //= 2
    rec.update(batch=B, step_s=statistics.median(times), step_s_all=times, loss=loss)
    rec["tokens_per_s"] = B * T / rec["step_s"]
    rec["model_tflops"] = rec["tokens_per_s"] * rec["flops_per_token"] / 1e12
    if device == "cuda":
        rec["peak_bytes"] = torch.cuda.max_memory_allocated()
    record(**rec)


def decode(S: dict) -> None:
    import numpy as np
    import torch

    from moe_jax.config import load_config

    D_ = S["decode"]
    P, N = D_["prompt"], D_["new"]
    length = [f"model.max_seq_len={P + N}", f"train.seq_len={P + N}"]
    cfg = load_config(GPU_CONFIG, [*S["train_overrides"], *length])
    model, device = _model(cfg, torch.bfloat16)
    model.eval()
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    # generate is slow here (a Python loop over the experts each token), so each setting is
    # timed once after a short warm-up, the target's first: batch 1 with the dynamic cache,
    # then the static one, then the other batches
    batches = sorted({B for B, kind in D_["cases"] if kind == "bfloat16"})
    runs = [("dynamic", batches[0]), ("static", batches[0])]
    runs += [("dynamic", B) for B in batches[1:]]
    for cache, B in runs:
        rec = dict(kind="decode", side="transformers", batch=B, prompt=P, new=N, cache=cache)
        try:
            ids = torch.from_numpy(np.random.default_rng(B).integers(0, 256, (B, P)))
            ids = ids.to(device)
            kw = dict(
                attention_mask=torch.ones_like(ids),
                max_new_tokens=N,
                min_new_tokens=N,
                do_sample=False,
            )
            if cache == "static":
                kw["cache_implementation"] = "static"

            def run(ids=ids, kw=kw, **more):
                with torch.inference_mode():
                    out = model.generate(ids, **{**kw, **more})
                sync()
                return out

            # warm-up: the static cache's shape (and any compile of it) follows the length
            run(**({} if cache == "static" else dict(max_new_tokens=8, min_new_tokens=8)))
            t0 = time.perf_counter()
            run()
            rec["generate_s"] = time.perf_counter() - t0
            rec["tokens_per_s"] = B * N / rec["generate_s"]
            rec["step_ms"] = 1e3 * rec["generate_s"] / N  # prefill included
        except Exception as e:
            rec["error"] = error_text(e)
        record(**rec)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("stage", choices=("train", "decode"))
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args(argv)
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        record(kind=args.stage, side="transformers", skipped=f"not installed: {e.name}")
        return 0
    S = SIZES["dry" if args.dry_run else "gpu"]
    (train if args.stage == "train" else decode)(S)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
