"""Hugging Face interop for DeepSeek-V3 (`DeepseekV3ForCausalLM`) and GLM-4.5
(`Glm4MoeForCausalLM`): parity with `transformers` (torch CPU, float32, eager attention).

Tiny random transformers models, every weight redrawn (norm scales 1 + noise) and the routers'
correction-bias buffers drawn N(0, 0.3^2), large against the sigmoid scores' spread, so that
they change which experts are chosen (checked: zeroing them moves transformers' logits). The
cases switch on what each family can do:
- deepseek_v3: query LoRA, interleaved RoPE with YaRN (mscale 0.707 / mscale_all_dim 1: the
  ratio on cos/sin, mscale_all_dim's square on the softmax scale), group-limited routing (4
  groups of 2, best 2), top-3, routed_scaling_factor 2.5, 2 shared experts, 1 dense layer;
- deepseek_v3_no_q_lora: q_proj without LoRA, rotate-half RoPE, no groups, unnormalised
  top-k weights, 2 dense layers;
- glm4_moe: partial rotary at the class default 0.5 (head_dim 16: 8 dims rotated), QK-norm,
  q/k/v biases, 2 groups (best 1), routed_scaling_factor 1.5, 1 dense layer;
- glm4_moe_plain: no QK-norm or biases, a quarter of each head rotated (top-level
  partial_rotary_factor), every layer MoE.

Tolerance: 1e-5 absolute on logits of O(1) (std ~0.8). Both sides compute the same float32
math in different orders (the MLA, the routers' top-k over sigmoid scores, the experts'
sums); measured differences are <= 3.6e-6, and every dropped or misplaced piece checked here
(a bias, a scale, a rotated dim) moves logits by > 1e-2.
Budget: ~50 s on 2 cores (four families' forwards, greedy decodes and round trips compile).
"""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch", reason="interop tests need torch (the `interop` extra)")
transformers = pytest.importorskip(
    "transformers", reason="interop tests need transformers (the `interop` extra)"
)

from moe_jax.config import load_config  # noqa: E402
from moe_jax.interop import InteropError, load_hf, save_hf  # noqa: E402
from moe_jax.interop.safetensors_io import TensorReader  # noqa: E402
from moe_jax.model import Transformer  # noqa: E402
from tests.test_interop import (  # noqa: E402
    assert_same_params,
    greedy_ours,
    hf_logits,
    our_logits,
    params_of,
    random_model,
    tokens,
    write_config,
)

TOL = 1e-5
V = 128
BUFFER = "e_score_correction_bias"  # transformers' router keeps the correction bias here
COMMON = dict(
    vocab_size=V, hidden_size=64, num_attention_heads=4, intermediate_size=48,
    moe_intermediate_size=16, n_routed_experts=8, max_position_embeddings=256,
    bos_token_id=None, eos_token_id=None, pad_token_id=None,
)  # fmt: skip
MLA = dict(num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8,
           v_head_dim=12)  # fmt: skip

# name -> (transformers class, config class, config kwargs)
SPECS = {
    "deepseek_v3": (
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        MLA | dict(
            num_hidden_layers=3, q_lora_rank=24, n_group=4, topk_group=2, num_experts_per_tok=3,
            first_k_dense_replace=1, routed_scaling_factor=2.5, n_shared_experts=2,
            rope_interleave=True,
            rope_parameters=dict(
                rope_type="yarn", rope_theta=10000.0, factor=4.0, mscale=0.707,
                mscale_all_dim=1.0, original_max_position_embeddings=64,
            ),
        ),
    ),
    "deepseek_v3_no_q_lora": (
        "DeepseekV3ForCausalLM",
        "DeepseekV3Config",
        MLA | dict(
            num_hidden_layers=4, q_lora_rank=None, n_group=1, topk_group=1, num_experts_per_tok=2,
            first_k_dense_replace=2, routed_scaling_factor=1.0, norm_topk_prob=False,
            rope_interleave=False,
        ),
    ),
    "glm4_moe": (
        "Glm4MoeForCausalLM",
        "Glm4MoeConfig",
        dict(
            num_hidden_layers=3, num_key_value_heads=2, head_dim=16, use_qk_norm=True,
            attention_bias=True, n_group=2, topk_group=1, num_experts_per_tok=2,
            routed_scaling_factor=1.5, first_k_dense_replace=1,
        ),
    ),
    "glm4_moe_plain": (
        "Glm4MoeForCausalLM",
        "Glm4MoeConfig",
        dict(
            num_hidden_layers=2, num_key_value_heads=2, head_dim=32, partial_rotary_factor=0.25,
            num_experts_per_tok=2, first_k_dense_replace=0, rope_theta=50000.0,
        ),
    ),
}  # fmt: skip


