"""Which implementation of each kernel runs on which backend: the one place that chooses.

XLA:CPU and the accelerators want different code. The CPU paths (the blocked attention with
its hand-written backward, the experts' filled-row buckets picked by `lax.switch`) are tuned
for XLA:CPU and measured by the CPU benchmarks; on a GPU or TPU a `lax.switch` synchronises
or serialises, and fused kernels exist. Each choice has a config key whose value `auto`
defers to the table below for the backend the program is compiled for:

    attention.impl  blocked | cudnn | splash
    moe.impl        buckets | batched | ragged | megablox | mosaic
    moe.decode_impl gather | triton   (decoding's picked experts)
    moe.exchange    buffers | ragged   (how expert-parallel ragged layers move tokens)
    mesh.weight_gather  partitioner | steps  (how training gathers attention and head weights)
    mesh.gather_group   0 | N  (steps: the most devices one of their collectives spans)
    model.dtype     float32 | bfloat16 (the compute dtype)
    train.loss_chunk  positions per chunk of the loss's head (-1 = auto)

The target backend is the one JAX runs on, or the one `targeting(...)` names while a program
is traced for another (`moe_jax.aot` compiles TPU and GPU programs on a CPU host). The choice
is made when the model is traced, so a run saved on one backend runs its own best path on
another.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

from moe_jax.errors import MoeJaxError

# backend -> kernel -> the implementation `auto` picks there
AUTO = {
    "cpu": {"attention": "blocked", "moe": "buckets", "decode": "gather"},
    # GPU, measured on an H200 (jax 0.11.2, CUDA 13, cuDNN 9.19; benchmarks/gpu/, 2026-11-26).
    # Attention, causal bf16 fwd+bwd at B 2 x T 4096, 32 q / 4 kv heads of 128: cuDNN 2.45 ms
    # (392 TFLOP/s), tokamax's Mosaic GPU kernel 2.90, tokamax Triton 4.02, jax's Pallas Triton
    # 7.35 (no sliding window), XLA 19.7; cuDNN also takes the window and packed documents.
    # MoE, SwiGLU of a 65k-row Qwen3-shaped layer (E 32, D 2048, F 768), fwd+bwd: tokamax's
    # Mosaic GPU ragged_dot 8.09 ms (229 TFLOP/s) but its down-projection weight gradient
    # off by 2.8% (relative; the others 0.5%); the batched capacity buffers (factor 1.25,
    # padding and scatter included) 13.09 ms (142 TFLOP/s); XLA's ragged_dot 171 ms; jax's
    # Pallas Mosaic ragged_dot has no VJP (fwd 1.70 ms), its Triton lowering is missing from
    # jax 0.11.2. So batched stays until a grouped kernel is both fast and exact here.
    # The ~1B-active train step with these, 8 x 4096: 42.2% MFU (remat dots).
    # Decoding's picked experts: XLA's gather + two-row GEMM, 19.8-21.6 us for one token's
    # 8 rows of a [32, 2048, 768] stack on the H200, where the Triton kernel that reads them
    # in place (`moe.decode_impl=triton`) took 23.4 at its best blocks (2026-11-28).
    "gpu": {"attention": "cudnn", "moe": "batched", "decode": "gather"},
    # Dropless (moe.capacity_factor <= 0) on GPU: the grouped rows through jax's Mosaic GPU
    # kernels with our VJP (`kernels/mosaic_gmm.py`), where every expert is on the device
    # (ep 1: the ragged exchange has not run on several GPUs yet), in 16 bits, at dims
    # their tiles divide; else the row above. The batched buffers, dropless, hold C = every
    # token a group routes for every expert: E / k times the rows (4x for the kit's model).
    # The kit's model, 8 x 4096 on an H200 (2026-11-27): dropless 47,026 tokens/s (39.8%
    # MFU by the all-keys count) against 49,342 for the buffers at capacity 1.25.
    # TPU MoE: XLA lowers ragged_dot on TPU to its own Mosaic grouped-matmul kernel. megablox
    # (the Pallas kernel shipped in jax) runs without a mesh only: its pallas_call declares
    # no varying mesh axes, which the expert shard_map requires.
    "tpu": {"attention": "splash", "moe": "ragged", "decode": "gather"},
}
AUTO_DROPLESS = {"gpu": {"moe": "mosaic"}}
# model.dtype=auto: the compute dtype each backend runs (parameters stay float32). XLA:CPU has
# no fast bf16 matmuls; the accelerators' matrix units are bf16.
COMPUTE_DTYPE = {"cpu": "float32", "gpu": "bfloat16", "tpu": "bfloat16"}
# Weights stored in 16 bits for a wider compute dtype (sample.weights=bfloat16 on CPU) are
# converted where they are used. XLA:CPU can neither multiply nor gather bf16, and left to it
# the float32 copies of every weight were alive at once (hoisted out of the decode loop,
# scheduled up front): 2.1x the weights in temporaries. Where True the model converts them
# in their turn and in parts (model/in_turn.py), and the sampler compiles its loop without
# XLA's loop-invariant code motion (LOOP_COMPILER_OPTIONS), which would hoist them again. On
# the accelerators the compute dtype is the weights' bf16: nothing is converted, nothing
# changes.
CONVERTS_IN_TURN = {"cpu": True, "gpu": False, "tpu": False}
LOOP_COMPILER_OPTIONS = {"xla_disable_hlo_passes": "while-loop-invariant-code-motion"}
# Where each kernel lives (moe_jax/model/ unless said): attention `blocked` attention.py,
# `cudnn` and `splash` attention_kernels.py (cuDNN's training form: kernels/cudnn_attention.py);
# moe `buckets` row_buckets.py, `batched` experts.py (`expert_swiglu`'s batched matmul),
# `ragged` and `megablox` grouped.py (XLA's ragged_dot, the Pallas TPU grouped matmul),
# `mosaic` kernels/mosaic_gmm.py; decode `gather` experts.py (`rows_matmul`), `triton`
# kernels/picked_matmul.py.
IMPLS = {
    "attention": ("auto", "blocked", "cudnn", "splash"),
    "moe": ("auto", "buckets", "batched", "ragged", "megablox", "mosaic"),
    "decode": ("auto", "gather", "triton"),
}
# Kernels for one backend only (the others run everywhere). The Pallas TPU kernels also run
# on CPU, in interpret mode (slow: for tests of their numerics).
ONLY_ON = {"cudnn": "gpu", "splash": "tpu", "megablox": "tpu", "mosaic": "gpu", "triton": "gpu"}
INTERPRETED_ON_CPU = ("splash", "megablox", "triton")
# How the expert-parallel MoE layer moves tokens to the experts' shards and back, for the
# grouped impl (moe.impl=ragged) by backend: "ragged" sends only the routed rows with
# `ragged_all_to_all`; "buffers" sends the fixed [E, C] capacity buffers with `all_to_all`,
# padding included (E / k times the routed rows when dropless). XLA:CPU has no
# ragged-all-to-all ("HLO opcode `ragged-all-to-all` is not supported by XLA:CPU
# ThunkEmitter"); the other impls run on the buffers everywhere, and so do exchanges too
# small for the grouped matmul (decoding: `experts.MAP_MIN_CAPACITY`).
EXCHANGE = {"cpu": "buffers", "gpu": "ragged", "tpu": "ragged"}
EXCHANGES = ("auto", "ragged", "buffers")
GROUPED_EXCHANGE = ("ragged", "mosaic")  # the grouped impls whose rows go by the ragged exchange
# How training gathers the attention weights and the head, split over the batch axes
# (ZeRO-3), and sends their gradients back (mesh.weight_gather, moe_jax/model/weight_gather.py):
# "partitioner" leaves both to XLA; "steps" gathers inside a shard_map one batch axis at a time, so
# the gradients leave as reduce-scatters over one axis each. libtpu turns a collective over
# the whole 64-chip torus of v5p-128 into an all-reduce (the gathers of a zero-padded buffer,
# the gradients whole), where one over 8 chips stays what it is (benchmarks/results/aot.md).
WEIGHT_GATHER = {"cpu": "partitioner", "gpu": "partitioner", "tpu": "steps"}
WEIGHT_GATHERS = ("auto", "partitioner", "steps")
# With the steps, the most devices one gather or reduce-scatter spans (mesh.gather_group; 0 =
# a whole axis): a longer batch axis is gathered in steps of at most this many, within groups
# of consecutive devices and then across the groups. On v5p-128 a single fsdp axis of 64
# spans the whole torus, which libtpu again turns into all-reduces; two steps of 8 stay
# reduce-scatters (benchmarks/results/aot.md).
GATHER_GROUP = {"cpu": 0, "gpu": 0, "tpu": 8}


class KernelError(MoeJaxError, ValueError):
    """A kernel named for a backend, dtype or shape it cannot run on (the CLIs print it in
    one line and exit 2)."""


_target: contextvars.ContextVar[str | None] = contextvars.ContextVar("target", default=None)


def normalise(platform: str) -> str:
    """A JAX platform name as a backend of the table: cuda/rocm -> gpu."""
    return "gpu" if platform in ("cuda", "rocm", "gpu") else platform


def target() -> str:
    """The backend programs are being traced for."""
    import jax  # here: the config imports this module, and the CLIs check configs before jax

    return _target.get() or normalise(jax.default_backend())


@contextlib.contextmanager
def targeting(platform: str):
    """Trace for `platform` (e.g. a compile-only TPU topology) whatever JAX runs on."""
    token = _target.set(normalise(platform))
    try:
        yield
    finally:
        _target.reset(token)


@functools.cache
def cudnn_installed() -> bool:
    """Whether this host has cuDNN, without which JAX refuses to trace cuDNN attention (a GPU
    host has it with jax[cuda12]; a CPU host compiling for GPUs may not)."""
    from jax._src.lib import cuda_versions

    try:
        cuda_versions.cudnn_get_version()
    except (RuntimeError, AttributeError):
        return False
    return True


def takes(
    impl: str, dtype=None, length: int | None = None, sinks: bool = False, shape=None
) -> bool:
    """Whether a fused kernel takes these operands here: cuDNN attention computes in 16 bits
    only, needs cuDNN on the host and has no attention sinks (JAX's API takes none); splash
    tiles the sequence by 128; the Mosaic GPU grouped matmuls take 16 bits, dims their tiles
    divide (`shape["dims"]`) and every expert on the device (`shape["ep"]` 1). Where auto's
    kernel does not, the backend's other path runs."""
    import jax.numpy as jnp

    if impl == "mosaic":
        from moe_jax.kernels import mosaic_gmm

        dims, ep = (shape or {}).get("dims"), (shape or {}).get("ep", 1)
        sixteen = dtype is not None and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
        fits = dims is not None and mosaic_gmm.dims_fit(*dims)
        return sixteen and fits and ep == 1 and mosaic_gmm.available()

    if impl == "triton":
        from moe_jax.kernels import picked_matmul

        dims = (shape or {}).get("dims")
        return dims is not None and picked_matmul.fits(*dims) and picked_matmul.available()
    if impl == "cudnn":
        return (dtype is None or jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)) and (
            cudnn_installed() and not sinks
        )
    if impl == "splash" and length is not None:
        return length % 128 == 0
    return True


