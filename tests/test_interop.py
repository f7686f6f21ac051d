"""Hugging Face interop parity against `transformers` (torch CPU, float32, eager attention).

For each family a tiny random transformers model (every weight redrawn, norm scales too, so
that swapped or transposed tensors cannot hide behind ones and zeros) is saved, imported and
compared: logits, greedy generation, and the round trip ours -> save_hf -> transformers.
The configs switch on what each family can do: Llama 4 with NoPE + temperature tuning
(floor_scale 4), chunked attention (chunk 8 < sequence 24), interleaved dense/MoE layers,
top-2 sigmoid routing, llama3 RoPE scaling in its interpolated band, and a tail layer;
Mixtral with a sliding window; Qwen3-MoE with a dense tail layer, attention biases,
head_dim != d/heads and unnormalised top-k; Llama with biases and linear RoPE scaling;
Qwen3 with tied embeddings and an all-layer sliding window.

Tolerance: the issue's 1e-4 absolute on logits of O(1) (std ~0.8). Both sides compute the
same float32 math in different orders; measured differences are ~1e-6.
Budget: ~60 s on 2 cores (15 small XLA compiles dominate); the CLI test that carries a
tokenizer (import -> sample.py with text and --chat against transformers' `generate` ->
export) adds ~5 s, one sampling program.
"""

from __future__ import annotations

import dataclasses
import json
import os
import runpy
import shutil
import stat
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch", reason="interop tests need torch (the `interop` extra)")
transformers = pytest.importorskip(
    "transformers", reason="interop tests need transformers (the `interop` extra)"
)

from moe_jax.config import load_config  # noqa: E402
from moe_jax.interop import InteropError, load_hf, save_hf  # noqa: E402
from moe_jax.interop.convert import config_from_hf  # noqa: E402
from moe_jax.interop.safetensors_io import TensorReader  # noqa: E402
from moe_jax.model import Transformer  # noqa: E402
from tests.helpers import forward, forward_cached  # noqa: E402
from tests.test_tokenizer import SHAKESPEARE, write_bpe  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

TOL = 1e-4
V = 128
NO_SPECIAL_TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
COMMON = dict(vocab_size=V, hidden_size=64, num_attention_heads=4, num_key_value_heads=2)

# name -> (transformers class, config class, config kwargs, greedy batch size)
SPECS = {
    "llama4": (
        "Llama4ForCausalLM",
        "Llama4TextConfig",
        dict(
            intermediate_size=32,
            intermediate_size_mlp=48,
            num_hidden_layers=5,
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            interleave_moe_layer_step=2,
            no_rope_layer_interval=4,
            attention_chunk_size=8,
            attn_temperature_tuning=True,
            floor_scale=4,
            attn_scale=0.5,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=4.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
            max_position_embeddings=256,
        ),
        1,  # decode reads only the picked experts (B * k < E)
    ),
    "mixtral": (
        "MixtralForCausalLM",
        "MixtralConfig",
        dict(
            intermediate_size=32,
            num_hidden_layers=3,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=6,
            max_position_embeddings=256,
        ),
        2,  # decode through the expert buffers
    ),
    "qwen3_moe": (
        "Qwen3MoeForCausalLM",
        "Qwen3MoeConfig",
        dict(
            intermediate_size=48,
            moe_intermediate_size=32,
            num_hidden_layers=3,
            head_dim=24,
            num_experts=4,
            num_experts_per_tok=2,
            decoder_sparse_step=2,
            norm_topk_prob=False,
            attention_bias=True,
            max_position_embeddings=256,
        ),
        1,
    ),
    "gpt_oss": (
        "GptOssForCausalLM",
        "GptOssConfig",
        dict(
            intermediate_size=32,
            num_hidden_layers=4,  # layer_types: sliding, full, sliding, full
            head_dim=16,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=6,
            # low enough that the redrawn weights' gate and up values cross it
            swiglu_limit=0.3,
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=150000.0,
                factor=4.0,
                beta_fast=32.0,
                beta_slow=1.0,
                original_max_position_embeddings=64,  # x factor = max_position_embeddings
                truncate=False,
            ),
            max_position_embeddings=256,
        ),
        1,
    ),
    "llama": (
        "LlamaForCausalLM",
        "LlamaConfig",
        dict(
            intermediate_size=48,
            num_hidden_layers=2,
            attention_bias=True,
            rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0),
            max_position_embeddings=256,
        ),
        2,
    ),
    "qwen3": (
        "Qwen3ForCausalLM",
        "Qwen3Config",
        dict(
            intermediate_size=48,
            num_hidden_layers=2,
            head_dim=16,
            tie_word_embeddings=True,
            use_sliding_window=True,
            sliding_window=5,
            max_window_layers=0,
            max_position_embeddings=256,
        ),
        2,
    ),
}


