"""LoRA against PEFT (moe_jax/interop/peft.py): our adapted logits equal PEFT's on the base
and adapter we export, the adapter reads back to the same pairs, and a PEFT adapter's file
names and shapes are those PEFT itself saves.

A tiny Llama (tests/test_interop.py's, with attention biases) with adapters on attention
and the MLP, B drawn so the adapters move the logits by O(0.1). Tolerance: 1e-5 on O(1)
logits, both sides float32 (measured ~1e-6). Not a MoE model: PEFT 0.21 under transformers 5
rewrites the target names gate_proj / up_proj / down_proj of a Mixtral / Qwen-MoE model to
its fused experts, so a MoE model's dense MLPs cannot hold PEFT adapters there.
"""

from __future__ import annotations

import dataclasses
import json

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch", reason="PEFT tests need torch (the `interop` extra)")
pytest.importorskip("transformers", reason="PEFT tests need transformers (the `interop` extra)")
peft = pytest.importorskip("peft", reason="PEFT tests need peft (the `interop` extra)")

from moe_jax.config import LoRAConfig  # noqa: E402
from moe_jax.interop import InteropError, load_hf  # noqa: E402
from moe_jax.interop.peft import adapters_from_peft, save_adapter  # noqa: E402
from moe_jax.model import Transformer  # noqa: E402
from moe_jax.posttrain import lora as lora_params  # noqa: E402
from tests.test_interop import hf_logits, hf_model, our_logits, tokens  # noqa: E402
from tests.test_lora import draw_b  # noqa: E402

LORA = LoRAConfig(rank=4, alpha=8.0, targets=("attention", "mlp"), base_dtype="float32")


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    """(the HF base dir, our config and adapted model): the base imported, adapters with B
    drawn on top."""
    directory = tmp_path_factory.mktemp("peft") / "base"
    hf_model("llama").save_pretrained(directory)
    base_cfg, base = load_hf(directory)
    cfg = dataclasses.replace(base_cfg, lora=LORA)
    model = Transformer(cfg, rngs=nnx.Rngs(1))
    nnx.update(model, nnx.state(base, nnx.Param))  # the base's weights, the adapters fresh
    draw_b(model, seed=3)
    return directory, cfg, model


def test_adapted_logits_equal_peft_on_the_exported_adapter(adapted, tmp_path):
    directory, cfg, model = adapted
    out = tmp_path / "adapter"
    assert save_adapter(cfg, nnx.state(model, nnx.Param), out) == "LlamaForCausalLM"
    conf = json.loads((out / "adapter_config.json").read_text())
    assert conf["r"] == 4 and conf["lora_alpha"] == 8.0
    assert set(conf["target_modules"]) == {
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
    }  # fmt: skip

    x = tokens(2, 12, seed=4)
    base = peft_base(directory)
    base_logits = hf_logits(base, x)
    peft_model = peft.PeftModel.from_pretrained(base, out).eval()  # wraps `base` in place
    # every pair of ours was loaded by PEFT (no fresh B = 0 pair stands in for one)
    loaded = {k for k in peft_model.state_dict() if "lora_B" in k}
    assert len(loaded) == 2 * (4 + 3)  # 2 layers' attention and MLP
    ours = our_logits(model, x)
    assert np.abs(ours - base_logits).max() > 1e-2  # the adapters matter
    with torch.no_grad():
        theirs = peft_model(torch.from_numpy(x)).logits.numpy()
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-5)

    # and back: the file's pairs are ours
    read = adapters_from_peft(cfg, out)
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    assert {p for p in flat if lora_params.is_trained(p)} == set(read)
    for p, a in read.items():
        np.testing.assert_array_equal(a, np.asarray(flat[p][...]), err_msg=str(p))


def peft_base(directory):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()


def peft_adapter(directory, out, modules, seed=0):
    """(an adapter PEFT itself makes, pairs drawn, saved to `out`; the adapted model)."""
    model = peft.get_peft_model(
        peft_base(directory), peft.LoraConfig(r=4, lora_alpha=8, target_modules=modules)
    )
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(0.2 * torch.randn(p.shape, generator=g))
    model.save_pretrained(out)
    return model.eval()


