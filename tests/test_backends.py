"""The one place that picks kernels by backend (`moe_jax/backends.py`) and its config keys."""

import pytest

from moe_jax import backends
from moe_jax.config import ConfigError
from tests.helpers import tiny_config


def test_auto_picks_the_target_backends_kernels_and_targeting_nests():
    assert backends.target() == "cpu"  # the suite runs on the CPU
    assert backends.choose("moe", "auto") == "buckets"
    assert backends.choose("attention", "auto") == "blocked"
    with backends.targeting("cuda"):  # the JAX platform name of NVIDIA GPUs
        assert backends.target() == "gpu"
        assert backends.choose("moe", "auto") == "batched"
        with backends.targeting("tpu"):
            assert backends.choose("moe", "auto") == "ragged"
            assert backends.choose("attention", "auto") == "splash"
            assert not backends.interpret()
        cudnn = "cudnn" if backends.cudnn_installed() else "blocked"
        assert backends.choose("attention", "auto") == cudnn
    assert backends.target() == "cpu" and backends.interpret()
    assert backends.choose("moe", "ragged") == "ragged"  # a named impl is kept


def test_auto_falls_back_where_the_fused_kernel_does_not_take_the_operands():
    with backends.targeting("gpu"):  # cuDNN attention computes in 16 bits only
        want = "cudnn" if backends.cudnn_installed() else "blocked"  # this host may lack it
        assert backends.choose("attention", "auto", dtype="bfloat16") == want
        assert backends.choose("attention", "auto", dtype="float32") == "blocked"
        assert backends.choose("attention", "cudnn", dtype="float32") == "cudnn"  # it says why
    with backends.targeting("tpu"):  # splash tiles the sequence by 128
        assert backends.choose("attention", "auto", length=4096) == "splash"
        assert backends.choose("attention", "auto", length=100) == "blocked"


@pytest.fixture
def gpu_host(monkeypatch):
    """As on a GPU host, where the Mosaic GPU kernels can be built (this CPU cannot)."""
    from moe_jax.kernels import mosaic_gmm as mosaic

    monkeypatch.setattr(mosaic, "available", lambda: True)


def test_auto_picks_the_mosaic_kernels_for_a_dropless_moe_on_one_gpu_only(gpu_host):
    """Dropless on GPU: the Mosaic GPU grouped matmuls where they take the operands (16 bits,
    dims their tiles divide, every expert on the device); the buffers otherwise, and with a
    capacity (measured faster there: backends.AUTO's note)."""
    qwen = {"dims": (2048, 768), "ep": 1}
    with backends.targeting("gpu"):
        pick = lambda **kw: backends.choose("moe", "auto", **kw)
        assert pick(dtype="bfloat16", dropless=True, shape=qwen) == "mosaic"
        assert pick(dtype="bfloat16", dropless=False, shape=qwen) == "batched"
        assert pick(dtype="float32", dropless=True, shape=qwen) == "batched"
        assert pick(dtype="bfloat16", dropless=True, shape={"dims": (2048, 40)}) == "batched"
        assert pick(dtype="bfloat16", dropless=True, shape=qwen | {"ep": 8}) == "batched"
        assert pick(dtype="bfloat16", dropless=True) == "batched"  # shape unknown
    assert backends.choose("moe", "auto", dtype="bfloat16", dropless=True, shape=qwen) == "buckets"
    with backends.targeting("tpu"):
        assert backends.choose("moe", "auto", dropless=True, shape=qwen) == "ragged"


def test_a_cpu_host_compiling_for_gpus_keeps_the_buffers_for_a_dropless_moe():
    with backends.targeting("gpu"):  # moe_jax.aot.command: the kernels cannot be built here
        shape = {"dims": (2048, 768), "ep": 1}
        assert backends.choose("moe", "auto", dtype="bfloat16", dropless=True, shape=shape) == (
            "batched"
        )