def hf_model(name: str, seed: int = 0, **overrides):
    model_cls, config_cls, kwargs, _ = SPECS[name]
    settings = COMMON | kwargs | NO_SPECIAL_TOKENS | overrides
    config = getattr(transformers, config_cls)(**settings)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            noise = 0.1 * torch.randn(p.shape, generator=g)
            p.copy_(1.0 + noise if pname.endswith("norm.weight") else noise)
    return model


def hf_logits(model, tokens: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.from_numpy(tokens)).logits.numpy()


def our_logits(model, tokens: np.ndarray) -> np.ndarray:
    return np.asarray(forward(model, jnp.asarray(tokens, jnp.int32))[0])


def random_model(cfg, seed: int) -> Transformer:
    """Our model with every param drawn like `hf_model` does (norm scales 1 + noise, the
    rest noise); NumPy draws, so no per-shape XLA compile as with eager jax.random."""
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))))
    rng = np.random.default_rng(seed)
    new = []
    for path, var in nnx.to_flat_state(abstract):
        noise = 0.1 * rng.standard_normal(var.shape, dtype=np.float32)
        new.append((path, var.copy(jnp.asarray(1.0 + noise if path[-1] == "scale" else noise))))
    return nnx.merge(graphdef, nnx.from_flat_state(new))


def params_of(model) -> dict:
    return {p: np.asarray(v[...]) for p, v in nnx.to_flat_state(nnx.state(model, nnx.Param))}


def assert_same_params(a, b) -> None:
    pa, pb = params_of(a), params_of(b)
    assert pa.keys() == pb.keys()
    for path in pa:
        np.testing.assert_array_equal(pa[path], pb[path], err_msg=str(path))


def greedy_ours(model, prompt: np.ndarray, n_new: int) -> np.ndarray:
    B, T0 = prompt.shape
    cache = model.init_cache(B, T0 + n_new)
    positions = jnp.broadcast_to(jnp.arange(T0, dtype=jnp.int32), (B, T0))
    logits, _, cache = forward_cached(model, jnp.asarray(prompt, jnp.int32), positions, cache)
    out = [jnp.argmax(logits[:, -1], axis=-1)]
    for t in range(T0, T0 + n_new - 1):
        step = out[-1][:, None].astype(jnp.int32)
        logits, _, cache = forward_cached(model, step, jnp.full((B, 1), t, jnp.int32), cache)
        out.append(jnp.argmax(logits[:, -1], axis=-1))
    return np.stack([np.asarray(o) for o in out], axis=1)


@pytest.fixture(scope="module", params=list(SPECS))
def case(request, tmp_path_factory):
    """(name, HF dir, HF model, our imported config and model) for one family."""
    name = request.param
    directory = tmp_path_factory.mktemp(name) / "hf"
    model = hf_model(name)
    model.save_pretrained(directory)
    cfg, ours = load_hf(directory)
    return name, directory, model, cfg, ours


def tokens(B: int, T: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, V, (B, T)).astype(np.int64)


# ----------------------------------------------------------------------------- parity


def test_imported_logits_match_transformers(case):
    name, _, model, cfg, ours = case
    assert cfg.moe.capacity_factor == 0  # imported models drop no token, like transformers
    x = tokens(3, 24)
    ref = hf_logits(model, x)
    assert np.std(ref) > 0.3  # the redrawn weights give O(1) logits, so 1e-4 is tight
    np.testing.assert_allclose(our_logits(ours, x), ref, rtol=0, atol=TOL)


def test_greedy_generation_matches_transformers(case):
    name, _, model, _, ours = case
    batch = SPECS[name][3]
    prompt, n_new = tokens(batch, 5, seed=1), 14  # 19 positions: past a Llama 4 chunk of 8
    with torch.no_grad():
        ref = model.generate(
            torch.from_numpy(prompt), max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False
        ).numpy()[:, prompt.shape[1] :]
    np.testing.assert_array_equal(greedy_ours(ours, prompt, n_new), ref)


