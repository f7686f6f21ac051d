"""The GPU kit's JAX stages, one per process (`kit.py` starts them): each prints its results
as `@@record {json}` lines as soon as it has them, so a stage killed at its time limit keeps
what it measured.

    python benchmarks/gpu/stages.py ceilings|kernels|train|decode [--dry-run]

--dry-run: the same code at tiny sizes on the CPU (the kernels that need a GPU report their
error as a record instead of a time).
"""

from __future__ import annotations

import argparse
import contextlib
import faulthandler
import gc
import importlib.metadata
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from functools import partial
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(BENCH))  # benchmarks/: the CPU benchmarks' train-step builder

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from moe_jax.observe.profile import kernel_kind, profile  # noqa: E402, F401  (kernel_kind: the tests')

GPU_CONFIG = BENCH / "configs" / "gpu_1b.yaml"
# Sizes on the GPU and in the CPU dry run.
SIZES = {
    "gpu": dict(
        matmul=8192,
        copy_bytes=4 << 30,
        attn=dict(B=2, T=4096, H=32, K=4, hd=128, window=1024, docs=4),
        moe=dict(tokens=2 * 4096, D=2048, F=768, E=32, k=8),
        train_overrides=[],
        # B 8 x 4096 without remat needs 115 GiB of temporaries besides the 42 GiB of fp32
        # params, grads and Adam (H200, 2026-11-26); B 8 with full remat was the fastest there
        # (41.6% MFU against B 4's 38.8%): profiled first; then what keeps more of the forward
        # to skip its recomputation
        # (issue 54) remat dots was the fastest with the capacity buffers (49,866 tok/s, 42.2%
        # by the all-keys count): the baseline; then the grouped kernels of `mosaic`
        # dropless, profiled, and at the same capacity; then dropless with full remat
        # (2026-11-28) dropless first, profiled; then at batch 12 (B 8 peaked at 74 of the
        # H200's 139 GiB: the fixed per-step costs, AdamW's ~75 GB of traffic among them,
        # spread over 1.5x the tokens); then the capacity buffers' baseline
        train_variants=[
            ["model.remat=dots", "moe.impl=mosaic", "moe.capacity_factor=0", "+profile"],
            ["model.remat=dots", "moe.impl=mosaic", "moe.capacity_factor=0", "train.batch_size=12"],
            ["model.remat=dots"],
        ],
        train_steps=6,
        # (batch, weights, overrides; "+one_row": weight_gather.TWO_ROWS_ON_GPU off): the
        # first profiled; the second the step before the two-row projections, the last with
        # the picked-experts kernel (issue 55), in the same process. On 2026-11-28 this stage
        # printed nothing past the kernel timings within 150 s, twice (the cause unknown:
        # the progress lines and the stack dump at the limit say where, next time)
        decode=dict(
            cases=[
                (1, "bfloat16", ()),
                (1, "bfloat16", ("+one_row",)),
                (8, "bfloat16", ()),
                (1, "int8", ()),
                (1, "bfloat16", ("moe.decode_impl=triton",)),
            ],
            prompt=128,
            new=256,
            repeats=3,
        ),
        # decoding's expert product alone: one token's top-8 rows, a gate-shaped stack
        picked=dict(
            J=8,
            E=32,
            K=2048,
            N=768,
            blocks=[(64, 32, 4, 4), (64, 64, 4, 4), (128, 32, 4, 3), (32, 64, 4, 4)],
        ),
    ),
    "dry": dict(
        matmul=256,
        copy_bytes=8 << 20,
        attn=dict(B=1, T=256, H=4, K=2, hd=64, window=64, docs=2),
        moe=dict(tokens=256, D=256, F=128, E=8, k=2),  # dims the Mosaic tiles divide
        train_overrides=[
            "model.vocab_size=512",
            "model.d_model=64",
            "model.n_layers=2",
            "attention.n_heads=4",
            "attention.n_kv_heads=2",
            "attention.head_dim=16",
            "moe.n_experts=4",
            "moe.top_k=2",
            "moe.expert_hidden=32",
            "train.batch_size=2",
            "train.seq_len=128",
            "model.max_seq_len=256",
        ],
        train_variants=[["+profile"], ["moe.impl=ragged", "moe.capacity_factor=0"]],
        train_steps=2,
        decode=dict(
            cases=[
                (1, "bfloat16", ()),
                (1, "bfloat16", ("+one_row",)),
                (2, "bfloat16", ()),
                (1, "int8", ()),
                (1, "bfloat16", ("moe.decode_impl=triton",)),
            ],
            prompt=8,
            new=8,
            repeats=1,
        ),
        picked=dict(J=4, E=8, K=128, N=64, blocks=[(64, 32, 4, 4)], rounds=1),
    ),
}
TRITON_FLAG = "jax_ragged_dot_use_gpu_pallas_triton_lowering"
PACKAGES = (
    "jax",
    "jaxlib",
    "jax-cuda13-plugin",
    "jax-cuda13-pjrt",
    "flax",
    "optax",
    "orbax-checkpoint",
    "tensorstore",
    "grain",
    "numpy",
    "tokamax",
    "triton",
    "torch",
    "transformers",
    "nvidia-cudnn-cu13",
)