def hf_model(name: str, seed: int = 0, **overrides):
    model_cls, config_cls, kwargs = SPECS[name]
    config = getattr(transformers, config_cls)(**(COMMON | kwargs | overrides))
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(config).eval()
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            noise = 0.1 * torch.randn(p.shape, generator=g)
            p.copy_(1.0 + noise if pname.endswith("norm.weight") else noise)
        for bname, b in model.named_buffers():
            if bname.endswith(BUFFER):
                b.copy_(0.3 * torch.randn(b.shape, generator=g))
    return model


def hf_biases(model) -> list[np.ndarray]:
    """The routers' correction biases, in layer order (copies)."""
    return [b.numpy().copy() for n, b in model.named_buffers() if n.endswith(BUFFER)]


def set_hf_biases(model, values: list[np.ndarray]) -> None:
    biases = [b for n, b in model.named_buffers() if n.endswith(BUFFER)]
    with torch.no_grad():
        for b, v in zip(biases, values, strict=True):
            b.copy_(torch.from_numpy(v))


@pytest.fixture(scope="module", params=list(SPECS))
def case(request, tmp_path_factory):
    """(name, HF dir, HF model, our imported config and model) for one case."""
    name = request.param
    directory = tmp_path_factory.mktemp(name) / "hf"
    model = hf_model(name)
    model.save_pretrained(directory)
    cfg, ours = load_hf(directory)
    return name, directory, model, cfg, ours


# ----------------------------------------------------------------------------- parity


def test_imported_logits_match_transformers(case):
    name, directory, model, cfg, ours = case
    assert cfg.moe.capacity_factor == 0 and cfg.moe.correction_bias
    assert cfg.moe.first_dense_layers == model.config.first_k_dense_replace
    assert any(n.endswith(BUFFER) for n in TensorReader(directory).names())  # a saved buffer
    x = tokens(3, 24)
    ref = hf_logits(model, x)
    assert np.std(ref) > 0.3  # O(1) logits, so the tolerance is tight
    np.testing.assert_allclose(our_logits(ours, x), ref, rtol=0, atol=TOL)
    # The correction bias chooses experts here: without it transformers' logits move.
    saved = hf_biases(model)
    set_hf_biases(model, [np.zeros_like(b) for b in saved])
    try:
        assert np.abs(hf_logits(model, x) - ref).max() > 1e-2
    finally:
        set_hf_biases(model, saved)


def test_greedy_generation_matches_transformers(case):
    """Prefill then decode through our KV cache (MLA's latent cache; the partially rotated
    keys) against transformers' greedy `generate`."""
    name, _, model, _, ours = case
    prompt, n_new = tokens(2, 5, seed=1), 12
    with torch.no_grad():
        ref = model.generate(
            torch.from_numpy(prompt), max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False
        ).numpy()[:, prompt.shape[1] :]
    np.testing.assert_array_equal(greedy_ours(ours, prompt, n_new), ref)


def test_round_trip_through_transformers(case, tmp_path):
    """Ours (every param redrawn, the correction bias too) -> save_hf -> transformers loads it
    (the bias into its buffer) with the same logits -> load_hf gives the same config and
    identical params."""
    name, _, model, cfg, _ = case
    fresh = random_model(cfg, seed=2)
    out = tmp_path / "export"
    assert save_hf(cfg, fresh, out, max_shard_bytes=100_000) == type(model).__name__
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager")
    ours_bias = [v for p, v in params_of(fresh).items() if p[-1] == "correction_bias"]
    theirs_bias = hf_biases(loaded)
    assert len(theirs_bias) == cfg.model.n_layers - cfg.moe.first_dense_layers
    # every MoE layer is a block of the stack (period 1): one [n_blocks, E] array, in layer order
    np.testing.assert_array_equal(np.concatenate([b.reshape(-1) for b in ours_bias]),
                                  np.concatenate(theirs_bias))  # fmt: skip
    x = tokens(3, 24, seed=3)
    np.testing.assert_allclose(hf_logits(loaded.eval(), x), our_logits(fresh, x), rtol=0, atol=TOL)
    cfg2, back = load_hf(out)
    assert cfg2 == cfg
    assert_same_params(back, fresh)


