"""Hugging Face interop of DeepSeek-V3's multi-token prediction (MTP) layers, for
`DeepseekV3ForCausalLM` and `Glm4MoeForCausalLM`: our MTP logits against a torch reference,
the round trip, and what an import takes, checks and skips.

The reference computes depth k from the published semantics (vLLM's DeepSeekMTP; the paper,
sec. 2.2) with the tensors the export wrote, read back from its safetensors file by their
Hugging Face names: h'_k = eh_proj [enorm(embed(token t+k)); hnorm(h_{k-1}(t))], h_k =
the decoder layer (h'_k), logits = shared_head.head(shared_head.norm(h_k)). h_0 is the main
model's last layer output before its final norm, taken from transformers (the input of its
`model.norm`; its `hidden_states[-1]` is after that norm, checked here). The decoder layer
is transformers' own `DeepseekV3DecoderLayer` / `Glm4MoeDecoderLayer`, loaded by
`from_pretrained` from the MTP layer's tensors (a model of num_hidden_layers + D layers,
whose last D are the MTP layers' decoder layers), run at the main positions 0..T-1 under a
causal mask. (vLLM pairs h(t) with token t+1 at position t+1 and zeroes the embedding at
position 0, where it has no h(-1): RoPE sees only relative positions, and our pairs start at
h(0), so that is the same computation.) The cases: the tiny DeepSeek-V3 (query LoRA, YaRN,
groups) and GLM-4.5 (partial rotary, QK-norm, biases) configs of test_interop_deepseek.py,
every weight drawn (norm scales 1 + noise, so enorm, hnorm and the norms after differ), at
MTP depths 1 and 2 (depth 2 chains h_1, before its norm, into the second depth).

Tolerance: 1e-5 absolute on MTP logits of O(1) (std ~0.8), as for the main logits: the same
float32 math in different orders through one more decoder layer; measured differences are
<= 3e-6, while each wrong piece checked here (h_0 after the final norm, the two halves of
eh_proj's input swapped) moves them by > 1e-2.
Budget: ~40 s on 2 cores (four exported models, each compiled once for its MTP forward).
"""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch", reason="interop tests need torch (the `interop` extra)")
transformers = pytest.importorskip(
    "transformers", reason="interop tests need transformers (the `interop` extra)"
)
from safetensors.numpy import save_file  # noqa: E402
from safetensors.torch import load_file  # noqa: E402

from moe_jax.interop import InteropError, config_from_hf, load_hf, save_hf  # noqa: E402
from moe_jax.interop.safetensors_io import TensorReader  # noqa: E402
from moe_jax.model.mtp import mtp_hidden  # noqa: E402
from moe_jax.train.step import split_mtp  # noqa: E402
from tests.test_interop import (  # noqa: E402
    assert_same_params,
    hf_logits,
    our_logits,
    params_of,
    random_model,
    tokens,
    write_config,
)
from tests.test_interop_deepseek import hf_model  # noqa: E402

TOL = 1e-5
CASES = [("deepseek_v3", 1), ("glm4_moe", 1), ("deepseek_v3", 2), ("glm4_moe", 2)]


@nnx.jit
def our_mtp_logits(model, tokens_BT1):
    """Each depth's logits [B, T, V] over tokens[:, :T] (T = the row less one), as the MTP
    loss computes them (`train_step.mtp_loss`): depth k's input at t is token t+k."""
    x_BTD, _ = model(tokens_BT1[:, :-1], head=False)
    D = model.cfg.model.mtp_depth
    ahead = [split_mtp(tokens_BT1, k)[0] for k in range(1, D + 1)]
    head_DV = model.head_weight()
    hidden = mtp_hidden(model, x_BTD, ahead)
    return [layer.logits(h, head_DV) for layer, (h, _) in zip(model.mtp, hidden, strict=True)]


