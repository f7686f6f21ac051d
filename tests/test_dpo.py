"""DPO (moe_jax/posttrain/dpo.py, moe_jax/data/preference.py): ln 2 at the first step, the loss, its
gradient and its metrics equal TRL's `DPOTrainer` on the same logits, a tiny model learns
a separable preference set, and bad pairs are refused by line.

TRL's loss is taken from `DPOTrainer._compute_loss` itself (train.dpo_loss sigmoid, ipo),
run on a stand-in trainer (the attributes it reads) and a stand-in model whose logits are a
leaf tensor, and for simpo from `CPOTrainer.get_batch_logps` and `cpo_loss`: the same
logits go through our log-probs (`sequence_logps`' arithmetic) and `dpo_loss`. Float32
both sides; 1e-6 relative.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
from collections import defaultdict
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_jax.data.preference import load_preference, pair_rows
from moe_jax.posttrain import dpo
from moe_jax.posttrain import lora as lora_params
from moe_jax.tokenizer import DataError
from moe_jax.train.step import init_state, make_optimizer, make_train_step
from tests.helpers import tiny_config

BETA = 0.1


def pairs_config(path, *overrides):
    return tiny_config(
        "train.objective=dpo", "data.sft=preference", f"data.path={path}",
        "moe.n_experts=0", "model.n_layers=2", "attention.nope_interval=0",
        "attention.temperature_tuning=false", "lora.rank=8", "lora.alpha=16",
        "lora.targets=[attention,mlp]", "lora.base_dtype=float32", "train.seq_len=24",
        "train.batch_size=4", "data.val_fraction=0.25", "train.warmup_steps=1",
        *overrides,
    )  # fmt: skip


def separable(n: int, seed: int = 0) -> list[dict]:
    """Pairs whose chosen answer always names the larger of two numbers in the prompt."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        a, b = rng.choice(90, 2, replace=False) + 10
        big, small = max(a, b), min(a, b)
        out.append({"prompt": f"max {a} {b}:", "chosen": f" {big}", "rejected": f" {small}"})
    return out


def write_jsonl(path, values) -> str:
    path.write_text("".join(json.dumps(v) + "\n" for v in values))
    return str(path)


def pairs_batch(pairs, length: int) -> dict:
    rows = [pair_rows(p, length) for p in pairs]
    return {k: jnp.asarray(np.stack([r[k] for r in rows])) for k in rows[0]}


def _trl_loss(logits, input_ids, completion_mask, ref_c, ref_r, kind="sigmoid"):
    """TRL's DPO loss (loss_type `kind`) and metrics of these logits, from its own code."""
    torch = pytest.importorskip("torch")
    trl = pytest.importorskip("trl", reason="TRL parity needs trl (the `interop` extra)")

    metrics = {"train": defaultdict(list)}
    gather = lambda x: x
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True),
        accelerator=SimpleNamespace(device="cpu", gather_for_metrics=gather, gather=gather),
        aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True,
        f_divergence_type="reverse_kl", loss_types=[kind], loss_weights=[1.0], beta=BETA,
        use_weighting=False, label_smoothing=0.0, _metrics=metrics, _total_train_tokens=0,
        _tp_size=1,
    )  # fmt: skip
    model = lambda **_: SimpleNamespace(logits=logits)
    inputs = {
        "input_ids": torch.from_numpy(input_ids),
        "attention_mask": torch.ones(input_ids.shape, dtype=torch.long),
        "completion_mask": torch.from_numpy(completion_mask),
        "ref_chosen_logps": torch.from_numpy(ref_c),
        "ref_rejected_logps": torch.from_numpy(ref_r),
    }
    loss = trl.DPOTrainer._compute_loss(trainer, model, inputs, False)
    return loss, metrics["train"]


def _trl_simpo(logits, input_ids, completion_mask):
    """TRL's SimPO loss (CPOTrainer loss_type simpo, cpo_alpha 0: no NLL term) and rewards of
    these logits, from its own code: its per-token mean log-probs, then its loss."""
    torch = pytest.importorskip("torch")
    cpo = pytest.importorskip("trl.experimental.cpo.cpo_trainer")

    labels = torch.from_numpy(np.where(completion_mask == 1, input_ids, -100))
    logps = cpo.CPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
    trainer = SimpleNamespace(
        alpha=0.0, loss_type="simpo", simpo_gamma=GAMMA, beta=BETA, label_smoothing=0.0,
        accelerator=SimpleNamespace(device="cpu"),
    )  # fmt: skip
    losses, reward_c, reward_r = cpo.CPOTrainer.cpo_loss(trainer, *logps.chunk(2))
    metrics = {"rewards/chosen": [reward_c.mean().item()],
               "rewards/rejected": [reward_r.mean().item()]}  # fmt: skip
    return losses.mean(), metrics