def test_export_without_a_correction_bias_writes_zeros(tmp_path):
    """A DeepSeek-routed config without moe.correction_bias: transformers always has the
    buffer, so it is written as zeros (which choose as no bias does): same logits."""
    cfg = load_hf_config("deepseek_v3", tmp_path)
    cfg = dataclasses.replace(cfg, moe=dataclasses.replace(cfg.moe, correction_bias=False))
    fresh = random_model(cfg, seed=4)
    save_hf(cfg, fresh, tmp_path / "out")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation="eager"
    )
    assert all(not b.any() for b in hf_biases(loaded))
    x = tokens(2, 16, seed=5)
    np.testing.assert_allclose(hf_logits(loaded.eval(), x), our_logits(fresh, x), rtol=0, atol=TOL)


def load_hf_config(name: str, tmp_path):
    hf_model(name).save_pretrained(tmp_path / name)
    from moe_jax.interop import config_from_hf

    return config_from_hf(tmp_path / name)


# ----------------------------------------------------------------------------- checkpoints


def test_multi_token_prediction_layers_are_taken_whole_or_skipped(case, tmp_path):
    """A released checkpoint keeps its MTP module as layer num_hidden_layers (transformers'
    from_pretrained skips it; test_interop_mtp.py imports whole ones). A checkpoint holding
    part of it is refused, naming a missing tensor, unless the import leaves the MTP layers
    out (`mtp=False`): then it skips those tensors, and only those."""
    from safetensors.numpy import save_file

    name, directory, model, cfg, ours = case
    assert model.config.num_nextn_predict_layers == 1 and cfg.model.mtp_depth == 0  # none held
    reader = TensorReader(directory)
    tensors = {n: reader.get(n) for n in reader.names()}
    L = cfg.model.n_layers
    mtp = {f"model.layers.{L}.eh_proj.weight": np.zeros((64, 128), np.float32),
           f"model.layers.{L}.enorm.weight": np.ones(64, np.float32)}  # fmt: skip
    for variant, extra in [("mtp", mtp), ("beyond", {f"model.layers.{L + 1}.x": np.ones(2)})]:
        d = tmp_path / variant
        d.mkdir()
        (d / "config.json").write_bytes((directory / "config.json").read_bytes())
        save_file(tensors | extra, d / "model.safetensors")
        if variant == "mtp":
            missing = rf"'model\.layers\.{L}\.hnorm\.weight' is missing"
            with pytest.raises(InteropError, match=missing):
                load_hf(d)
            assert_same_params(load_hf(d, mtp=False)[1], ours)
        else:
            for mtp in (True, False):
                with pytest.raises(InteropError, match=rf"model\.layers\.{L + 1}\.x"):
                    load_hf(d, mtp=mtp)


def test_init_from_trains_with_the_family_s_defaults_as_the_import_does(case):
    """`train.py init_from=HF_DIR` with the default config (tiny's Switch loss 0.01, capacity
    1.25) resolves the family's training keys as the import of the directory does: no Switch
    loss (the correction bias balances), dropless; a key the user sets stands in both. The
    config resolution only: nothing trains."""
    from moe_jax.config import cli_given_keys
    from moe_jax.config.shipped import config_argv, config_path
    from moe_jax.interop.__main__ import _import_config
    from moe_jax.train.console import moe_line
    from moe_jax.train.init_from import with_source_architecture

    directory = case[1]
    for overrides, capacity in (([], 0.0), (["moe.capacity_factor=1.5"], 1.5)):
        args = config_argv([f"init_from={directory}", *overrides])  # as train.py reads them
        trains = with_source_architecture(
            load_config(config_path("tiny"), args), cli_given_keys(args)
        )
        imported = _import_config(directory, None, overrides)[0]
        for moe in (trains.moe, imported.moe):
            assert (moe.capacity_factor, moe.lb_loss_weight) == (capacity, 0.0)
            assert moe.correction_bias and moe.bias_update_rate > 0
        assert trains.moe == imported.moe
    # what the run's first lines say of it (trainer.train logs this line)
    assert moe_line(trains) == (
        "moe: capacity_factor 1.5 (tokens over it dropped); balancing: Switch loss 0, z-loss "
        "0.001, correction bias at rate 0.001"
    )