def choose(
    kernel: str,
    impl: str,
    *,
    dtype=None,
    length: int | None = None,
    sinks: bool = False,
    dropless: bool = False,
    shape: dict | None = None,
) -> str:
    """The implementation of `kernel` to trace: `impl`, or the target's own for auto (for a
    `dropless` MoE its AUTO_DROPLESS entry first; the CPU's where that kernel does not take
    the operands' `dtype`, sequence `length`, attention `sinks` or MoE `shape`). A kernel
    named for another backend, or for sinks it cannot take, is refused here, in one line,
    not by the compiler."""
    backend = target()
    if impl == "auto":
        pick = AUTO.get(backend, AUTO["cpu"])[kernel]
        first = AUTO_DROPLESS.get(backend, {}).get(kernel) if dropless else None
        if first and takes(first, dtype, length, sinks, shape):
            return first
        return pick if takes(pick, dtype, length, sinks, shape) else AUTO["cpu"][kernel]
    if impl == "cudnn" and sinks:
        raise KernelError(
            "attention.impl=cudnn takes no attention sinks (JAX's cuDNN attention has no sink "
            "logits); set attention.impl=auto or blocked, which take them"
        )
    need = ONLY_ON.get(impl)
    on_cpu_too = backend == "cpu" and impl in INTERPRETED_ON_CPU
    if need is not None and backend != need and not on_cpu_too:
        raise KernelError(
            f"{kernel} implementation '{impl}' runs on {need} only, not {backend}; "
            f"set the {kernel} impl to auto"
        )
    return impl