def test_a_peft_saved_adapter_reads_into_our_pairs(adapted, tmp_path):
    """An adapter PEFT itself saved (its names, its layout) gives our model PEFT's logits;
    one that adapts fewer weights than lora.targets asks for is refused, naming a tensor."""
    directory, cfg, _ = adapted
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    theirs = peft_adapter(directory, tmp_path / "all", modules)
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    nnx.update(model, nnx.state(load_hf(directory)[1], nnx.Param))
    read = adapters_from_peft(cfg, tmp_path / "all")
    for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
        if path in read:
            v[...] = read[path]
    x = tokens(2, 12, seed=5)
    with torch.no_grad():
        ref = theirs(torch.from_numpy(x)).logits.numpy()
    np.testing.assert_allclose(our_logits(model, x), ref, rtol=0, atol=1e-5)

    peft_adapter(directory, tmp_path / "some", ["q_proj", "o_proj"])
    with pytest.raises(InteropError, match="has no tensor .*k_proj.lora_A"):
        adapters_from_peft(cfg, tmp_path / "some")


def test_routed_expert_adapters_equal_peft_on_a_moe_model(tmp_path):
    """A Qwen3-MoE with adapters on attention and its routed experts: the pairs go out one
    per expert (`mlp.experts.{e}.gate_proj`, ...: the per-expert names vLLM reads, which PEFT
    folds into its adapter of transformers' fused experts), PEFT's logits equal ours, and
    they read back to the same pairs."""
    directory = tmp_path / "base"
    hf_model("qwen3_moe").save_pretrained(directory)
    base_cfg, base = load_hf(directory)
    lora = dataclasses.replace(LORA, targets=("attention", "experts"))
    cfg = dataclasses.replace(base_cfg, lora=lora)
    model = Transformer(cfg, rngs=nnx.Rngs(1))
    nnx.update(model, nnx.state(base, nnx.Param))
    draw_b(model, seed=4)
    save_adapter(cfg, nnx.state(model, nnx.Param), tmp_path / "adapter")
    names = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert {"gate_proj", "up_proj", "down_proj"} <= set(names["target_modules"])

    x = tokens(2, 12, seed=7)
    hf = peft_base(directory)
    base_logits = hf_logits(hf, x)
    with torch.no_grad():
        theirs = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
        theirs = theirs(torch.from_numpy(x)).logits.numpy()
    ours = our_logits(model, x)
    assert np.abs(ours - base_logits).max() > 1e-2
    np.testing.assert_allclose(theirs, ours, rtol=0, atol=1e-5)
    read = adapters_from_peft(cfg, tmp_path / "adapter")
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    assert any("experts" in p for p in read)
    for p, a in read.items():
        np.testing.assert_array_equal(a, np.asarray(flat[p][...]), err_msg=str(p))