def test_fused_experts_import_identically(tmp_path):
    """transformers>=5's in-memory layout (fused gate_up_proj [E, 2F, D])."""
    model = hf_model("glm4_moe", seed=1)
    model.save_pretrained(tmp_path / "plain")
    model.save_pretrained(tmp_path / "fused", save_original_format=False)
    assert "model.layers.1.mlp.experts.gate_up_proj" in TensorReader(tmp_path / "fused").names()
    assert_same_params(load_hf(tmp_path / "plain")[1], load_hf(tmp_path / "fused")[1])


# ----------------------------------------------------------------------------- refusals


@pytest.mark.parametrize(
    "config, message",
    [
        ({"architectures": ["DeepseekV3ForCausalLM"], "attention_bias": True},
         "DeepseekV3ForCausalLM: attention_bias=true is not supported by moe_jax"),
        ({"architectures": ["DeepseekV3ForCausalLM"], "num_key_value_heads": 8},
         "num_key_value_heads=8 is not supported by moe_jax (latent attention expands keys for "
         "every head: it must equal num_attention_heads)"),
        ({"architectures": ["DeepseekV3ForCausalLM"], "scoring_func": "softmax"},
         "scoring_func='softmax' is not supported"),
        ({"architectures": ["DeepseekV3ForCausalLM"], "topk_method": "greedy"},
         "topk_method='greedy' is not supported"),
        ({"architectures": ["DeepseekV3ForCausalLM"],
          "rope_scaling": {"type": "linear", "factor": 2.0, "mscale_all_dim": 1.0}},
         "mscale_all_dim with linear RoPE is not supported"),
        ({"architectures": ["Glm4MoeForCausalLM"], "hidden_act": "gelu"}, "hidden_act='gelu'"),
        ({"architectures": ["Glm4MoeForCausalLM"], "n_shared_experts": 0},
         "n_shared_experts=0 is not supported"),
        ({"architectures": ["Glm4MoeForCausalLM"], "head_dim": 10, "partial_rotary_factor": 0.3},
         "does not fit: attention.partial_rotary_factor (0.3) rotates int(head_dim x factor) = 3 "),
        ({"architectures": ["LlamaForCausalLM"], "partial_rotary_factor": 0.5},
         "LlamaForCausalLM: partial_rotary_factor=0.5 is not supported"),
    ],
)  # fmt: skip
def test_unsupported_configs_are_refused_by_name(tmp_path, config, message):
    write_config(tmp_path, **config)
    with pytest.raises(InteropError, match="^[^\n]*$") as err:
        load_hf(tmp_path)
    assert message in str(err.value)


GLM_LIKE = [
    "attention.nope_interval=0", "attention.temperature_tuning=false",
    "attention.partial_rotary_factor=0.5", "moe.score=sigmoid", "moe.correction_bias=true",
    "moe.shared_expert_hidden=256", "moe.interleave_step=1", "moe.first_dense_layers=1",
]  # fmt: skip
MLA_LIKE = [
    "attention.kind=mla", "attention.qk_norm=none", "attention.nope_interval=0",
    "attention.kv_lora_rank=8", "attention.qk_nope_head_dim=8", "attention.qk_rope_head_dim=4",
    "attention.v_head_dim=8", "moe.score=sigmoid", "moe.shared_expert_hidden=256",
    "moe.interleave_step=1",
]  # fmt: skip