def progress(what: str) -> None:
    """A stage's progress on stderr (the kit's log): where a stage killed at its limit was."""
    print(f"[{time.strftime('%H:%M:%S')}] {what}", file=sys.stderr, flush=True)


def record(**fields) -> None:
    print("@@record " + json.dumps(fields, default=float), flush=True)


def error_text(e: BaseException) -> str:
    """The exception's last line, shortened: a record, not a traceback."""
    lines = [ln for ln in str(e).strip().splitlines() if ln.strip()]
    return f"{type(e).__name__}: {lines[-1] if lines else ''}"[:400]


def timed(fn, *args, warmup: int = 2, repeats: int = 10) -> float:
    """Median seconds of `fn(*args)` (blocking on its result) after `warmup` calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


@contextlib.contextmanager
def flag(name: str, value):
    old = getattr(jax.config, name)
    jax.config.update(name, value)
    try:
        yield
    finally:
        jax.config.update(name, old)


# ----------------------------------------------------------------------------- ceilings


def ceilings(S: dict) -> None:
    """The device, the versions, and the two ceilings: bf16 matmul FLOP/s, HBM copy GB/s."""
    import io
    from contextlib import redirect_stdout

    dev = jax.devices()[0]
    info = io.StringIO()
    with redirect_stdout(info):
        jax.print_environment_info()
    versions = {}
    for name in PACKAGES:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            versions[name] = importlib.metadata.version(name)
    cudnn = None
    with contextlib.suppress(Exception):
        from jax._src.lib import cuda_versions

        cudnn = cuda_versions.cudnn_get_version()
    stats = dev.memory_stats() or {}
    record(
        kind="device",
        backend=jax.default_backend(),
        device_kind=dev.device_kind,
        devices=jax.device_count(),
        memory_bytes=stats.get("bytes_limit"),
        cudnn=cudnn,
        versions=versions,
        environment=info.getvalue(),
    )
    n = S["matmul"]
    keys = jax.random.split(jax.random.key(0), 4)
    # Random operands, two pairs in turn: zeros run faster than real data (METHOD.md).
    pairs = [
        (
            jax.random.normal(keys[i], (n, n), jnp.bfloat16),
            jax.random.normal(keys[i + 1], (n, n), jnp.bfloat16),
        )
        for i in (0, 2)
    ]
    matmul = jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=jnp.bfloat16))
    jax.block_until_ready(matmul(*pairs[0]))
    times = []
    for i in range(20):
        t0 = time.perf_counter()
        jax.block_until_ready(matmul(*pairs[i % 2]))
        times.append(time.perf_counter() - t0)
    record(
        kind="ceiling", what="bf16 matmul", n=n, tflops=2 * n**3 / statistics.median(times) / 1e12
    )
    words = S["copy_bytes"] // 4
    x = [jax.random.normal(keys[i], (words,), jnp.float32) for i in (0, 1)]
    scale = jax.jit(lambda a: a * 1.0001)  # reads and writes every byte once
    jax.block_until_ready(scale(x[0]))
    times = []
    for i in range(20):
        t0 = time.perf_counter()
        jax.block_until_ready(scale(x[i % 2]))
        times.append(time.perf_counter() - t0)
    record(
        kind="ceiling",
        what="hbm copy",
        bytes=2 * words * 4,
        gbs=2 * words * 4 / statistics.median(times) / 1e9,
    )


# ----------------------------------------------------------------------------- kernels


def _attention_inputs(A: dict):
    B, T, H, K, hd = A["B"], A["T"], A["H"], A["K"], A["hd"]
    ks = jax.random.split(jax.random.key(1), 4)
    q = jax.random.normal(ks[0], (B, T, H, hd), jnp.bfloat16)
    k = jax.random.normal(ks[1], (B, T, K, hd), jnp.bfloat16)
    v = jax.random.normal(ks[2], (B, T, K, hd), jnp.bfloat16)
    dout = jax.random.normal(ks[3], (B, T, H, hd), jnp.bfloat16)
    # documents of random lengths, the same in every row (packed sequences)
    cuts = np.sort(np.random.default_rng(0).choice(np.arange(1, T), A["docs"] - 1, False))
    seg = np.zeros(T, np.int32)
    for c in cuts:
        seg[c:] += 1
    return q, k, v, dout, jnp.asarray(np.broadcast_to(seg, (B, T)))


def _reference_attention(q, k, v, case, window, seg):
    """float32 softmax attention with the mask spelled out (GQA by repeating k/v)."""
    B, T, H, hd = q.shape
    G = H // k.shape[2]
    q, k, v = (a.astype(jnp.float32) for a in (q, k, v))
    k, v = jnp.repeat(k, G, axis=2), jnp.repeat(v, G, axis=2)
    s = jnp.einsum("bthd,bshd->bhts", q, k, precision="highest") * hd**-0.5
    t, s_ = jnp.arange(T)[:, None], jnp.arange(T)[None, :]
    mask = s_ <= t
    if case == "window":
        mask &= s_ > t - window
    mask = jnp.broadcast_to(mask, (B, 1, T, T))
    if case == "packed":
        mask &= (seg[:, :, None] == seg[:, None, :])[:, None]
    p = jax.nn.softmax(jnp.where(mask, s, -jnp.inf), axis=-1)
    return jnp.einsum("bhts,bshd->bthd", p, v, precision="highest")


def _attention_impls(A: dict, dry: bool) -> dict:
    """name -> fn(q, k, v, case, seg) -> out, for the cases it takes (else it raises)."""
    from moe_jax.model import attention_kernels

    window = A["window"]
    G = A["H"] // A["K"]

    def ours_cudnn(q, k, v, case, seg):
        return attention_kernels.cudnn(
            q, k, v, seg if case == "packed" else None, window=window if case == "window" else 0
        )

    def xla(q, k, v, case, seg):
        mask = None
        if case == "packed":
            mask = (seg[:, :, None] == seg[:, None, :])[:, None]
        return jax.nn.dot_product_attention(
            q,
            k,
            v,
            mask=mask,
            is_causal=True,
            implementation="xla",
            local_window_size=(window - 1, 0) if case == "window" else None,
        )

    def pallas_triton(q, k, v, case, seg):
        from jax.experimental.pallas.ops.gpu import attention as triton_attention

        if case == "window":
            raise NotImplementedError("no sliding window in jax's Triton flash attention")
        return triton_attention.mha(
            q,
            jnp.repeat(k, G, axis=2),
            jnp.repeat(v, G, axis=2),
            seg if case == "packed" else None,
            sm_scale=q.shape[-1] ** -0.5,
            causal=True,
            interpret=dry,
        )

    def pallas_mosaic(q, k, v, case, seg):
        from jax.experimental.pallas.ops.gpu import attention_mgpu

        if case != "causal":
            raise NotImplementedError("jax's Mosaic GPU attention takes no window or segments")
        config = attention_mgpu.TuningConfig(
            block_q=64, block_kv=64, max_concurrent_steps=2, causal=True
        )
        return attention_mgpu.attention(q * q.shape[-1] ** -0.5, k, v, config)

    def tokamax_impl(name):
        def fn(q, k, v, case, seg):
            tokamax = import_tokamax()
            mask = None
            if case == "packed":
                mask = (seg[:, :, None] == seg[:, None, :])[:, None]
            return tokamax.dot_product_attention(
                q,
                k,
                v,
                mask=mask,
                is_causal=True,
                implementation=name,
                local_window_size=(window - 1, 0) if case == "window" else None,
            )

        return fn

    return {
        "xla": xla,
        "cudnn (moe_jax)": ours_cudnn,
        "pallas triton": pallas_triton,
        "pallas mosaic": pallas_mosaic,
        "tokamax mosaic": tokamax_impl("mosaic"),
        "tokamax triton": tokamax_impl("triton"),
    }


def import_tokamax():
    """tokamax, whose package init imports xprof (a 32 MB wheel) for its own benchmarking
    helpers only: the kit does not carry it, so a placeholder module stands in."""
    import types

    if "xprof" not in sys.modules:
        with contextlib.suppress(ImportError):
            import xprof  # noqa: F401
    if "xprof" not in sys.modules:
        tools = types.ModuleType("xprof.cli.tools")
        tools.get_kernel_stats_tool = None
        sys.modules.update(
            {
                "xprof": types.ModuleType("xprof"),
                "xprof.cli": types.ModuleType("xprof.cli"),
                "xprof.cli.tools": tools,
            }
        )
    import tokamax

    return tokamax


def kernels_attention(S: dict, dry: bool) -> None:
    A = S["attn"]
    q, k, v, dout, seg = _attention_inputs(A)
    B, T, H, hd = q.shape
    fwd_flops = 4 * B * H * hd * T * T / 2  # causal: half the score matrix
    refs = {}
    for case in ("causal", "window", "packed"):
        ref = lambda q, k, v, case=case: _reference_attention(q, k, v, case, A["window"], seg)
        out, vjp = jax.vjp(jax.jit(ref), q, k, v)
        refs[case] = (out, vjp(dout.astype(jnp.float32)))
    for name, fn in _attention_impls(A, dry).items():
        for case in ("causal", "window", "packed"):
            print(f"attention: {name} {case}", file=sys.stderr, flush=True)
            rec = dict(kind="attention", impl=name, case=case, shape=[B, T, H, A["K"], hd])
            try:
                f = jax.jit(lambda q, k, v, fn=fn, case=case: fn(q, k, v, case, seg))
                out, vjp = jax.vjp(f, q, k, v)
                grads = vjp(dout)
                want_out, want_grads = refs[case]
                rec["err"] = {
                    n: rel_err(a, b)
                    for n, a, b in zip(
                        ("out", "dq", "dk", "dv"),
                        (out, *grads),
                        (want_out, *want_grads),
                        strict=True,
                    )
                }
                if case == "causal":
                    rec["fwd_ms"] = 1e3 * timed(f, q, k, v)
                    bwd = jax.jit(lambda q, k, v, f=f: jax.vjp(f, q, k, v)[1](dout))
                    rec["fwd_bwd_ms"] = 1e3 * timed(bwd, q, k, v)
                    rec["fwd_tflops"] = fwd_flops / rec["fwd_ms"] / 1e9
                    rec["fwd_bwd_tflops"] = 3.5 * fwd_flops / rec["fwd_bwd_ms"] / 1e9
            except Exception as e:  # a kernel that cannot run here is a finding, not a crash
                rec["error"] = error_text(e)
            record(**rec)


def _moe_inputs(M: dict):
    n = M["tokens"] * M["k"]
    ks = jax.random.split(jax.random.key(2), 5)
    x = jax.random.normal(ks[0], (n, M["D"]), jnp.bfloat16)
    scale = M["D"] ** -0.5
    wg = jax.random.normal(ks[1], (M["E"], M["D"], M["F"]), jnp.bfloat16) * scale
    wu = jax.random.normal(ks[2], (M["E"], M["D"], M["F"]), jnp.bfloat16) * scale
    wd = jax.random.normal(ks[3], (M["E"], M["F"], M["D"]), jnp.bfloat16) * M["F"] ** -0.5
    # each token's k distinct experts, uniformly: the rows' group sizes
    picks = np.argsort(np.random.default_rng(3).random((M["tokens"], M["E"])), axis=1)[:, : M["k"]]
    sizes = jnp.asarray(np.bincount(picks.ravel(), minlength=M["E"]), jnp.int32)
    dy = jax.random.normal(ks[4], (n, M["D"]), jnp.bfloat16)
    return x, (wg, wu, wd), sizes, dy


def _swiglu(matmul):
    def f(x, w, sizes):
        wg, wu, wd = w
        h = jax.nn.silu(matmul(x, wg, sizes)) * matmul(x, wu, sizes)
        return matmul(h.astype(x.dtype), wd, sizes)

    return f


def _batched(C: int):
    """The capacity path's matmuls: every [E, C] slot, filled or not (the rows' scatter into
    the buffers is counted in). Rows beyond an expert's C are dropped, as there."""

    def matmul(x, w, sizes):
        starts = jnp.cumsum(sizes) - sizes
        idx = starts[:, None] + jnp.arange(C)[None, :]
        valid = jnp.arange(C)[None, :] < sizes[:, None]
        buf = jnp.where(valid[..., None], x[jnp.minimum(idx, x.shape[0] - 1)], 0)
        y = jnp.einsum("ecd,edf->ecf", buf, w, preferred_element_type=jnp.float32)
        out = jnp.zeros((x.shape[0], w.shape[-1]), jnp.float32)
        return out.at[jnp.where(valid, idx, x.shape[0])].set(y, mode="drop").astype(x.dtype)

    return matmul