def test_the_moe_layer_asks_for_its_own_shape_and_dropping(gpu_host):
    from flax import nnx

    from moe_jax.model.moe import MoE

    def impl(*overrides):
        cfg = tiny_config("moe.expert_hidden=128", "model.d_model=128", *overrides)
        with backends.targeting("gpu"):
            return MoE(cfg, rngs=nnx.Rngs(0))._impl()

    assert impl("model.dtype=bfloat16", "moe.capacity_factor=0") == "mosaic"
    assert impl("model.dtype=bfloat16") == "batched"  # tiny's capacity
    assert impl("model.dtype=float32", "moe.capacity_factor=0") == "batched"
    assert impl("model.dtype=bfloat16", "moe.capacity_factor=0", "moe.expert_hidden=40") == (
        "batched"
    )


def test_a_kernel_for_another_backend_is_refused_in_one_line():
    with backends.targeting("tpu"), pytest.raises(ValueError, match="runs on gpu only, not tpu"):
        backends.choose("attention", "cudnn")
    with backends.targeting("gpu"), pytest.raises(ValueError, match="runs on tpu only, not gpu"):
        backends.choose("moe", "megablox")
    with pytest.raises(ValueError, match="runs on gpu only, not cpu"):
        backends.choose("attention", "cudnn")  # no interpreter for cuDNN
    assert backends.choose("moe", "megablox") == "megablox"  # Pallas TPU: interpreted on CPU


def test_weight_gather_by_backend_and_its_key():
    assert backends.weight_gather() == "partitioner"  # CPU: XLA's partitioner gathers
    with backends.targeting("gpu"):
        assert backends.weight_gather() == "partitioner"
    with backends.targeting("tpu"):
        assert backends.weight_gather() == "steps"
        assert backends.weight_gather("partitioner") == "partitioner"
    assert tiny_config("mesh.weight_gather=steps").mesh.weight_gather == "steps"
    with pytest.raises(ConfigError, match="mesh.weight_gather='zero3' is not supported"):
        tiny_config("mesh.weight_gather=zero3")
    # the steps' largest collective: 8 chips on TPU (v5p-128's fsdp 64 in two steps)
    assert backends.gather_group() == 0
    with backends.targeting("tpu"):
        assert backends.gather_group() == 8
        assert backends.gather_group(0) == 0
    with pytest.raises(ConfigError, match="mesh.gather_group must be -1"):
        tiny_config("mesh.gather_group=-2")


def test_impl_keys_are_validated():
    assert tiny_config("moe.impl=ragged", "attention.impl=splash").moe.impl == "ragged"
    with pytest.raises(ConfigError, match="moe.impl='grouped' is not supported; use one of"):
        tiny_config("moe.impl=grouped")
    with pytest.raises(ConfigError, match="attention.impl='flash' is not supported"):
        tiny_config("attention.impl=flash")


def test_model_dtype_auto_computes_in_bf16_on_accelerators_only():
    from flax import nnx

    from moe_jax.inference.weights import weights_kind
    from moe_jax.model import Transformer

    cfg = tiny_config("model.dtype=auto")
    build = lambda: nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    assert str(build().dtype) == "float32" and weights_kind(cfg) == "float32"
    with backends.targeting("tpu"):
        model = build()
        assert str(model.dtype) == "bfloat16" and weights_kind(cfg) == "bfloat16"
        assert str(model.blocks.layers[0].attn.dtype) == "bfloat16"
    assert backends.compute_dtype("float32") == "float32"  # a named dtype is kept
    with backends.targeting("gpu"):
        assert backends.compute_dtype("float32") == "float32"
        assert backends.compute_dtype("auto") == "bfloat16"


def test_loss_chunk_auto_chunks_the_head_on_accelerators_only():
    assert tiny_config().train.loss_chunk == -1  # the default
    assert backends.loss_chunk(-1, 4096) == 0  # CPU: the whole logits
    assert backends.loss_chunk(64, 4096) == 64  # a set chunk is kept
    with backends.targeting("tpu"):
        assert backends.loss_chunk(-1, 8192) == 1024
        assert backends.loss_chunk(-1, 768) == 256
        assert backends.loss_chunk(-1, 100) == 0  # none divides: the whole logits
        assert backends.loss_chunk(0, 8192) == 0
    with pytest.raises(ConfigError, match=r"must be -1 \(auto\), 0 \(off\) or divide"):
        tiny_config("train.loss_chunk=-2")