def test_round_trip_through_transformers(case, tmp_path):
    name, _, model, cfg, ours = case
    fresh = random_model(cfg, seed=2)
    out = tmp_path / "export"
    # A 100 kB shard limit makes every one of these models write several shards and an index.
    arch = save_hf(cfg, fresh, out, max_shard_bytes=100_000)
    assert arch == type(model).__name__
    assert (out / "model.safetensors.index.json").is_file()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    x = tokens(3, 24, seed=3)
    np.testing.assert_allclose(hf_logits(loaded.eval(), x), our_logits(fresh, x), rtol=0, atol=TOL)
    # And back: the exported directory imports to the same config and identical weights.
    cfg2, back = load_hf(out)
    assert cfg2 == cfg
    assert_same_params(back, fresh)


# ----------------------------------------------------------------------------- layouts


@pytest.fixture(scope="module")
def mixtral_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("mixtral_layouts")
    model = hf_model("mixtral", seed=5)
    model.save_pretrained(directory / "plain")
    return model, directory


def test_sharded_and_fused_checkpoints_import_identically(mixtral_dir):
    model, directory = mixtral_dir
    model.save_pretrained(directory / "sharded", max_shard_size="40KB")
    assert (directory / "sharded" / "model.safetensors.index.json").is_file()
    # transformers>=5 in-memory layout: fused experts [E, 2F, D] and the router under mlp.
    model.save_pretrained(directory / "fused", save_original_format=False)
    fused_names = TensorReader(directory / "fused").names()
    assert "model.layers.0.mlp.experts.gate_up_proj" in fused_names
    _, plain = load_hf(directory / "plain")
    for variant in ("sharded", "fused"):
        _, other = load_hf(directory / variant)
        assert_same_params(plain, other)