def _moe_impls(M: dict) -> dict:
    """name -> (fn(x, w, sizes) -> y, config flags to trace it under)."""
    E = M["E"]
    C = math.ceil(1.25 * M["tokens"] * M["k"] / E)

    def ragged(x, w, sizes):
        return jax.lax.ragged_dot(x, w, sizes, preferred_element_type=jnp.float32).astype(x.dtype)

    def mosaic(x, w, sizes):  # moe.impl=mosaic: jax's Mosaic GPU kernels, our VJP
        from moe_jax.kernels import mosaic_gmm

        return mosaic_gmm.grouped_matmul(x, w, sizes)

    # Measured on the H200 and left out since: XLA's ragged_dot (26.5 ms forward, 171 ms with
    # the backward), its Triton lowering (missing from jax 0.11.2), tokamax's Triton
    # ragged_dot ("Unknown implementation"), jax's Mosaic ragged_dot alone (no VJP: `mosaic`
    # is it with ours), tokamax's Mosaic ragged_dot (7.99 ms fwd+bwd, dW_down off by 2.8e-2,
    # 2026-11-26 and 27; its autotuning took a minute of the stage).
    return {
        "batched buffers (capacity 1.25)": (_batched(C), {}),
        "mosaic (moe_jax: jax's kernels, our VJP)": (mosaic, {}),
    }


