"""`python -m moe_jax.aot ... train.objective=grpo` (moe_jax/aot/grpo.py): a GRPO step's two
programs (the sampler's recording generate, the train step on its rollouts with its passes)
compiled for a TPU slice on this CPU, and a chip's memory across them, checked against hand
counts: the weights and Adam state a chip holds on a replicated mesh, the rollouts' bytes in
the train program's arguments, the KV cache of the sampler's rows, and the peak as the larger
of the two phases. Needs the `aot` extra (libtpu). Budget: ~30 s on 2 CPU cores.
"""

from __future__ import annotations

import json

import pytest

from moe_jax.config import ConfigError, load_config
from moe_jax.summary.counts import param_counts

pytest.importorskip("libtpu", reason="the `aot` extra (libtpu) is not installed")

GRPO = [
    "train.objective=grpo", "data.sft=prompts", "data.path=unused.jsonl", "rl.rewards=[a:b]",
    "rl.group_size=4", "rl.max_prompt_len=20", "rl.max_new_tokens=16", "rl.epochs=2",
    "rl.minibatches=2", "train.batch_size=4", "moe.capacity_factor=0", "model.n_layers=2",
    "attention.nope_interval=0", "mesh.data=4",
]  # fmt: skip


def test_a_grpo_step_compiles_for_tpu_with_its_memory_across_both_programs(capsys):
    import jax

    from moe_jax.aot import command as aot

    # the suite's "highest" matmul precision is refused by Mosaic's bf16 kernels (test_aot)
    with jax.default_matmul_precision("default"):
        assert aot.main(["configs/tiny.yaml", "--topology", "v5p-8", *GRPO]) == 0
    out = capsys.readouterr().out
    r = json.loads(out.strip().splitlines()[-1])
    assert "GRPO step on v5p-8" in out and "peak while sampling" in out
    cfg = load_config("configs/tiny.yaml", GRPO)  # as the command reads it
    R, P, N = 16, 32, 16  # 4 prompts x 4 samples; bucket 32 for 20 tokens; S = 48
    assert (r["rollouts"], r["prompt_bucket"], r["max_new_tokens"], r["updates"]) == (R, P, N, 4)
    # mesh data 4: every chip holds all the float32 params and both Adam moments (+ counts)
    n = param_counts(cfg)[0]
    res = r["resident"]
    assert res["weights"] == 4 * n
    assert res["optimizer_state"] == 2 * 4 * n + 2 * 4  # mu, nu; Adam's and the LR's counts
    # the KV cache: a quarter of the rows a chip, bf16 (model.dtype auto on TPU), k and v
    L, kv, hd = cfg.model.n_layers, cfg.attention.n_kv_heads, cfg.head_dim
    assert res["kv_cache"] == L * 2 * (R // 4) * (P + N) * kv * hd * 2
    # the train program updates the state in place (donated) and takes a quarter of the
    # rollouts a chip besides (at least their bytes: TPU layouts pad small arrays' tiles)
    S, n_moe, K = P + N, sum(cfg.is_moe(i) for i in range(L)), cfg.moe.top_k
    rows = (R // 4) * (S * 4 * 3 + 2 * 4 + n_moe * S * K * 4)  # tokens, mask, logp; adv, rewards
    train, sample = r["programs"]["train"]["bytes"], r["programs"]["sample"]["bytes"]
    assert train["aliased"] >= res["weights"] + res["optimizer_state"]
    assert rows <= train["arguments"] - train["aliased"] < 8 * rows
    # the sampler's copy, laid out for sampling: on mesh data 4 as whole as the weights, and
    # the sample program's argument beside the train state it does not take
    assert res["sampler_copy"] == res["weights"] and sample["arguments"] >= res["sampler_copy"]
    assert r["peak_sampling"] == sample["peak"] + res["weights"] + res["optimizer_state"]
    assert r["peak_training"] == train["peak"] and r["peak"] == max(
        r["peak_sampling"], r["peak_training"]
    )
    assert r["fits"] and r["programs"]["sample"]["flops_per_device"] > 0


def test_grpo_aot_needs_a_fixed_prompt_width():
    from moe_jax.aot import command as aot
    from moe_jax.aot.topology import get_topology

    cfg = load_config("configs/tiny.yaml", [*GRPO, "rl.max_prompt_len=0"])
    with pytest.raises(ConfigError, match="set rl.max_prompt_len"):
        aot.compile_step(cfg, get_topology("v5p-8"), "train")