def test_gpt_oss_mxfp4_checkpoint_imports_its_dequantised_experts(tmp_path):
    """A checkpoint as gpt-oss is released: the experts as MXFP4 `*_blocks` / `*_scales` and
    a quantization_config. The weights are made MXFP4-exact first, so that a float checkpoint
    of the same model exists: both import to identical params, and our logits equal those of
    transformers' own MXFP4 loading (`Mxfp4Config(dequantize=True)`) of the packed files."""
    import json

    from safetensors.numpy import save_file

    from moe_jax.interop import mxfp4

    model = hf_model("gpt_oss", seed=3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(GPT_OSS_EXPERTS):
                exact = mxfp4.dequantize(*mxfp4.quantize(p.numpy())).astype(np.float32)
                p.copy_(torch.from_numpy(exact))
    model.save_pretrained(tmp_path / "float")
    packed = tmp_path / "mxfp4"
    packed.mkdir()
    tensors = gpt_oss_as_released(model)
    assert sum(a.dtype == np.uint8 for a in tensors.values()) == 4 * 4  # 4 layers' experts
    save_file(tensors, str(packed / "model.safetensors"))
    config = json.loads((tmp_path / "float" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (packed / "config.json").write_text(json.dumps(config))

    cfg, ours = load_hf(packed)
    assert cfg == load_hf(tmp_path / "float")[0]
    assert_same_params(ours, load_hf(tmp_path / "float")[1])
    theirs = transformers.AutoModelForCausalLM.from_pretrained(
        packed,
        quantization_config=transformers.Mxfp4Config(dequantize=True),
        attn_implementation="eager",
        dtype=torch.float32,
    )
    x = tokens(2, 16, seed=4)
    np.testing.assert_allclose(our_logits(ours, x), hf_logits(theirs.eval(), x), rtol=0, atol=TOL)


def test_llama4_multimodal_checkpoint_imports_its_text_model(tmp_path):
    """A Llama4ForConditionalGeneration checkpoint: text config nested, text weights under
    `language_model.`, vision weights ignored."""
    from safetensors.numpy import save_file

    text_dir, mm_dir = tmp_path / "text", tmp_path / "mm"
    hf_model("llama4").save_pretrained(text_dir)
    mm_dir.mkdir()
    text_config = json.loads((text_dir / "config.json").read_text())
    mm_config = {
        "architectures": ["Llama4ForConditionalGeneration"],
        "model_type": "llama4",
        "text_config": text_config,
        "vision_config": {"hidden_size": 8},
    }
    (mm_dir / "config.json").write_text(json.dumps(mm_config))
    reader = TensorReader(text_dir)
    tensors = {f"language_model.{n}": reader.get(n) for n in reader.names()}
    tensors["vision_model.patch_embedding.weight"] = np.ones((2, 2), np.float32)
    save_file(tensors, mm_dir / "model.safetensors")
    cfg_text, text = load_hf(text_dir)
    cfg_mm, mm = load_hf(mm_dir)
    assert cfg_mm == cfg_text
    assert_same_params(text, mm)


def test_bf16_tensors_read_exactly(tmp_path):
    from safetensors.torch import save_file

    t = torch.randn(3, 5, dtype=torch.bfloat16)
    empty = torch.zeros(0, 4, dtype=torch.bfloat16)
    save_file({"w": t, "empty": empty}, tmp_path / "m.safetensors")
    reader = TensorReader(tmp_path)
    np.testing.assert_array_equal(reader.get("w"), t.float().numpy())
    assert reader.get("empty").shape == (0, 4)


# ----------------------------------------------------------------------------- refusals


def write_config(directory, **values) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(values))


@pytest.mark.parametrize(
    "config, message",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "unsupported architecture 'GPT2LMHeadModel'"),
        (
            {"architectures": ["LlamaForCausalLM"], "rope_scaling": {"rope_type": "longrope"}},
            "rope type 'longrope'",
        ),
        ({"architectures": ["LlamaForCausalLM"], "mlp_bias": True}, "mlp_bias=true"),
        ({"architectures": ["MixtralForCausalLM"], "hidden_act": "gelu"}, "hidden_act='gelu'"),
        (
            {
                "architectures": ["Qwen3MoeForCausalLM"],
                "num_hidden_layers": 4,
                "mlp_only_layers": [2],
            },
            "MoE layers (decoder_sparse_step, mlp_only_layers) on layers [0, 1, 3]",
        ),
        (
            {"architectures": ["Llama4ForCausalLM"], "num_hidden_layers": 3, "moe_layers": [0, 2]},
            "MoE layers on layers [0, 2]",
        ),
        (
            {
                "architectures": ["Qwen3ForCausalLM"],
                "num_hidden_layers": 2,
                "use_sliding_window": True,
                "max_window_layers": 1,
            },
            "layer_types",
        ),
        (
            {"architectures": "MixtralForCausalLM", "hidden_size": "abc"},  # a bare name is fine
            "MixtralForCausalLM has hidden_size='abc', which must be an integer",
        ),
        ({"architectures": [3]}, "architectures=[3]: give a list of names"),
        ({"architectures": ["LlamaForCausalLM"], "rms_norm_eps": True}, "must be a number"),
    ],
)
def test_unsupported_configs_are_refused_by_name(tmp_path, config, message):
    write_config(tmp_path, **config)
    with pytest.raises(InteropError, match="^[^\n]*$") as err:
        load_hf(tmp_path)
    assert message in str(err.value)


def test_missing_and_unused_tensors_are_named(mixtral_dir, tmp_path):
    from safetensors.numpy import save_file

    _, directory = mixtral_dir
    reader = TensorReader(directory / "plain")
    tensors = {n: reader.get(n) for n in reader.names()}
    missing = "model.layers.1.block_sparse_moe.experts.2.w3.weight"
    for variant, change in [("missing", missing), ("extra", "model.layers.0.mlp.bias")]:
        d = tmp_path / variant
        d.mkdir()
        shutil.copy(directory / "plain" / "config.json", d)
        changed = {n: t for n, t in tensors.items() if n != change}
        if variant == "extra":
            changed[change] = np.zeros(64, np.float32)
        save_file(changed, d / "model.safetensors")
        with pytest.raises(InteropError, match=change.replace(".", r"\.")):
            load_hf(d)