# Tiles the sweep times: (block_m, block_n, block_k, max_concurrent_steps, grid_block_n)
FWD_TILES = [(128, 128, 64, 4, 1), (128, 128, 64, 4, 8), (128, 192, 64, 4, 1), (64, 128, 64, 6, 1)]
WGRAD_TILES = [
    (128, 128, 64, 4, 1),
    (128, 128, 64, 4, 8),
    (128, 128, 128, 3, 1),
    (64, 128, 64, 4, 1),
]


def kernel_tiles(S: dict) -> None:
    """jax's two Mosaic GPU kernels alone at each tile of the sweep: the forward's three
    products (and dx's, with the weights transposed) and the weight gradients' three, on
    the kernels' benchmark rows. Picks mosaic's tiles."""
    M = S["moe"]
    x, (wg, wu, wd), sizes, dy = _moe_inputs(M)
    h = jax.random.normal(jax.random.key(7), (x.shape[0], M["F"]), jnp.bfloat16)
    n, D, F = x.shape[0], M["D"], M["F"]
    try:
        from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu, transposed_ragged_dot_mgpu
    except ImportError as e:
        return record(kind="tile", error=error_text(e))
    names = ("block_m", "block_n", "block_k", "max_concurrent_steps", "grid_block_n")
    for which, tiles in (("fwd", FWD_TILES), ("dx", FWD_TILES), ("wgrad", WGRAD_TILES)):
        for tile in tiles:
            kw = dict(zip(names, tile, strict=True))
            rec = dict(kind="tile", which=which, tile=list(tile))
            try:
                if which == "fwd":  # gate, up (K = D), down (K = F)
                    mm = partial(ragged_dot_mgpu.ragged_dot, group_sizes=sizes, **kw)
                    f = jax.jit(lambda x, h, mm=mm: (mm(x, wg), mm(x, wu), mm(h, wd)))
                elif which == "dx":  # dy @ w^T: down's (K = D), gate and up's (K = F)
                    mm = partial(
                        ragged_dot_mgpu.ragged_dot, group_sizes=sizes, transpose_rhs=True, **kw
                    )
                    f = jax.jit(lambda x, h, mm=mm: (mm(x, wd), mm(h, wg), mm(h, wu)))
                else:  # x^T dh twice (gate, up), h^T dy (down)
                    mm = partial(
                        transposed_ragged_dot_mgpu.transposed_ragged_dot, group_sizes=sizes, **kw
                    )
                    f = jax.jit(lambda x, h, mm=mm: (mm(x, h), mm(x, h), mm(h, dy)))
                rec["ms"] = 1e3 * timed(f, x, h)
                rec["tflops"] = 3 * 2 * n * D * F / rec["ms"] / 1e9
            except Exception as e:
                rec["error"] = error_text(e)
            record(**rec)