GAMMA = 0.3  # SimPO's margin


@pytest.mark.parametrize("kind", ["sigmoid", "ipo", "simpo"])
def test_loss_gradient_and_metrics_equal_trls(kind):
    """TRL's batch is [chosen..., rejected...]; ours pairs rows (c, r, c, r, ...). sigmoid
    and ipo against DPOTrainer, simpo against CPOTrainer."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    P, T, V = 3, 7, 11
    logits = rng.standard_normal((2 * P, T, V)).astype(np.float32) * 2
    ids = rng.integers(0, V, (2 * P, T))
    mask = (rng.random((2 * P, T)) < 0.6).astype(np.int64)
    mask[:, 0], mask[:, 1] = 0, 1  # a prompt token first; every answer counts a token
    ref_c, ref_r = (rng.standard_normal(P).astype(np.float32) * 3 - 10 for _ in range(2))

    leaf = torch.tensor(logits, requires_grad=True)
    if kind == "simpo":
        loss, trl_metrics = _trl_simpo(leaf, ids, mask)
    else:
        loss, trl_metrics = _trl_loss(leaf, ids, mask, ref_c, ref_r, kind)
    loss.backward()
    n = mask[:, 1:].sum(axis=1).astype(np.float32)

    def ours(logits_RTV):
        logp = jax.nn.log_softmax(logits_RTV[:, :-1], axis=-1)
        picked = jnp.take_along_axis(logp, ids[:, 1:, None], -1)[..., 0] * mask[:, 1:]
        logps = jnp.sum(picked, axis=1)  # TRL's order: chosen then rejected
        return dpo.dpo_loss(logps[:P], logps[P:], ref_c, ref_r, BETA, kind, n[:P], n[P:], GAMMA)

    (value, metrics), grad = jax.value_and_grad(ours, has_aux=True)(jnp.asarray(logits))
    np.testing.assert_allclose(value, loss.item(), rtol=1e-6)
    np.testing.assert_allclose(grad, leaf.grad.numpy(), rtol=1e-5, atol=1e-7)
    if kind == "simpo":
        for k in ("chosen", "rejected"):
            np.testing.assert_allclose(metrics[f"reward_{k}"], trl_metrics[f"rewards/{k}"][0],
                                       rtol=1e-5)  # fmt: skip
        return
    for ours_key, theirs in (
        ("reward_chosen", "rewards/chosen"), ("reward_rejected", "rewards/rejected"),
        ("reward_margin", "rewards/margins"), ("reward_accuracy", "rewards/accuracies"),
        ("logps_chosen", "logps/chosen"), ("logps_rejected", "logps/rejected"),
    ):  # fmt: skip
        np.testing.assert_allclose(metrics[ours_key], trl_metrics[theirs][0], rtol=1e-5)


GOOD = ["sun", "sea", "sky", "tree", "rain", "leaf", "bird", "moon"]


def by_case(n: int, seed: int = 0) -> list[dict]:
    """Pairs that prefer a lower-case word to an upper-case one, drawn independently."""
    rng = np.random.default_rng(seed)
    return [
        {"prompt": f"q{i}:", "chosen": " " + rng.choice(GOOD),
         "rejected": " " + rng.choice(GOOD).upper()}
        for i in range(n)
    ]  # fmt: skip


def test_a_tiny_model_learns_a_separable_preference_set(tmp_path):
    """Pairs separable by the answers' case. The first step (adapters at B = 0: the policy
    is its reference) has loss ln 2 and rewards 0; after 20 steps the held-out pairs'
    reward accuracy is at least 0.9 and their margin positive."""
    cfg = pairs_config(
        write_jsonl(tmp_path / "p.jsonl", by_case(80)), "train.lr=2e-2", "train.steps=20",
        "train.batch_size=8", f"train.dpo_beta={BETA}",
    )  # fmt: skip
    data = load_preference(cfg)
    tx = make_optimizer(cfg.train)
    graphdef, state = init_state(cfg, tx)
    step = make_train_step(cfg, graphdef, tx)
    it = data.train_iterator(cfg)
    for i in range(cfg.train.steps):
        state, m = step(state, {k: jnp.asarray(v) for k, v in next(it).items()})
        if i == 0:
            np.testing.assert_allclose(m["dpo_loss"], math.log(2), rtol=1e-6)
            # (policy and reference are two traces of one function: rounding apart)
            assert abs(float(m["reward_margin"])) < 1e-6
            assert float(m["logps_chosen"]) < 0 and float(m["grad_norm"]) > 0
    val = pairs_batch(data.val, data.length)
    trained, frozen = lora_params.split(state["params"])
    _, metrics = jax.jit(dpo.loss_fn, static_argnums=(2, 4))(trained, frozen, graphdef, val, BETA)
    assert float(metrics["reward_accuracy"]) >= 0.9, metrics
    assert float(metrics["reward_margin"]) > 0


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"prompt": "a", "chosen": "b"}', "line 2 has no 'rejected' field"),
        ('{"prompt": "a", "chosen": ["b"], "rejected": "c"}', "line 2 mixes text and messages"),
        ('[1, 2]', "line 2 holds a JSON list, not an object"),
    ],
)  # fmt: skip
def test_bad_pairs_are_refused_by_line(tmp_path, line, message):
    path = tmp_path / "p.jsonl"
    path.write_text(json.dumps(separable(1)[0]) + "\n" + line + "\n")
    with pytest.raises(DataError, match=message):
        load_preference(pairs_config(str(path)))


def test_dpo_needs_preference_pairs(tmp_path):
    from moe_jax.config import ConfigError

    path = write_jsonl(tmp_path / "p.jsonl", separable(2))
    with pytest.raises(ConfigError, match="set both or neither"):
        pairs_config(path, "data.sft=prompt_completion")


def test_a_full_fine_tunes_reference_equals_loras_base_where_they_coincide(tmp_path):
    """A full fine-tune's reference is a frozen copy of its initial params
    (posttrain/reference_policy.py); LoRA's is its base with the adapters off. A LoRA policy (B
    drawn) against its base, and a full policy holding the same weights merged against a
    copy of that base, give the same loss and metrics (float reassociation apart)."""
    from flax import nnx

    from moe_jax.model import Transformer
    from moe_jax.posttrain.reference_policy import frozen_copy
    from tests.test_lora import base_config, draw_b

    cfg = pairs_config(write_jsonl(tmp_path / "p.jsonl", by_case(16)), "data.val_fraction=0.5")
    data = load_preference(cfg)
    batch = pairs_batch(data.val, data.length)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    draw_b(model)
    params = nnx.state(model, nnx.Param)
    loss = jax.jit(dpo.loss_fn, static_argnums=(2, 4))
    trained, frozen = lora_params.split(params)
    want, want_m = loss(trained, frozen, nnx.graphdef(model), batch, BETA)

    full = base_config(cfg)
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(full, rngs=nnx.Rngs(0))))
    policy = lora_params.merge_into_base(params, cfg.lora.alpha / cfg.lora.rank)
    base = nnx.from_flat_state(
        [(p, v) for p, v in nnx.to_flat_state(params) if not lora_params.is_adapter(p)]
    )
    got, got_m = loss(policy, None, graphdef, batch, BETA, frozen_copy(base, "float32"))
    assert abs(float(want_m["reward_chosen"])) > 1e-2  # the policies are not their reference
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for k in ("reward_chosen", "reward_rejected", "logps_chosen", "logps_rejected"):
        np.testing.assert_allclose(got_m[k], want_m[k], rtol=1e-5, atol=1e-6, err_msg=k)


def test_simpo_and_ipo_through_the_model(tmp_path):
    """train.dpo_loss through `loss_fn`: simpo equals the formula on per-token mean log-probs
    taken from the model's whole logits (each answer's counted tokens: its loss mask);
    ipo with the policy equal to its reference (B = 0) is (1 / (2 beta))^2."""
    from flax import nnx

    from moe_jax.model import Transformer

    path = write_jsonl(tmp_path / "p.jsonl", by_case(16))
    cfg = pairs_config(path, "data.val_fraction=0.5", "train.dpo_loss=simpo", "train.dpo_beta=2")
    data = load_preference(cfg)
    batch = pairs_batch(data.val, data.length)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    trained, frozen = lora_params.split(nnx.state(model, nnx.Param))
    loss = jax.jit(dpo.loss_fn, static_argnums=(2, 4))
    got, metrics = loss(trained, frozen, nnx.graphdef(model), batch, 2.0)

    tokens = np.asarray(batch["tokens"]).reshape(-1, batch["tokens"].shape[-1])
    mask = np.asarray(batch["loss_mask"]).reshape(tokens.shape)[:, 1:]
    logits = np.asarray(jax.jit(lambda m, x: m(x)[0])(model, tokens[:, :-1]), np.float64)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    picked = np.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0]
    mean = (picked * mask).sum(1) / mask.sum(1)  # rows c, r, c, r, ...
    want = np.mean(np.logaddexp(0, -(2.0 * (mean[0::2] - mean[1::2]) - cfg.train.simpo_gamma)))
    np.testing.assert_allclose(got - metrics["aux_loss"], want, rtol=1e-5)

    ipo = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, dpo_loss="ipo"))
    graphdef = nnx.graphdef(nnx.eval_shape(lambda: Transformer(ipo, rngs=nnx.Rngs(0))))
    got, metrics = loss(trained, frozen, graphdef, batch, BETA)
    np.testing.assert_allclose(got - metrics["aux_loss"], (1 / (2 * BETA)) ** 2, rtol=1e-6)


@pytest.mark.parametrize("base", ["lora_int8", "full_bf16"])
def test_a_dpo_run_stopped_and_resumed_equals_an_uninterrupted_one(tmp_path, base):
    """train.py with train.objective=dpo, LoRA on an int8 base (lora.base_dtype=int8) or a
    full fine-tune computing in bfloat16 (its reference a frozen copy of the initial params,
    matmul weights in bfloat16, in the optimizer state): 2 + 2 steps (the data position, the
    optimizer state, the int8 base or the reference restored) end bit for bit where 4
    straight steps do; the DPO metrics reach metrics.jsonl, the first step's loss ln 2. The
    resumed run is a copy of the straight one resumed at its step-2 checkpoint (the one a run
    stopped at 2 saves: checkpoint.every=2), one training run fewer."""
    import shutil

    from flax import nnx

    from moe_jax.inference.load import load_run
    from moe_jax.train.loop import train

    path = write_jsonl(tmp_path / "p.jsonl", by_case(24))
    which = {"lora_int8": ["lora.base_dtype=int8", "lora.dropout=0.1"],
             "full_bf16": ["lora.rank=0", "model.dtype=bfloat16"]}[base]  # fmt: skip
    cfg = lambda run, *more: pairs_config(
        path, f"run_dir={run}", "train.steps=4", "train.log_every=1", "train.eval_every=100",
        "train.eval_batches=1", "checkpoint.every=2", "train.trackers=[]",
        "train.peak_flops=1e11", *which, *more,
    )  # fmt: skip
    train(cfg(tmp_path / "straight"))
    shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
    train(cfg(tmp_path / "resumed", "train.resume_step=2"))
    assert [p.name for p in (tmp_path / "resumed/superseded").iterdir()] == ["4"]  # retrained
    params = lambda run: dict(nnx.to_flat_state(nnx.state(load_run(run)[1], nnx.Param)))
    straight, resumed = params(tmp_path / "straight"), params(tmp_path / "resumed")
    for p, v in straight.items():
        np.testing.assert_array_equal(resumed[p][...], v[...], err_msg=str(p))
    records = (tmp_path / "resumed" / "metrics.jsonl").read_text().splitlines()
    steps = [r for r in map(json.loads, records) if r["kind"] == "train"]
    assert {"dpo_loss", "reward_margin", "reward_accuracy", "logps_chosen"} <= set(steps[-1])
    # step 1: the policy is its reference (the full copy holds the bf16 values it reads)
    np.testing.assert_allclose(steps[0]["dpo_loss"], math.log(2), rtol=1e-6)
    if base == "lora_int8":  # its adapters export (merged: tests/test_lora_merged_export.py)
        from moe_jax.interop.peft import export_adapter

        export_adapter(tmp_path / "resumed", tmp_path / "adapter")
        assert (tmp_path / "adapter" / "adapter_config.json").is_file()


def test_message_pairs_count_their_answer_turns_only(tmp_path):
    """TRL's conversational form through the chat template: each row is the rendered
    prompt + answer, and only the answer's assistant turn counts (not the prompt's own
    earlier assistant turn)."""
    from moe_jax.data.preference import encode_pair
    from moe_jax.data.sft import Record
    from moe_jax.tokenizer import load_tokenizer
    from tests.test_tokenizer import SHAKESPEARE, write_bpe

    if not SHAKESPEARE.is_file():  # the chat BPE is trained on the shared corpus, as
        pytest.skip(f"{SHAKESPEARE} not present")  # test_tokenizer's are (CI's clone has it)
    write_bpe(tmp_path / "tok")
    tokenizer = load_tokenizer(str(tmp_path / "tok"))
    turn = lambda role, text: {"role": role, "content": text}
    prompt = [turn("user", "Fruit?"), turn("assistant", "Mango."), turn("user", "Veg?")]
    value = {"prompt": prompt, "chosen": [turn("assistant", "Leek.")],
             "rejected": [turn("assistant", "Rock.")]}  # fmt: skip
    # (this template's generation prompt is not how it starts an assistant turn: the counted
    # text is all that the answer adds, sft.chat_pieces' rule)
    start = tokenizer.apply_chat_template(prompt, add_generation_prompt=False)
    for (tokens, mask), answer in zip(
        encode_pair(Record("line 1", value), tokenizer), ("Leek.", "Rock."), strict=True
    ):
        whole = tokenizer.apply_chat_template(prompt + [turn("assistant", answer)], False)
        decode = lambda ids: tokenizer.library.decode(ids.tolist(), skip_special_tokens=False)
        assert decode(tokens) == whole
        assert decode(tokens[mask == 1]) == whole[len(start) :]
        assert answer in decode(tokens[mask == 1]) and "Mango" not in decode(tokens[mask == 1])


def test_held_out_pairs_metrics_equal_a_direct_computation(tmp_path):
    """The trainer's DPO eval (train/evaluation.py: the validation pairs in batches as
    training reads them, `dpo.eval_sums`): 5 held-out pairs in 2 batches of 4, 3 of them
    padding that count nothing; loss, reward accuracy and margin (means over the pairs) and
    the chosen answers' cross-entropy equal those of each pair's log-probs taken from the
    model's whole logits with its adapters on (policy) and off (reference), in float64."""
    from flax import nnx

    from moe_jax.model import Transformer
    from moe_jax.model import lora as adapters
    from moe_jax.train.evaluation import Validation
    from tests.test_lora import draw_b

    cfg = pairs_config(write_jsonl(tmp_path / "p.jsonl", by_case(10)), "data.val_fraction=0.5")
    data = load_preference(cfg)
    assert len(data.val) == 5 and cfg.train.batch_size == 4
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    draw_b(model)  # the policy is not its reference
    params = nnx.state(model, nnx.Param)
    val = Validation(cfg, nnx.graphdef(model), data, lambda b: jax.tree.map(jnp.asarray, b))
    assert len(val.pairs) == 2
    record, line = val.run({"params": params, "opt_state": ()}, 7)

    rows = pairs_batch(data.val, data.length)  # [5, 2, T+1]: chosen, rejected
    tokens = np.asarray(rows["tokens"]).reshape(10, -1)
    mask = np.asarray(rows["loss_mask"]).reshape(10, -1)[:, 1:]

    def logps(off: bool) -> np.ndarray:  # each answer's summed log-prob, float64: [10]
        with adapters.off() if off else contextlib.nullcontext():
            logits = np.asarray(model(jnp.asarray(tokens[:, :-1]))[0], np.float64)
        logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
        return (np.take_along_axis(logp, tokens[:, 1:, None], -1)[..., 0] * mask).sum(1)

    policy, reference = logps(off=False), logps(off=True)
    margin = BETA * ((policy - reference)[0::2] - (policy - reference)[1::2])
    assert np.all(np.abs(margin) > 1e-3)
    want = {
        "val_dpo_loss": np.mean(np.logaddexp(0, -margin)),
        "val_reward_accuracy": np.mean(margin > 0),
        "val_reward_margin": np.mean(margin),
        "val_ce_chosen": -policy[0::2].sum() / mask[0::2].sum(),
    }
    assert 0 < want["val_reward_accuracy"] < 1  # neither all nor none: the padding would show
    for k, v in want.items():
        np.testing.assert_allclose(record[k], v, rtol=2e-5, atol=1e-6, err_msg=k)
    assert "unigram" not in line and "reward accuracy" in line