def test_unreadable_checkpoints_are_named(tmp_path):
    (tmp_path / "list").mkdir()
    (tmp_path / "list" / "config.json").write_text("[1, 2]")
    with pytest.raises(InteropError, match="must hold a JSON object of settings"):
        load_hf(tmp_path / "list")
    write_config(tmp_path / "none", architectures=["LlamaForCausalLM"])
    with pytest.raises(InteropError, match=r"no \*\.safetensors file"):
        load_hf(tmp_path / "none")
    write_config(tmp_path / "bad", architectures=["LlamaForCausalLM"])
    (tmp_path / "bad" / "model.safetensors").write_bytes(b"\x08\0\0\0\0\0\0\0garbage!")
    with pytest.raises(InteropError, match="not a readable safetensors file"):
        load_hf(tmp_path / "bad")
    fp8 = {"quant_method": "fbgemm_fp8"}
    write_config(tmp_path / "fp8", architectures=["LlamaForCausalLM"], quantization_config=fp8)
    with pytest.raises(InteropError, match="quantized checkpoint"):
        load_hf(tmp_path / "fp8")


def test_export_refuses_configs_no_family_can_hold(tmp_path):
    # Qwen3-style QK-norm with Llama 4 NoPE layers (the tests' tiny): neither family has both.
    cfg = load_config("configs/tiny.yaml", ["attention.nope_interval=4"])
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))  # refused before reading
    with pytest.raises(InteropError, match="no Hugging Face architecture fits") as err:
        save_hf(cfg, model, tmp_path / "out")
    # one short line: the family it misses by the least, and what that one needs
    assert str(err.value) == (
        "no Hugging Face architecture fits this config; the closest is Qwen3MoeForCausalLM: "
        "NoPE layers (attention.nope_interval) are not supported (a run trained so exports; "
        "--arch ARCH lists another's terms)"
    )
    assert not (tmp_path / "out").exists()
    with pytest.raises(InteropError, match="cannot write MixtralForCausalLM: .*qk_norm"):
        save_hf(cfg, model, tmp_path / "out", architecture="MixtralForCausalLM")
    # gpt-oss's parts in a Qwen3-MoE-shaped model: only gpt-oss has them, and not the QK-norm
    over = ["attention.nope_interval=0", "attention.sinks=true", "moe.swiglu_limit=7"]
    cfg = load_config("configs/tiny.yaml", over)
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    with pytest.raises(InteropError, match="cannot write Qwen3MoeForCausalLM: .*sinks.*clamped"):
        save_hf(cfg, model, tmp_path / "out", architecture="Qwen3MoeForCausalLM")
    with pytest.raises(InteropError, match="cannot write GptOssForCausalLM: .*qk_norm"):
        save_hf(cfg, model, tmp_path / "out", architecture="GptOssForCausalLM")


def test_export_never_overwrites(tmp_path):
    cfg = load_config("configs/tiny.yaml")
    (tmp_path / "keep.txt").write_text("mine")
    with pytest.raises(InteropError, match="not empty"):
        save_hf(cfg, nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0))), tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"]


@pytest.mark.parametrize(
    "umask, dir_mode, file_mode", [(0o022, 0o755, 0o644), (0o077, 0o700, 0o600)]
)
def test_export_modes_follow_the_umask(mixtral_dir, tmp_path, umask, dir_mode, file_mode):
    """Like anything else the user writes, so that others can read an export under umask 022
    (tempfile.mkdtemp makes directories 700, and safetensors 0.8 its files 600)."""
    _, directory = mixtral_dir
    cfg, model = load_hf(directory / "plain")
    out = tmp_path / "out"
    previous = os.umask(umask)
    try:
        save_hf(cfg, model, out, max_shard_bytes=100_000)  # several shards and an index
    finally:
        os.umask(previous)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert stat.S_IMODE(out.stat().st_mode) == dir_mode
    assert len(modes) > 3 and set(modes.values()) == {file_mode}, modes


# ----------------------------------------------------------------------------- CLI