def kernels_moe(S: dict) -> None:
    M = S["moe"]
    x, w, sizes, dy = _moe_inputs(M)
    n = x.shape[0]
    flops = 2 * n * M["D"] * M["F"] * 3  # three projections of the routed rows
    # The reference: every expert's rows as one batched matmul over buffers as deep as the
    # largest group (nothing dropped), float32. XLA's ragged_dot is not it: on the H200 with
    # jax 0.11.2 it was still running when the stage's 120 s ran out, twice (2026-11-26).
    exact = _batched(int(jnp.max(sizes)))
    ref = _swiglu(lambda a, b, s: exact(a.astype(jnp.float32), b.astype(jnp.float32), s))
    want, vjp = jax.vjp(jax.jit(lambda x, w: ref(x, w, sizes)), x, w)
    want_grads = vjp(dy.astype(jnp.float32))
    for name, (matmul, flags) in _moe_impls(M).items():
        print(f"moe: {name}", file=sys.stderr, flush=True)  # the log says where a hang was
        rec = dict(kind="moe", impl=name, rows=n, D=M["D"], F=M["F"], E=M["E"])
        try:
            with contextlib.ExitStack() as stack:
                for f_name, value in flags.items():
                    stack.enter_context(flag(f_name, value))
                f = _swiglu(matmul)
                fwd = jax.jit(f).lower(x, w, sizes).compile()
                rec["err"] = {"y": rel_err(fwd(x, w, sizes), want)}
                rec["fwd_ms"] = 1e3 * timed(fwd, x, w, sizes)
                rec["fwd_tflops"] = flops / rec["fwd_ms"] / 1e9
                bwd = jax.jit(lambda x, w, f=f: jax.vjp(lambda x, w: f(x, w, sizes), x, w)[1](dy))
                bwd = bwd.lower(x, w).compile()
                gx, gw = bwd(x, w)
                rec["err"]["dx"] = rel_err(gx, want_grads[0])
                rec["err"]["dw_down"] = rel_err(gw[2], want_grads[1][2])
                rec["fwd_bwd_ms"] = 1e3 * timed(bwd, x, w)
                rec["fwd_bwd_tflops"] = 3 * flops / rec["fwd_bwd_ms"] / 1e9
        except Exception as e:
            rec["error"] = error_text(e)
        record(**rec)