def test_a_lora_run_from_an_hf_dir_resumes_exactly_and_exports_both_ways(tmp_path):
    """train.py init_from=HF_DIR with LoRA (dropout on): the base comes from the checkpoint
    and stays as it was, a run stopped and resumed ends bit for bit where an uninterrupted
    one does, and its merged export (transformers) and its adapter on the HF base (PEFT)
    both give the run's own logits; the adapter starts a new run on a mesh (bf16 base), and
    an int8 base from the HF directory is the bf16 base's int8 form, laid out."""
    from transformers import AutoModelForCausalLM

    from moe_jax.config import load_config
    from moe_jax.inference.load import load_run
    from moe_jax.interop.__main__ import main as interop
    from moe_jax.interop.export import export_run
    from moe_jax.train.loop import train

    directory = tmp_path / "hf"
    hf_model("llama", seed=2, vocab_size=256).save_pretrained(directory)
    cfg = lambda run: load_config(None, [
        f"init_from={directory}", f"run_dir={run}", "lora.rank=4", "lora.alpha=8",
        "lora.targets=[attention,mlp]", "lora.base_dtype=float32", "lora.dropout=0.1",
        "train.steps=4", "train.batch_size=4", "train.seq_len=16", "train.lr=2e-2",
        "train.warmup_steps=1", "train.eval_every=100", "train.eval_batches=1",
        "train.log_every=1", "checkpoint.every=2", "data.embedded_max_bytes=20000",
        "train.peak_flops=1e11", "train.trackers=[]",
    ])  # fmt: skip
    train(cfg(tmp_path / "straight"), stop_at=4)
    train(cfg(tmp_path / "resumed"), stop_at=2)
    train(cfg(tmp_path / "resumed"), stop_at=4)
    _, straight, _ = load_run(tmp_path / "straight")
    run_cfg, model, _ = load_run(tmp_path / "resumed")
    got = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    want = dict(nnx.to_flat_state(nnx.state(straight, nnx.Param)))
    base = dict(nnx.to_flat_state(nnx.state(load_hf(directory)[1], nnx.Param)))
    for p, v in got.items():
        np.testing.assert_array_equal(v[...], want[p][...], err_msg=str(p))
        if p in base:  # the frozen base, as imported
            np.testing.assert_array_equal(v[...], base[p][...], err_msg=str(p))

    x = tokens(2, 12, seed=6)
    ours = our_logits(model, x)
    hf_base = peft_base(directory)
    assert np.abs(ours - hf_logits(hf_base, x)).max() > 1e-3  # training moved the adapters
    export_run(tmp_path / "resumed", tmp_path / "merged")
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    np.testing.assert_allclose(hf_logits(merged, x), ours, rtol=0, atol=1e-5)
    out = ["--out", str(tmp_path / "adapter")]
    assert interop(["export-adapter", str(tmp_path / "resumed"), *out]) == 0  # the CLI
    with torch.no_grad():
        peft_model = peft.PeftModel.from_pretrained(hf_base, tmp_path / "adapter").eval()
        theirs = peft_model(torch.from_numpy(x)).logits.numpy()
    np.testing.assert_allclose(theirs, ours, rtol=0, atol=1e-5)
    assert run_cfg.lora.dropout == 0.1

    # and the adapter imported onto the HF base (lora.init_adapter): a new run starts from
    # exactly these pairs, on a mesh, with base dtype bf16 (the base cast, the pairs not)
    from moe_jax.sharding import make_mesh
    from moe_jax.train.init_from import init_source, start_state, with_source_architecture
    from moe_jax.train.step import init_state, make_optimizer

    new = load_config(None, [
        f"init_from={directory}", f"run_dir={tmp_path / 'new'}", "lora.rank=4", "lora.alpha=8",
        "lora.targets=[attention,mlp]", f"lora.init_adapter={tmp_path / 'adapter'}",
        "mesh.data=2", "mesh.fsdp=2", "mesh.tensor=2", "train.batch_size=4",
    ])  # fmt: skip
    new = with_source_architecture(new)  # as train.py does
    tx = make_optimizer(new.train)
    _, abstract = init_state(new, tx, abstract=True, mesh=make_mesh(new))
    state, _ = start_state(init_source(new, None, print), abstract, tx, new)
    for p, v in nnx.to_flat_state(state["params"]):
        if lora_params.is_trained(p):
            np.testing.assert_array_equal(v[...], got[p][...], err_msg=str(p))
        elif p in base and base[p][...].ndim >= 2:
            assert v[...].dtype == jnp.bfloat16, p
            np.testing.assert_array_equal(v[...], base[p][...].astype(jnp.bfloat16), str(p))

    # lora.base_dtype=int8: the HF base read in bfloat16, then quantised weight by weight
    # (a layer at a time) onto the mesh: each stored weight is the bf16 base's int8 form
    from moe_jax.model.int8 import CONTRACTED_AXES, QuantizedParam, quantize_tensor

    q = dataclasses.replace(new, lora=dataclasses.replace(new.lora, base_dtype="int8"))
    _, abstract = init_state(q, tx, abstract=True, mesh=make_mesh(q))
    targets = dict(nnx.to_flat_state(abstract["params"]))
    state, _ = start_state(init_source(q, None, print), abstract, tx, q)
    n = 0
    for p, v in nnx.to_flat_state(state["params"]):
        if isinstance(v, QuantizedParam):
            want = quantize_tensor(base[p][...].astype(jnp.bfloat16), CONTRACTED_AXES[p[-1]])
            for k, a in v.get_raw_value().items():
                np.testing.assert_array_equal(a, want[k], err_msg=str(p))
                assert a.sharding == targets[p].get_raw_value()[k].sharding, p
            n += 1
    assert n >= 8  # attention's 4, the MLP's 3, the head
