"""The full-size DeepSeek-V3, Kimi K2 and GLM-4.5-Air shape configs: their parameter counts
(moe_jax.summary.counts) against the published sizes, and their architecture against the published
config.json read through the HF import mapping.

Published sizes are given to 3 digits (671B, 106B) or fewer (1T, 37B, 32B, 12B): a count
matches when it reads as the published figure at that precision, truncated as the cards
write it (Qwen3's "3.3B" of 3.353B, test_summary.py). One routed expert of these models is
44M / 17M parameters per layer, a whole layer's experts 11B-17B / 2.2B: any miscount of a
tensor kind shows in the first digits. The multi-token prediction module (model.mtp_depth)
is counted apart, as DeepSeek's card does ("671B + 14B MTP").

Budget: ~3 s (abstract models via eval_shape; no weights).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moe_jax.config import load_config
from moe_jax.interop import config_from_hf
from moe_jax.summary.counts import param_breakdown, param_counts

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def test_deepseek_v3_is_671b_with_37b_active_and_its_mtp_apart():
    cfg = load_config(CONFIGS / "deepseek_v3.yaml")
    total, active = param_counts(cfg)
    assert int(total / 1e9) == 671, total  # 671.03B
    assert int(active / 1e9) == 37, active  # 37.55B (36.62B without the embedding lookup)
    b = param_breakdown(cfg)
    # The MTP module: one MoE decoder layer (11.5B) + eh_proj [2D, D] + its norms, apart
    # from the 671B; as the checkpoint stores it (with its copies of the embedding and the
    # head, 2 x 0.93B) 13.5B, the card's "14B" (685B - 671B).
    assert 11.5e9 < b.mtp_total < 11.7e9, b.mtp_total


def test_kimi_k2_is_1t_with_32b_active():
    cfg = load_config(CONFIGS / "kimi_k2.yaml")
    total, active = param_counts(cfg)
    assert round(total / 1e12, 1) == 1.0, total  # 1.026T: "1T" (1.04T in some write-ups)
    assert int(active / 1e9) == 32, active  # 32.86B
    assert param_breakdown(cfg).mtp_total == 0  # no MTP module


def test_glm45_air_is_106b_with_12b_active():
    cfg = load_config(CONFIGS / "glm45_air.yaml")
    total, active = param_counts(cfg)
    assert int(total / 1e9) == 106, total  # 106.85B
    # GLM counts the active parameters without the input embedding (a lookup, not a
    # matmul): 12.80B here, and GLM-4.5's "32B" likewise (32.8B); with it, 13.42B.
    embedding = param_breakdown(cfg).active["embedding"]
    assert int((active - embedding) / 1e9) == 12, active - embedding
    assert 2.3e9 < param_breakdown(cfg).mtp_total < 2.45e9  # the MTP layer, apart


# The published config.json files, the keys transformers reads (DeepSeek-V3's FP8
# quantization_config left out: an import refuses quantized checkpoints).
PUBLISHED = {
    "deepseek_v3": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": 129280, "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "n_shared_experts": 1, "n_routed_experts": 256,
        "routed_scaling_factor": 2.5, "kv_lora_rank": 512, "q_lora_rank": 1536,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 8,
        "topk_group": 4, "num_experts_per_tok": 8, "first_k_dense_replace": 3,
        "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "moe_layer_freq": 1, "hidden_act": "silu", "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6, "rope_theta": 10000, "tie_word_embeddings": False,
        "attention_bias": False, "num_nextn_predict_layers": 1, "aux_loss_alpha": 0.001,
        "seq_aux": True,
        "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                         "type": "yarn"},
    },
    "kimi_k2": {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2",
        "vocab_size": 163840, "hidden_size": 7168, "intermediate_size": 18432,
        "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 64,
        "num_key_value_heads": 64, "n_shared_experts": 1, "n_routed_experts": 384,
        "routed_scaling_factor": 2.827, "kv_lora_rank": 512, "q_lora_rank": 1536,
        "qk_rope_head_dim": 64, "v_head_dim": 128, "qk_nope_head_dim": 128, "n_group": 1,
        "topk_group": 1, "num_experts_per_tok": 8, "first_k_dense_replace": 1,
        "norm_topk_prob": True, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
        "moe_layer_freq": 1, "hidden_act": "silu", "max_position_embeddings": 131072,
        "rms_norm_eps": 1e-6, "rope_theta": 50000.0, "tie_word_embeddings": False,
        "attention_bias": False, "num_nextn_predict_layers": 0,
        "rope_scaling": {"beta_fast": 1.0, "beta_slow": 1.0, "factor": 32.0, "mscale": 1.0,
                         "mscale_all_dim": 1.0, "original_max_position_embeddings": 4096,
                         "type": "yarn"},
    },
    "glm45_air": {
        "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
        "vocab_size": 151552, "hidden_size": 4096, "intermediate_size": 10944,
        "moe_intermediate_size": 1408, "num_hidden_layers": 46, "num_attention_heads": 96,
        "num_key_value_heads": 8, "head_dim": 128, "partial_rotary_factor": 0.5,
        "attention_bias": True, "use_qk_norm": False, "n_shared_experts": 1,
        "n_routed_experts": 128, "num_experts_per_tok": 8, "n_group": 1, "topk_group": 1,
        "routed_scaling_factor": 1.0, "norm_topk_prob": True, "first_k_dense_replace": 1,
        "hidden_act": "silu", "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_theta": 1000000, "rope_scaling": None, "tie_word_embeddings": False,
        "num_nextn_predict_layers": 1,
    },
}  # fmt: skip


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_shape_config_is_the_published_config_json_imported(name, tmp_path):
    """The config.json through the HF import mapping, over the shape config as its base,
    gives the shape config's model (its MTP depth too), attention and moe sections."""
    (tmp_path / "config.json").write_text(json.dumps(PUBLISHED[name]))
    ours = load_config(CONFIGS / f"{name}.yaml")
    imported = config_from_hf(tmp_path, base=ours)
    assert imported.attention == ours.attention
    assert imported.moe == ours.moe
    assert imported.model == ours.model