def kernels(S: dict, dry: bool, only: str | None = None) -> None:
    if only != "attention":  # first: the attention kernels were all timed on the H200
        kernels_moe(S)
        kernel_tiles(S)
    if only != "moe":
        kernels_attention(S, dry)


# ----------------------------------------------------------------------------- training


def train(S: dict, dry: bool, index: int | None = None) -> None:
    """The real train step (train.py's) of the kit's model, each variant in a process of its
    own (`--variant-index`): the peak memory read from the device (`peak_bytes_in_use`) is a
    running maximum over the process, so variants sharing one inherited the earlier peaks."""
    variants = S["train_variants"]
    if index is not None:
        return train_variant(S, variants[index])
    for i in range(len(variants)):
        cmd = [sys.executable, __file__, "train", "--variant-index", str(i)]
        rc = subprocess.call(cmd + (["--dry-run"] if dry else []))
        if rc != 0:  # a crash (out of memory, a kernel fault) is a record too
            record(kind="train", variant=" ".join(variants[i]), error=f"exit status {rc}")


def train_variant(S: dict, variant: list[str]) -> None:
    from train_throughput import real_train_step

    from moe_jax import backends
    from moe_jax.config import load_config
    from moe_jax.summary.counts import param_counts, train_flops_per_token
    from moe_jax.summary.peaks import chip_peak_flops

    overrides = [o for o in variant if not o.startswith("+")]
    rec = dict(kind="train", variant=" ".join(o for o in variant if o != "+profile") or "auto")
    try:
        cfg = load_config(GPU_CONFIG, [*S["train_overrides"], *overrides])
        B, T = cfg.train.batch_size, cfg.train.seq_len
        total, active = param_counts(cfg)
        dtype = backends.compute_dtype(cfg.model.dtype)
        flops = train_flops_per_token(cfg)  # the peers' causal count (summary.py)
        rec.update(
            batch=B,
            seq=T,
            params=total,
            active=active,
            flops_per_token_causal=flops,
            flops_per_token_all_keys=train_flops_per_token(cfg, causal=False),
            dtype=dtype,
            attention=backends.choose("attention", cfg.attention.impl, dtype=dtype, length=T),
            moe=backends.choose(  # as the MoE layer picks it (one GPU: every expert here)
                "moe",
                cfg.moe.impl,
                dtype=dtype,
                dropless=cfg.moe.capacity_factor <= 0,
                shape={"dims": (cfg.model.d_model, cfg.moe.expert_hidden), "ep": 1},
            ),
            capacity_factor=cfg.moe.capacity_factor,
        )
        t0 = time.perf_counter()
        step, state, batches = real_train_step(cfg)
        rec["init_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        state, metrics = step(state, batches[0])
        jax.block_until_ready(metrics)
        rec["first_step_s"] = time.perf_counter() - t0
        losses, times = [float(metrics["loss"])], []
        for i in range(1, S["train_steps"] + 2):
            t0 = time.perf_counter()
            state, metrics = step(state, batches[i % len(batches)])
            jax.block_until_ready(metrics)
            times.append(time.perf_counter() - t0)
            losses.append(float(metrics["loss"]))
        times = times[1:]  # the second call can still settle (allocations, autotuning)
        rec["step_s"] = statistics.median(times)
        rec["step_s_all"] = times
        rec["tokens_per_s"] = B * T / rec["step_s"]
        rec["model_tflops"] = rec["tokens_per_s"] * flops / 1e12
        rec["device_kind"] = jax.devices()[0].device_kind
        if peak := chip_peak_flops(rec["device_kind"]):
            rec["mfu_causal"] = rec["model_tflops"] * 1e12 / peak
            rec["mfu_all_keys"] = rec["tokens_per_s"] * rec["flops_per_token_all_keys"] / peak
        rec["losses"] = losses
        if "dropped_frac" in metrics:  # per layer: their mean
            rec["dropped_frac"] = float(np.mean(np.asarray(metrics["dropped_frac"])))
        stats = jax.devices()[0].memory_stats() or {}
        rec["peak_bytes"] = stats.get("peak_bytes_in_use")
        rec["compile_s"] = rec["first_step_s"] - rec["step_s"]
        if "+profile" in variant:  # where the step's time goes
            state, prof = _profiled(step, state, batches[0])
            record(kind="profile", variant=rec["variant"], **prof)
    except Exception as e:
        rec["error"] = error_text(e)
        traceback.print_exc()
    record(**rec)


def _profiled(step, state, batch):
    """Two more train steps under the profiler -> (the state after them, `profile`'s dict).
    The compiled step's HLO charges each kernel to its named part (attention, router,
    experts, ...): a GPU trace's kernel events name their fusion, not its op_name; without
    it every kernel was "other" (2026-11-28)."""
    box = {"state": state}

    def one_step():
        box["state"], metrics = step(box["state"], batch)
        jax.block_until_ready(metrics)

    with jax.set_mesh(step.mesh):  # the executable the calls run: compiled once already
        hlo_text = step.jitted.lower(state, batch).compile().as_text()
    with tempfile.TemporaryDirectory() as trace_dir:
        prof = profile(one_step, 2, trace_dir, hlo_text)
    return box["state"], prof


# ----------------------------------------------------------------------------- decode


def decode_bytes_per_step(cfg, B: int, length: float, kind: str = "bfloat16") -> dict:
    """The bytes one decode step must read: every layer's attention, router and norm weights,
    the head, the experts the batch's tokens pick (expected distinct experts of B tokens'
    uniform top-k picks), in bf16 (int8: one byte a matmul weight, scales aside), and the bf16
    KV cache up to `length` positions."""
    m, a, e = cfg.model, cfg.attention, cfg.moe
    D, hd, L = m.d_model, cfg.head_dim, m.n_layers
    attn = D * hd * (2 * a.n_heads + 2 * a.n_kv_heads) + 2 * D + 2 * hd
    picked = e.n_experts * (1 - (1 - e.top_k / e.n_experts) ** B)
    experts = picked * 3 * D * e.expert_hidden + D * e.n_experts
    weights = (1 if kind == "int8" else 2) * (L * (attn + experts) + D * m.vocab_size + D)
    cache = 2 * L * B * 2 * a.n_kv_heads * hd * length
    return {"weights": weights, "kv_cache": cache, "total": weights + cache}


def decode(S: dict, dry: bool, variant: str = "") -> None:
    """Our sampler's greedy decode, each (batch, weights) case of S["decode"] in turn; then the
    first case once more under jax.profiler (kernels and device-busy time per token).
    `variant` (a name for XLA_FLAGS the kit set for this process) tags the records and runs
    the first case only."""
    from flax import nnx

    from moe_jax.config import load_config
    from moe_jax.inference.sampling import Sampler
    from moe_jax.inference.weights import to_kind
    from moe_jax.model import Transformer, weight_gather

    D_ = S["decode"]
    P, N = D_["prompt"], D_["new"]
    length = [f"model.max_seq_len={P + N}", f"train.seq_len={P + N}"]
    cases = D_["cases"][:1] if variant else D_["cases"]
    if not variant:
        picked_kernel(S, dry)
    samplers = {}
    for B, kind, extra in cases:
        rec = dict(kind="decode", batch=B, prompt=P, new=N, weights=kind,
                   variant=" ".join([variant, *extra]).strip())  # fmt: skip
        weight_gather.TWO_ROWS_ON_GPU = "+one_row" not in extra  # read when first traced
        try:
            progress(f"decode case B {B} {kind} {' '.join(extra)}")
            if (kind, extra) not in samplers:
                samplers.clear()  # one model on the device at a time
                gc.collect()
                overrides = [o for o in extra if not o.startswith("+")]
                cfg = load_config(GPU_CONFIG, [*S["train_overrides"], *length, *overrides])
                model = Transformer(cfg, rngs=nnx.Rngs(0))
                progress("model initialised")
                model = to_kind(model, kind)
                samplers[(kind, extra)] = Sampler(model, consume=True)
                del model
                progress("sampler built")
            sampler = samplers[(kind, extra)]
            prompts = np.random.default_rng(B).integers(0, 256, (B, P)).tolist()
            run = partial(_generate_tokens, sampler, prompts)
            t0 = time.perf_counter()
            run(N)
            first = time.perf_counter() - t0
            progress(f"first generate (compiles) {first:.1f} s")
            run(1)
            whole = statistics.median([_wall(run, N) for _ in range(D_["repeats"])])
            prefill = statistics.median([_wall(run, 1) for _ in range(D_["repeats"])])
            rec.update(
                compile_s=first - whole,
                generate_s=whole,
                prefill_ms=1e3 * prefill,
                step_ms=1e3 * (whole - prefill) / (N - 1),
                tokens_per_s=B * N / whole,
                bytes_per_step=decode_bytes_per_step(cfg, B, P + N / 2, kind),
            )
            if (B, kind, extra) == cases[0]:
                with tempfile.TemporaryDirectory() as trace_dir:
                    prof = profile(partial(run, N), 1, trace_dir)
                record(
                    kind="profile",
                    variant=f"decode B {B} {kind} {variant}".strip(),
                    per_token=N,
                    **prof,
                )
        except Exception as e:
            rec["error"] = error_text(e)
            traceback.print_exc()
        record(**rec)


def picked_kernel(S: dict, dry: bool) -> None:
    """Decoding's expert product alone, one token's top-k rows against a gate-shaped stack:
    the Triton kernel reading the picked weights in place (at each block shape) against
    XLA's gather and two-row GEMM; GB/s of the picked weights' bytes, error against float64."""
    from moe_jax.kernels import picked_matmul
    from moe_jax.model import experts

    M = S["picked"]
    J, E, K, N = M["J"], M["E"], M["K"], M["N"]
    ks = jax.random.split(jax.random.key(5), 2)
    x = jax.random.normal(ks[0], (J, K), jnp.bfloat16)
    # several stacks in turn: one would sit in the L2 cache between calls (METHOD.md)
    ws = [jax.random.normal(jax.random.fold_in(ks[1], i), (E, K, N), jnp.bfloat16)
          for i in range(4)]  # fmt: skip
    e = jnp.asarray(np.random.default_rng(0).permutation(E)[:J], jnp.int32)
    want = np.einsum("jk,jkn->jn", np.asarray(x, np.float64), np.asarray(ws[0], np.float64)[e])
    gather = jax.jit(lambda x, w, e: experts.rows_matmul(x, w[e]))
    impls = {"gather + GEMM (XLA)": gather}
    for blocks in M["blocks"]:
        fn = partial(picked_matmul.picked_matmul, blocks=tuple(blocks), interpret=dry)
        impls[f"triton {tuple(blocks)}"] = jax.jit(fn)
    nbytes, R = J * K * N * 2, M.get("rounds", 10)

    def chain(fn):  # R rounds over the stacks in one program (a call is ~20 us: dispatch
        # would dominate); each call's input depends on the last output, so none is elided
        def run(x, ws, e):
            acc = jnp.zeros((J, N), jnp.float32)
            for _ in range(R):
                for w in ws:
                    x = (x.astype(jnp.float32) + 0.0 * acc[:, :1]).astype(x.dtype)
                    acc = acc + fn(x, w, e).astype(jnp.float32)
            return acc

        return jax.jit(run)

    for name, fn in impls.items():
        rec = dict(kind="picked", impl=name, J=J, E=E, K=K, N=N)
        try:
            rec["err"] = rel_err(fn(x, ws[0], e), want)
            rec["us"] = 1e6 * timed(chain(fn), x, ws, e, repeats=5) / (R * len(ws))
            rec["gbs"] = nbytes / rec["us"] / 1e3
        except Exception as err:
            rec["error"] = error_text(err)
        record(**rec)


def _generate_tokens(sampler, prompts, n: int):
    return sampler.generate(prompts, n, temperature=0).tokens


def _wall(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


STAGES = {"ceilings": ceilings, "kernels": kernels, "train": train, "decode": decode}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("stage", choices=sorted(STAGES))
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--variant", default="", help="decode: a tag for the XLA_FLAGS it runs under")
    p.add_argument("--variant-index", type=int, help="train: this variant only, in this process")
    p.add_argument("--only", choices=("moe", "attention"), help="kernels: these only")
    args = p.parse_args(argv)
    if limit := float(os.environ.get("MOE_JAX_STAGE_LIMIT", 0)):
        # every thread's Python stack in the log shortly before the kit kills the stage
        faulthandler.dump_traceback_later(max(limit - 3, 1), exit=False)
    S = SIZES["dry" if args.dry_run else "gpu"]
    fn = STAGES[args.stage]
    if args.stage == "ceilings":
        fn(S)
    elif args.stage == "decode":
        fn(S, args.dry_run, args.variant)
    elif args.stage == "train":
        fn(S, args.dry_run, args.variant_index)
    else:
        fn(S, args.dry_run, args.only)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