def weight_gather(setting: str = "auto") -> str:
    """mesh.weight_gather resolved for the target backend."""
    return WEIGHT_GATHER[target()] if setting == "auto" else setting


def gather_group(setting: int = -1) -> int:
    """mesh.gather_group resolved for the target backend (-1 = auto)."""
    return GATHER_GROUP[target()] if setting == -1 else setting


def exchange(moe_impl: str, setting: str = "auto") -> str:
    """How expert-parallel MoE layers of the resolved `moe_impl` move tokens: `setting`
    ("ragged" | "buffers"), or for auto the target's EXCHANGE entry where the impl is the
    grouped one (its rows never need buffers), else the buffers."""
    backend = target()
    if setting == "auto":
        return EXCHANGE.get(backend, "buffers") if moe_impl in GROUPED_EXCHANGE else "buffers"
    if setting == "ragged" and (
        moe_impl not in GROUPED_EXCHANGE or EXCHANGE.get(backend) != "ragged"
    ):
        raise KernelError(
            f"the ragged MoE exchange needs moe.impl=ragged (or mosaic) on gpu or tpu, not "
            f"{moe_impl} on {backend}; set the exchange to auto"
        )
    return setting


def converts_in_turn() -> bool:
    """Whether the target converts 16-bit weights for a wider compute dtype in their turn and
    in parts (CONVERTS_IN_TURN)."""
    return CONVERTS_IN_TURN.get(target(), False)