@pytest.mark.parametrize(
    "overrides, arch, message",
    [
        (GLM_LIKE, None, None),  # fits: Glm4Moe picked
        (MLA_LIKE, None, None),  # fits: DeepseekV3 picked
        ([*GLM_LIKE, "attention.o_bias=true"], "Glm4MoeForCausalLM",
         "cannot write Glm4MoeForCausalLM: an output projection bias (attention.o_bias)"),
        ([*GLM_LIKE, "moe.shared_expert_hidden=100"], "Glm4MoeForCausalLM",
         "the shared expert must be a whole number (>= 1) of routed experts wide"),
        ([*GLM_LIKE, "moe.interleave_step=2"], "Glm4MoeForCausalLM",
         "moe.interleave_step must be 1"),
        (GLM_LIKE, "DeepseekV3ForCausalLM",
         "cannot write DeepseekV3ForCausalLM: attention.kind must be 'mla'"),
        (MLA_LIKE, "Glm4MoeForCausalLM", "attention.kind must be 'gqa'"),
        ([*MLA_LIKE, "moe.score=softmax"], "DeepseekV3ForCausalLM", "moe.score must be 'sigmoid'"),
        (GLM_LIKE, "Qwen3MoeForCausalLM", "partial rotary (attention.partial_rotary_factor)"),
        (GLM_LIKE, "Qwen3MoeForCausalLM", "DeepSeek-V3 routing (moe.n_group, moe.correction_bias"),
        (GLM_LIKE, "Qwen3MoeForCausalLM", "dense first layers (moe.first_dense_layers)"),
        (MLA_LIKE, "Llama4ForCausalLM", "latent attention (attention.kind=mla)"),
    ],
)  # fmt: skip
def test_export_picks_or_refuses_by_name(tmp_path, overrides, arch, message):
    cfg = load_config("configs/tiny.yaml", overrides)
    model = nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0)))  # refused before reading
    if message is None:
        from moe_jax.interop import pick_family

        want = "DeepseekV3ForCausalLM" if cfg.attention.kind == "mla" else "Glm4MoeForCausalLM"
        assert pick_family(cfg)[0].architecture == want
        return
    with pytest.raises(InteropError, match="^[^\n]*$") as err:
        save_hf(cfg, model, tmp_path / "out", architecture=arch)
    assert message in str(err.value)
    assert not (tmp_path / "out").exists()


def test_exported_config_json_carries_what_serving_engines_read(case, tmp_path):
    """vLLM and SGLang route DeepSeek-V3 by scoring_func / topk_method (transformers ignores
    them); GLM's partial_rotary_factor is always written (absent means 0.5 there)."""
    name, _, model, cfg, ours = case
    save_hf(cfg, ours, tmp_path / "out")
    written = json.loads((tmp_path / "out" / "config.json").read_text())
    if name.startswith("deepseek"):
        assert (written["scoring_func"], written["topk_method"]) == ("sigmoid", "noaux_tc")
        assert written["q_lora_rank"] == model.config.q_lora_rank
    else:
        factor = model.config.rope_parameters["partial_rotary_factor"]
        assert written["rope_parameters"]["partial_rotary_factor"] == factor
    assert written["num_nextn_predict_layers"] == 0  # imported without MTP layers (none held)


def test_glm_export_with_every_dim_rotated_says_so(tmp_path):
    """Glm4MoeConfig rotates half of each head where config.json names no factor: an export
    rotating every dim writes partial_rotary_factor 1, and transformers reads it so."""
    from moe_jax.interop import config_from_hf

    cfg = load_config("configs/tiny.yaml", [*GLM_LIKE, "attention.partial_rotary_factor=1"])
    save_hf(cfg, random_model(cfg, seed=0), tmp_path / "out", architecture="Glm4MoeForCausalLM")
    hf_config = transformers.AutoConfig.from_pretrained(tmp_path / "out")
    assert hf_config.rope_parameters["partial_rotary_factor"] == 1.0
    assert config_from_hf(tmp_path / "out").attention.partial_rotary_factor == 1.0


@pytest.mark.parametrize(
    "values, factor",
    [
        ({}, 0.5),  # Glm4MoeConfig's default
        ({"partial_rotary_factor": 0.25}, 0.25),  # top-level, as the released config.json
        ({"partial_rotary_factor": 0.25,
          "rope_parameters": {"rope_type": "default", "partial_rotary_factor": 0.75}}, 0.75),
        ({"partial_rotary_factor": 1.0, "rope_scaling": None, "rope_theta": 1e6}, 1.0),
    ],
)  # fmt: skip
def test_glm_partial_rotary_factor_resolves_as_transformers_does(tmp_path, values, factor):
    from moe_jax.interop import config_from_hf

    config = dict(architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", head_dim=16)
    write_config(tmp_path, **config, **values)
    assert (
        transformers.AutoConfig.from_pretrained(tmp_path).rope_parameters["partial_rotary_factor"]
        == factor
    )
    assert config_from_hf(tmp_path).attention.partial_rotary_factor == factor