def rms_norm(x, weight, eps: float):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def reference_mtp_logits(main, layers, tensors: dict, L: int, tokens_BT1, swap=False, post=False):
    """Depth k's logits [B, T - k, V] at the positions whose target t+k+1 is in the row, from
    transformers' main model `main`, the MTP decoder layers `layers` and the checkpoint's
    `tensors` (the module doc). `swap` puts hnorm's half first, `post` starts from h_0 after
    the final norm: the wrong versions, to show the test can tell."""
    x = torch.from_numpy(tokens_BT1)
    T = x.shape[1] - 1
    seen = {}
    hook = main.model.norm.register_forward_pre_hook(lambda _, args: seen.update(h=args[0]))
    try:
        with torch.no_grad():
            out = main(x[:, :T], output_hidden_states=True)
    finally:
        hook.remove()
    h = seen["h"]
    with torch.no_grad():  # transformers' last hidden state is after the final norm: not h_0
        torch.testing.assert_close(out.hidden_states[-1], main.model.norm(h), rtol=0, atol=0)
        if post:
            h = out.hidden_states[-1]
        eps, logits = main.config.rms_norm_eps, []
        for k, layer in enumerate(layers):
            at = f"model.layers.{L + k}."  # depth k+1's layer
            w = {name[len(at) :]: v for name, v in tensors.items() if name.startswith(at)}
            n = T - k  # positions t whose token t+k+1 (depth k+1's target) is in the row
            h = h[:, :n]
            emb = torch.nn.functional.embedding(x[:, k + 1 : k + 1 + n], w["embed_tokens.weight"])
            halves = [rms_norm(emb, w["enorm.weight"], eps), rms_norm(h, w["hnorm.weight"], eps)]
            h_in = torch.cat(halves[::-1] if swap else halves, dim=-1) @ w["eh_proj.weight"].T
            positions = torch.arange(n)[None]
            h = layer(
                h_in,
                attention_mask=torch.full((n, n), float("-inf")).triu(1)[None, None],
                position_ids=positions,
                position_embeddings=main.model.rotary_emb(h_in, positions),
            )
            normed = rms_norm(h, w["shared_head.norm.weight"], eps)
            logits.append((normed @ w["shared_head.head.weight"].T).numpy())
    return logits


@pytest.fixture(scope="module", params=CASES, ids=[f"{n}-depth{d}" for n, d in CASES])
def exported(request, tmp_path_factory):
    """(our config and model with MTP depth D, every param drawn; the export's directory)."""
    name, depth = request.param
    directory = tmp_path_factory.mktemp(f"{name}_{depth}")
    hf_model(name).save_pretrained(directory / "hf")
    cfg = config_from_hf(directory / "hf")
    assert cfg.model.mtp_depth == 0  # save_pretrained writes no MTP layer (config.json: 1)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, mtp_depth=depth))
    ours = random_model(cfg, seed=7)
    save_hf(cfg, ours, directory / "out")
    return cfg, ours, directory / "out"


def test_mtp_logits_match_a_torch_reference(exported):
    cfg, ours, out = exported
    L, D = cfg.model.n_layers, cfg.model.mtp_depth
    written = json.loads((out / "config.json").read_text())
    assert written["num_nextn_predict_layers"] == D
    load = transformers.AutoModelForCausalLM.from_pretrained
    main = load(out, attn_implementation="eager").eval()
    # transformers ignores the MTP layers: the main model's logits are as without them
    x = tokens(3, 25, seed=3)
    np.testing.assert_allclose(hf_logits(main, x), our_logits(ours, x), rtol=0, atol=TOL)
    # its decoder layers L..L+D-1, loaded by transformers from the MTP layers' tensors
    longer = load(out, attn_implementation="eager", num_hidden_layers=L + D).eval()
    layers = list(longer.model.layers[L:])
    assert len(layers) == D and all(hasattr(layer.mlp, "gate") for layer in layers)  # MoE
    tensors = load_file(out / "model.safetensors")
    copies = {"embed_tokens": "model.embed_tokens", "shared_head.head": "lm_head"}
    for k in range(D):  # the copies the released checkpoints hold
        for copy, main_name in copies.items():
            mtp_copy = tensors[f"model.layers.{L + k}.{copy}.weight"]
            assert torch.equal(mtp_copy, tensors[f"{main_name}.weight"]), (k, copy)
    ref = reference_mtp_logits(main, layers, tensors, L, x)
    got = [np.asarray(a) for a in our_mtp_logits(ours, jnp.asarray(x, jnp.int32))]
    T = x.shape[1] - 1
    for k in range(D):
        assert np.std(ref[k]) > 0.3  # O(1) logits, so the tolerance is tight
        np.testing.assert_allclose(got[k][:, : T - k], ref[k], rtol=0, atol=TOL, err_msg=f"{k=}")
    for wrong in (dict(swap=True), dict(post=True)):
        bad = reference_mtp_logits(main, layers, tensors, L, x, **wrong)
        assert np.abs(bad[0] - ref[0]).max() > 1e-2, wrong


def test_round_trip_is_exact(exported):
    """import(export(model)): the same config (mtp_depth D from num_nextn_predict_layers) and
    every param bit for bit, the MTP layers' with them."""
    cfg, ours, out = exported
    cfg2, back = load_hf(out)
    assert cfg2 == cfg and cfg2.model.mtp_depth == cfg.model.mtp_depth
    assert any(p[0] == "mtp" for p in params_of(back))
    assert_same_params(back, ours)


def test_mtp_layers_can_be_left_out(exported):
    """`mtp=False`: the main model alone, the MTP layers' tensors skipped unread."""
    cfg, ours, out = exported
    assert config_from_hf(out).model.mtp_depth == cfg.model.mtp_depth
    assert config_from_hf(out, mtp=False).model.mtp_depth == 0
    cfg2, back = load_hf(out, mtp=False)
    assert cfg2 == dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, mtp_depth=0))
    main = {p: v for p, v in params_of(ours).items() if p[0] != "mtp"}
    got = params_of(back)
    assert got.keys() == main.keys()
    for path, value in main.items():
        np.testing.assert_array_equal(got[path], value, err_msg=str(path))