def test_cli_import_finetune_export(tmp_path, capsys):
    """import -> the run dir samples like transformers and train.py continues it -> export."""
    from moe_jax.inference.load import load_run
    from moe_jax.interop.__main__ import main
    from moe_jax.train.loop import train

    big = hf_model("llama", seed=7, vocab_size=256)  # the byte tokenizer's ids
    hf_dir, run_dir, out_dir = tmp_path / "hf", tmp_path / "run", tmp_path / "export"
    big.save_pretrained(hf_dir)
    run_args = [
        "train.steps=2", "train.batch_size=2", "train.seq_len=16", "train.warmup_steps=1",
        "train.eval_batches=1", "train.peak_flops=1e12", "data.embedded_max_bytes=100000",
        "checkpoint.async_save=false",
    ]  # fmt: skip
    assert main(["import", str(hf_dir), "--out", str(run_dir), *run_args]) == 0
    cfg, ours, tokenizer = load_run(run_dir)
    assert tokenizer.kind == "byte" and cfg.train.steps == 2 and cfg.moe.capacity_factor == 0
    x = tokens(2, 16, seed=4)
    np.testing.assert_allclose(our_logits(ours, x), hf_logits(big, x), rtol=0, atol=TOL)

    assert train(cfg).step == 2  # fine-tunes from the imported step-0 checkpoint

    assert main(["export", str(run_dir), "--out", str(out_dir), "--step", "0"]) == 0
    exported = transformers.AutoModelForCausalLM.from_pretrained(out_dir).state_dict()
    original = big.state_dict()
    assert exported.keys() == original.keys()
    for name, tensor in original.items():  # step 0 is the imported model: bit for bit
        assert torch.equal(exported[name], tensor), name


def test_cli_import_keeps_the_run_time_keys_of_config_yaml(tmp_path, capsys):
    """CONFIG.yaml's max_seq_len and capacity factor win over the ones the HF config implies
    (its context, no drops), as overrides do; export then says what capacity means there."""
    from moe_jax.inference.load import load_run
    from moe_jax.interop.__main__ import main

    hf_model("mixtral", seed=5, vocab_size=256).save_pretrained(tmp_path / "plain")
    directory = tmp_path  # the byte tokenizer's 256 ids
    yaml = tmp_path / "run.yaml"
    yaml.write_text(
        "model:\n  max_seq_len: 64\nmoe:\n  capacity_factor: 1.5\n"
        "train:\n  seq_len: 32\n  batch_size: 2\n  warmup_steps: 1\ndata:\n"
        "  embedded_max_bytes: 100000\n"
    )
    run, out = tmp_path / "run", tmp_path / "hf"
    assert main(["import", str(directory / "plain"), "--out", str(run), str(yaml)]) == 0
    cfg = load_run(run)[0]
    assert (cfg.model.max_seq_len, cfg.moe.capacity_factor, cfg.train.seq_len) == (64, 1.5, 32)
    capsys.readouterr()
    assert main(["export", str(run), "--out", str(out)]) == 0
    assert "note: transformers never drops a token" in capsys.readouterr().out


def test_image_projection_neither_imports_nor_exports(mixtral_dir, tmp_path):
    _, directory = mixtral_dir
    with pytest.raises(InteropError, match="drop model.vision"):
        load_hf(directory / "plain", load_config("configs/tiny.yaml", ["model.vision=8"]))
    text = config_from_hf(directory / "plain")
    cfg = dataclasses.replace(text, model=dataclasses.replace(text.model, vision=8))
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))
    with pytest.raises(InteropError, match="image projection .model.vision. has no counterpart"):
        save_hf(cfg, model, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cli_errors_exit_2_and_touch_nothing(tmp_path, capsys):
    from moe_jax.interop.__main__ import main

    write_config(tmp_path / "gpt2", architectures=["GPT2LMHeadModel"])
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "keep.txt").write_text("mine")
    cases = [
        (["import", str(tmp_path / "gpt2"), "--out", str(tmp_path / "new")], "GPT2LMHeadModel"),
        (["import", str(tmp_path / "gpt2"), "--out", str(tmp_path / "full")], "not empty"),
        (
            ["import", str(tmp_path / "gpt2"), "--out", str(tmp_path / "new"), "model.n_layers=3"],
            "'model.n_layers' is set by",
        ),
        (["export", str(tmp_path / "nothing"), "--out", str(tmp_path / "new")], "does not exist"),
    ]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "new").exists()
    assert [p.name for p in (tmp_path / "full").iterdir()] == ["keep.txt"]