def loop_compiler_options(converts: bool) -> dict | None:
    """XLA options for a program that loops over the weights (the sampler's decode loop):
    without loop-invariant code motion where it `converts` weights in turn, else None."""
    return dict(LOOP_COMPILER_OPTIONS) if converts and converts_in_turn() else None


def compute_dtype(dtype: str) -> str:
    """`model.dtype` with auto resolved for the target backend."""
    return COMPUTE_DTYPE.get(target(), "float32") if dtype == "auto" else dtype


LOSS_CHUNKS = (1024, 512, 256)  # train.loss_chunk=-1 on accelerators: the first dividing T


def loss_chunk(chunk: int, length: int) -> int:
    """`train.loss_chunk` with -1 (auto) resolved: on CPU 0 (the whole logits: the chunks'
    loop and recomputed head cost XLA:CPU time, and host memory is not short), on GPU / TPU
    the largest of LOSS_CHUNKS dividing the `length` positions (else 0), where the [B, T, V]
    float32 logits would take HBM (16 GiB for 8k tokens at Llama 4's vocabulary)."""
    if chunk != -1:
        return chunk
    if target() == "cpu":
        return 0
    return next((c for c in LOSS_CHUNKS if length % c == 0), 0)


def interpret() -> bool:
    """Whether Pallas kernels run interpreted (on the CPU)."""
    return target() == "cpu"