def rewritten(out, directory, change) -> None:
    """A copy of the export `out` in `directory`, its tensors as `change(tensors)` leaves them."""
    reader = TensorReader(out)
    tensors = {n: reader.get(n) for n in reader.names()}
    change(tensors)
    directory.mkdir()
    (directory / "config.json").write_bytes((out / "config.json").read_bytes())
    save_file(tensors, directory / "model.safetensors")


@pytest.mark.parametrize("copy", ["embed_tokens.weight", "shared_head.head.weight"])
def test_copies_of_the_embedding_and_head_are_checked(exported, tmp_path, copy):
    """The MTP layer's copies of the embedding and the head are ours themselves: an import
    takes a checkpoint without them, and refuses one whose copy differs (one element, one
    ulp), naming it."""
    cfg, ours, out = exported
    name = f"model.layers.{cfg.model.n_layers + cfg.model.mtp_depth - 1}.{copy}"

    rewritten(out, tmp_path / "absent", lambda t: t.pop(name))
    assert_same_params(load_hf(tmp_path / "absent")[1], ours)

    def nudge(t):
        t[name] = t[name].copy()
        t[name][5, 3] = np.nextafter(t[name][5, 3], np.float32(np.inf))

    rewritten(out, tmp_path / "differs", nudge)
    with pytest.raises(InteropError, match="^[^\n]*$") as err:
        load_hf(tmp_path / "differs")
    assert f"tensor '{name}' is not an exact copy of the main model's" in str(err.value)


def test_an_incomplete_mtp_layer_is_named(exported, tmp_path):
    """The checkpoint holds an MTP layer but not all of it: the missing tensor is named (a
    missing later depth likewise), unless the MTP layers are left out."""
    cfg, ours, out = exported
    L, D = cfg.model.n_layers, cfg.model.mtp_depth
    missing = f"model.layers.{L + D - 1}.hnorm.weight"
    rewritten(out, tmp_path / "partial", lambda t: t.pop(missing))
    with pytest.raises(InteropError, match="^[^\n]*$") as err:
        load_hf(tmp_path / "partial")
    assert f"tensor '{missing}' is missing" in str(err.value)
    assert load_hf(tmp_path / "partial", mtp=False)[0].model.mtp_depth == 0


def test_config_json_alone_gives_its_depth(tmp_path):
    """Without tensors to look at (config.json alone), config.json's depth; with `mtp=False`
    none."""
    write_config(tmp_path, architectures=["DeepseekV3ForCausalLM"], num_nextn_predict_layers=2,
                 num_hidden_layers=3)  # fmt: skip
    assert config_from_hf(tmp_path).model.mtp_depth == 2
    assert config_from_hf(tmp_path, mtp=False).model.mtp_depth == 0


def test_cli_import_takes_or_leaves_out_the_mtp_layers(tmp_path, capsys):
    """`python -m moe_jax.interop import` takes the MTP layers, `model.mtp_depth=0` leaves
    them out (another depth stays refused), and export writes them back."""
    from moe_jax.interop.__main__ import main as interop

    hf_model("deepseek_v3", vocab_size=256).save_pretrained(tmp_path / "plain")  # byte ids
    cfg = config_from_hf(tmp_path / "plain")
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, mtp_depth=1))
    ours = random_model(cfg, seed=8)
    save_hf(cfg, ours, tmp_path / "hf")
    quick = ["data.embedded_max_bytes=100000"]
    assert interop(["import", str(tmp_path / "hf"), "--out", str(tmp_path / "run"), *quick]) == 0
    assert interop(["export", str(tmp_path / "run"), "--out", str(tmp_path / "back")]) == 0
    assert "not written" not in capsys.readouterr().out
    assert_same_params(load_hf(tmp_path / "back")[1], ours)
    args = ["import", str(tmp_path / "hf"), "--out", str(tmp_path / "main"), *quick]
    assert interop([*args, "model.mtp_depth=0"]) == 0
    assert interop(["export", str(tmp_path / "main"), "--out", str(tmp_path / "main_hf")]) == 0
    assert config_from_hf(tmp_path / "main_hf").model.mtp_depth == 0
    mtp_layer = f"model.layers.{cfg.model.n_layers}."
    assert not any(n.startswith(mtp_layer) for n in TensorReader(tmp_path / "main_hf").names())
    assert interop([*args[:3], str(tmp_path / "two"), *quick, "model.mtp_depth=2"]) == 2
    assert "'model.mtp_depth' is set by" in capsys.readouterr().err