@pytest.mark.skipif(not SHAKESPEARE.is_file(), reason=f"{SHAKESPEARE} not present")
def test_cli_import_carries_the_tokenizer_to_sample_and_export(tmp_path, capsys):
    """The HF directory's tokenizer files come into the run (RUN_DIR/tokenizer), so sample.py
    continues a text prompt, and a --chat one through the chat template, exactly as
    transformers' greedy `generate` does with the same model and files; export writes the
    files back; an explicit data.tokenizer=byte leaves them out (and --chat is refused)."""
    from moe_jax.interop.__main__ import main

    sample = runpy.run_path(str(ROOT / "sample.py"))["main"]
    hf_dir, run, out = tmp_path / "hf", tmp_path / "run", tmp_path / "export"
    model = hf_model("llama", seed=3, vocab_size=300)  # the BPE's 300 ids
    model.save_pretrained(hf_dir)
    write_bpe(hf_dir)
    (hf_dir / "special_tokens_map.json").write_text('{"pad_token": "<|endoftext|>"}')
    files = ["special_tokens_map.json", "tokenizer.json", "tokenizer_config.json"]
    run_args = ["train.batch_size=2", "train.seq_len=16", "data.embedded_max_bytes=100000"]
    assert main(["import", str(hf_dir), "--out", str(run), *run_args]) == 0
    assert sorted(p.name for p in (run / "tokenizer").iterdir()) == files
    assert all((run / "tokenizer" / f).read_bytes() == (hf_dir / f).read_bytes() for f in files)

    ref = transformers.PreTrainedTokenizerFast.from_pretrained(hf_dir)
    as_chat = lambda tok, prompt: tok.apply_chat_template(
        [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
    )
    n_new = 8
    # 36 and 38 tokens: both in the 64-token prompt bucket, so one compiled program.
    for prompt, chat in [
        ("First Citizen:\nBefore we proceed any further", False),
        ("Speak, speak.", True),
    ]:
        text = as_chat(ref, prompt) if chat else prompt
        encoded = ref(text, add_special_tokens=not chat, return_tensors="pt")
        with torch.no_grad():
            generated = model.generate(
                **encoded, max_new_tokens=n_new, do_sample=False, eos_token_id=ref.eos_token_id,
                pad_token_id=ref.eos_token_id,
            )[0, encoded["input_ids"].shape[1] :]  # fmt: skip
        flags = ["--run", str(run), "--prompt", prompt, "--temperature", "0", "--num-samples", "1"]
        capsys.readouterr()
        assert sample([*flags, "--max-new-tokens", str(n_new), *["--chat"] * chat]) == 0
        assert (
            capsys.readouterr().out == text + ref.decode(generated, skip_special_tokens=True) + "\n"
        )

    assert main(["export", str(run), "--out", str(out)]) == 0
    assert all((out / f).read_bytes() == (hf_dir / f).read_bytes() for f in files)
    config = json.loads((out / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"]) == (ref.bos_token_id, ref.eos_token_id)
    exported = transformers.PreTrainedTokenizerFast.from_pretrained(out)
    assert as_chat(exported, prompt) == text

    byte_run = tmp_path / "byte"
    assert (
        main(["import", str(hf_dir), "--out", str(byte_run), *run_args, "data.tokenizer=byte"]) == 0
    )
    assert not (byte_run / "tokenizer").exists()
    capsys.readouterr()  # a byte run chats through the built-in plain-text template
    args = ["--run", str(byte_run), "--chat", "--prompt", "hi", "--max-new-tokens", "2"]
    assert sample(args) == 0
    assert capsys.readouterr().out.startswith("user: hi\nassistant: ")


@pytest.mark.skipif(not SHAKESPEARE.is_file(), reason=f"{SHAKESPEARE} not present")
def test_cli_import_refuses_a_tokenizer_larger_than_the_embedding(tmp_path, capsys):
    from moe_jax.interop.__main__ import main

    hf_dir = tmp_path / "hf"
    hf_model("llama", vocab_size=V).save_pretrained(hf_dir)
    write_bpe(hf_dir)  # 300 ids > V
    capsys.readouterr()
    assert main(["import", str(hf_dir), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"error: the tokenizer in '{hf_dir}' has 300 tokens but the model's embedding {V} "
        "(vocab_size in config.json); fix the directory, or import it with another tokenizer "
        "(data.tokenizer=byte)\n"
    )
    assert not (tmp_path / "run").exists()


GPT_OSS_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def gpt_oss_as_released(model) -> dict:
    """A transformers gpt-oss model's tensors as OpenAI releases them: the experts MXFP4
    (`*_blocks` / `*_scales`), the rest as they are."""
    from moe_jax.interop import mxfp4

    tensors = {}
    for name, p in model.state_dict().items():
        if name.endswith(GPT_OSS_EXPERTS):
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = mxfp4.quantize(p.numpy())
        else:
            tensors[name] = np.ascontiguousarray(p.numpy())
    return tensors
