"""Streaming Hugging Face import (moe_jax/interop/stream.py, run/stream_save.py, as_run.py).

- Memory: a many-layer tiny Qwen3-MoE checkpoint imports (onto one device, onto 8 simulated
  devices with fsdp 8, and into a run directory), exports, and loads from that run (bf16)
  with a peak of traced host allocations (tracemalloc sees NumPy's) bounded by its largest
  tensor, not by its total.
- bf16 stays bf16 through import and export, bit for bit.
- A Hugging Face directory wherever a run is read: `sample.py --run HF_DIR` prints what
  sampling the import prints; `init_from=HF_DIR` takes the same first step as `init_from=`
  the import; both from a bf16 checkpoint, whose import keeps bf16.
Budget: ~15 s on 2 cores.
"""

from __future__ import annotations

import gc
import json
import re
import runpy
import shutil
import tracemalloc
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import save_file

torch = pytest.importorskip("torch", reason="interop tests need torch (the `interop` extra)")
from safetensors.torch import load_file  # noqa: E402
from safetensors.torch import save_file as save_torch  # noqa: E402

from moe_jax.config import load_config  # noqa: E402
from moe_jax.inference.load import load_run  # noqa: E402
from moe_jax.interop import load_hf  # noqa: E402
from moe_jax.interop import stream as stream_mod  # noqa: E402
from moe_jax.interop.__main__ import main as interop  # noqa: E402
from moe_jax.interop.safetensors_io import TensorReader  # noqa: E402
from moe_jax.run.layout import RunError  # noqa: E402
from moe_jax.sharding import LOGICAL_RULES, make_mesh, state_shardings  # noqa: E402
from moe_jax.train.loop import train  # noqa: E402
from tests.test_interop import gpt_oss_as_released, hf_model, params_of  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
L, D, H, KV, HD, E, F, V = 8, 256, 4, 2, 64, 8, 256, 1024
CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": V,
    "hidden_size": D,
    "intermediate_size": 512,
    "moe_intermediate_size": F,
    "num_hidden_layers": L,
    "num_attention_heads": H,
    "num_key_value_heads": KV,
    "head_dim": HD,
    "num_experts": E,
    "num_experts_per_tok": 2,
    "norm_topk_prob": True,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}


def _tensors() -> dict[str, tuple]:
    shapes = {
        "model.embed_tokens.weight": (V, D),
        "model.norm.weight": (D,),
        "lm_head.weight": (V, D),
    }
    for i in range(L):
        p = f"model.layers.{i}."
        shapes |= {
            p + "input_layernorm.weight": (D,),
            p + "post_attention_layernorm.weight": (D,),
            p + "self_attn.q_proj.weight": (H * HD, D),
            p + "self_attn.k_proj.weight": (KV * HD, D),
            p + "self_attn.v_proj.weight": (KV * HD, D),
            p + "self_attn.o_proj.weight": (D, H * HD),
            p + "self_attn.q_norm.weight": (HD,),
            p + "self_attn.k_norm.weight": (HD,),
            p + "mlp.gate.weight": (E, D),
        }
        for e in range(E):
            for name, shape in (("gate_proj", (F, D)), ("up_proj", (F, D)), ("down_proj", (D, F))):
                shapes[p + f"mlp.experts.{e}.{name}.weight"] = shape
    return shapes


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """(directory, largest tensor's bytes, all tensors' bytes) of an 8-layer float32
    checkpoint written in 4 shards."""
    directory = tmp_path_factory.mktemp("deep")
    rng = np.random.default_rng(0)
    names = list(_tensors().items())
    weight_map = {}
    for k in range(4):
        part = {n: rng.standard_normal(s, dtype=np.float32) * 0.05 for n, s in names[k::4]}
        save_file(part, directory / f"model-{k}.safetensors", metadata={"format": "pt"})
        weight_map |= dict.fromkeys(part, f"model-{k}.safetensors")
    index = {"metadata": {}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    (directory / "config.json").write_text(json.dumps(CONFIG))
    sizes = [4 * int(np.prod(s)) for _, s in names]
    return directory, max(sizes), sum(sizes)


def _peak(fn) -> tuple[int, object]:
    # Collected first, so the collector's schedule inside `fn` (its cycles held until a pass)
    # is the same whatever ran before in this worker.
    gc.collect()
    tracemalloc.start()
    try:
        result = fn()
        return tracemalloc.get_traced_memory()[1], result
    finally:
        tracemalloc.stop()


def _bound(largest: int) -> int:
    """What an import may hold: a few tensors' worth (one of our per-layer expert stacks is
    E x one HF expert tensor, here as big as the embedding) plus a fixed cost (JAX's tracing
    of the few per-layer programs, Orbax's metadata)."""
    return 4 * largest + (4 << 20)


def test_import_memory_is_bounded_by_the_largest_tensor(deep, tmp_path, monkeypatch):
    directory, largest, total = deep
    # Every stacked parameter placed layer by layer, as a released model's all are.
    monkeypatch.setattr(stream_mod, "STACK_PIECE_BYTES", 0)
    assert total > 3 * _bound(largest)  # so that a whole-model buffer would fail the bound
    load_hf(directory)  # compile the per-layer programs first: their tracing is not memory
    peak, (_, model) = _peak(lambda: load_hf(directory))
    assert peak < _bound(largest), (peak, largest, total)

    # 8 simulated devices, fsdp 8: each builds its own shards; equal to the one-device import.
    cfg = load_config(None, ["mesh.fsdp=8"])
    mesh = make_mesh(cfg)
    abstract = nnx.state(nnx.eval_shape(lambda: model), nnx.Param)
    flat = nnx.to_flat_state(state_shardings(abstract, mesh, LOGICAL_RULES))
    shardings = {p: s.get_value() for p, s in flat}
    load_hf(directory, shardings=shardings)
    peak, (_, sharded) = _peak(lambda: load_hf(directory, shardings=shardings))
    assert peak < _bound(largest), (peak, largest, total)
    embed = sharded.embed.embedding[...]
    assert len(embed.sharding.device_set) == 8 and embed.sharding.spec != (None, None)
    one, eight = params_of(model), params_of(sharded)
    for path in one:
        np.testing.assert_array_equal(one[path], eight[path], str(path))

    # Into a run directory: written chunk by chunk; it loads to the same params.
    out = tmp_path / "run"
    args = ["import", str(directory), "--out", str(out), "data.embedded_max_bytes=20000"]
    interop(args)  # the first import pays for Orbax's imports and first-use setup
    shutil.rmtree(out)
    peak, code = _peak(lambda: interop(args))
    assert code == 0 and peak < _bound(largest), (peak, largest, total)
    run = params_of(load_run(out)[1])
    for path in one:
        np.testing.assert_array_equal(one[path], run[path], str(path))

    # And out again, one tensor at a time: the same tensors as the source.
    export = ["export", str(out), "--out", str(tmp_path / "hf")]
    peak, code = _peak(lambda: interop(export))
    assert code == 0 and peak < _bound(largest), (peak, largest, total)
    back = TensorReader(tmp_path / "hf")
    source = TensorReader(directory)
    assert back.names() == source.names()
    for name in source.names():
        np.testing.assert_array_equal(back.get(name), source.get(name), name)


def test_a_run_s_params_are_read_in_turn_as_an_hf_directory_s(deep, tmp_path, monkeypatch):
    """`sample.py --run RUN sample.weights=bfloat16` of an import peaked at 2.2x its bf16
    weights where its HF directory peaked at 1.18x: Orbax's restore reads every array at
    once, each through a host buffer alive until its device copy runs. The run's float params
    are read as the HF directory's are, one at a time: traced host memory (the read arrays)
    bounded by the largest tensor as the import's; the values those of the float32 params,
    cast to bf16 (round to nearest even, as Orbax casts: exactly equal)."""
    directory, largest, total = deep
    monkeypatch.setattr(stream_mod, "STACK_PIECE_BYTES", 0)  # as a released model's stacks
    out = tmp_path / "run"
    assert interop(["import", str(directory), "--out", str(out)]) == 0
    load_run(out, weights="bfloat16")  # first use: the cast and placement programs' tracing
    peak, (_, model, _) = _peak(lambda: load_run(out, weights="bfloat16"))
    assert peak < _bound(largest), (peak, largest, total)
    assert model.embed.embedding[...].dtype == ml_dtypes.bfloat16
    f32 = params_of(load_run(out)[1])
    for path, value in params_of(model).items():  # (norms and router stay float32)
        np.testing.assert_array_equal(value, f32[path].astype(value.dtype), str(path))


@pytest.fixture(scope="module")
def bf16(tmp_path_factory):
    """(HF directory of a bf16 Llama with the byte tokenizer's vocabulary, its import)."""
    root = tmp_path_factory.mktemp("bf16")
    hf_model("qwen3_moe", seed=4, vocab_size=256).to(torch.bfloat16).save_pretrained(root / "hf")
    run_args = [
        "train.batch_size=2", "train.seq_len=16", "train.warmup_steps=1", "train.steps=1",
        "train.eval_batches=1", "train.peak_flops=1e12", "data.embedded_max_bytes=20000",
        "checkpoint.async_save=false",
    ]  # fmt: skip
    assert interop(["import", str(root / "hf"), "--out", str(root / "run"), *run_args]) == 0
    return root / "hf", root / "run"


def test_the_import_keeps_bf16_and_is_params_only(bf16, tmp_path):
    hf_dir, run = bf16
    step = run / "checkpoints" / "0"
    assert sorted(p.name for p in step.iterdir() if p.is_dir()) == ["meta", "params"]
    zarray = json.loads((step / "params" / "embed.embedding.value" / ".zarray").read_text())
    assert zarray["dtype"] == "bfloat16"
    cfg, model, _ = load_run(run, weights="bfloat16")
    assert model.embed.embedding[...].dtype == ml_dtypes.bfloat16
    # exported in bf16 (the run's params' dtype), bit for bit the original tensors
    assert interop(["export", str(run), "--out", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    source = load_file(hf_dir / "model.safetensors")
    back = load_file(tmp_path / "hf" / "model.safetensors")
    assert back.keys() == source.keys()
    for name, tensor in source.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(back[name], tensor), name


@pytest.mark.parametrize("lost", ["chunk", "metadata"])
def test_an_import_missing_an_array_s_file_is_damage_naming_it(bf16, tmp_path, capsys, lost):
    """An import's arrays are plain zarr, every chunk written: a chunk gone once read as
    zeros (the fill value) when its params were read in turn, and exported as zeros, where
    Orbax's restore refused it; its .zarray gone, export ended in a traceback. Both are
    damage naming the array, in one line, for sampling and export alike."""
    _, run = bf16
    bad = tmp_path / "run"
    shutil.copytree(run, bad)
    array = bad / "checkpoints" / "0" / "params" / "embed.embedding.value"
    for f in array.iterdir():
        if f.name[0].isdigit() == (lost == "chunk"):
            f.unlink()
    says = r"is damaged: array 'embed.embedding' of its params cannot be read \(NOT_FOUND\)"
    with pytest.raises(RunError, match=says):
        load_run(bad, weights="bfloat16")
    capsys.readouterr()
    assert interop(["export", str(bad), "--out", str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert re.match("error: checkpoint 0 in .* " + says, err) and err.count("\n") == 1, err
    assert not (tmp_path / "hf").exists()


def test_sample_from_the_hf_directory_equals_sampling_the_import(bf16, capsys):
    hf_dir, run = bf16
    sample = runpy.run_path(str(ROOT / "sample.py"))["main"]
    flags = ["--prompt", "To be", "--temperature", "0", "--max-new-tokens", "6"]
    outputs = []
    for where in (run, hf_dir):
        capsys.readouterr()
        assert sample(["--run", str(where), *flags, "--num-samples", "1"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and outputs[0].startswith("To be")


def test_init_from_the_hf_directory_takes_the_import_s_first_step(bf16, tmp_path):
    hf_dir, run = bf16
    results = {}
    for name, source in (("run", run), ("hf", hf_dir)):
        cfg = load_config(
            run / "config.yaml", [f"run_dir={tmp_path / name}", f"init_from={source}"]
        )
        train(cfg)
        results[name] = params_of(load_run(tmp_path / name)[1])
    start = params_of(load_run(run)[1])
    assert any(not np.array_equal(v, start[p]) for p, v in results["hf"].items())  # it trained
    for path, value in results["run"].items():
        np.testing.assert_array_equal(value, results["hf"][path], str(path))


def test_quantize_from_the_hf_directory_equals_quantizing_the_import(bf16, tmp_path):
    from moe_jax.quantize import quantize_run

    hf_dir, run = bf16
    quantize_run(hf_dir, tmp_path / "from_hf")
    quantize_run(run, tmp_path / "from_run")
    a, b = (params_of(load_run(tmp_path / n)[1]) for n in ("from_hf", "from_run"))
    assert a.keys() == b.keys()
    for path, value in a.items():
        np.testing.assert_array_equal(value, b[path], str(path))


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    hf = tmp_path_factory.mktemp("sharded") / "hf"
    hf_model("llama", vocab_size=256).save_pretrained(hf, max_shard_size="60KB")
    return hf


def _damaged(hf: Path, tmp_path: Path, how: str) -> tuple[Path, str, set[str]]:
    """A copy of the sharded checkpoint `hf` damaged `how`: (its dir, the file the error must
    name, the tensors it may name: those of that file, or the one changed)."""
    bad = tmp_path / how
    shutil.copytree(hf, bad)
    index = json.loads((bad / "model.safetensors.index.json").read_text())
    name, fname = sorted(index["weight_map"].items())[-1]
    path = bad / fname
    if how == "truncated":  # the file's last tensor loses its last bytes
        name = max(load_file(path), key=lambda n: TensorReader(bad).raw(n).offset)
        path.write_bytes(path.read_bytes()[:-7])
    elif how == "missing_shard":
        path.unlink()
        return bad, fname, {n for n, f in index["weight_map"].items() if f == fname}
    elif how == "index_names_missing_file":
        index["weight_map"][name] = fname = "model-99999-of-99999.safetensors"
        (bad / "model.safetensors.index.json").write_text(json.dumps(index))
    else:  # wrong shape / unreadable dtype: the tensor rewritten
        tensors = load_file(path)
        tensors[name] = torch.zeros(3, 5) if how == "wrong_shape" else tensors[name].to(torch.int32)
        save_torch(tensors, path, metadata={"format": "pt"})
    return bad, fname, {name}


@pytest.mark.parametrize(
    "how", ["truncated", "missing_shard", "index_names_missing_file", "wrong_shape", "bad_dtype"]
)
def test_bad_checkpoints_are_one_line_naming_file_and_tensor(sharded, tmp_path, capsys, how):
    """import and sample.py --run: exit 2, one line naming the file and the tensor, nothing
    written."""
    bad, fname, names = _damaged(sharded, tmp_path, how)
    for argv in (["import", str(bad), "--out", str(tmp_path / "run")],):
        capsys.readouterr()
        assert interop(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.count("\n") == 1, err
        assert fname in err and any(f"'{n}'" in err for n in names), err
        assert not (tmp_path / "run").exists()
    sample = runpy.run_path(str(ROOT / "sample.py"))["main"]
    assert sample(["--run", str(bad), "--prompt", "x", "--max-new-tokens", "1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1, err
    assert fname in err and any(f"'{n}'" in err for n in names), err


TWO_PROCESSES = """
import json, sys
import jax
jax.config.update("jax_cpu_collectives_implementation", "gloo")
jax.distributed.initialize(coordinator_address=sys.argv[1], num_processes=2,
                           process_id=int(sys.argv[2]))
from flax import nnx
import numpy as np
from moe_jax.config import load_config
from moe_jax.interop import load_hf, stream
from moe_jax.sharding import LOGICAL_RULES, make_mesh, state_shardings

fills = []
real = stream.ImportPlan.fill
stream.ImportPlan.fill = lambda self, p, i: fills.append([str(p), repr(i)]) or real(self, p, i)
mesh = make_mesh(load_config(None, ["mesh.fsdp=4"]))
cfg, abstract = load_hf(sys.argv[3], device=jax.local_devices()[0])
state = nnx.state(nnx.eval_shape(lambda: abstract), nnx.Param)
flat = nnx.to_flat_state(state_shardings(state, mesh, LOGICAL_RULES))
fills.clear()
_, model = load_hf(sys.argv[3], shardings={p: s.get_value() for p, s in flat})
shards = {}
for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
    for s in v[...].addressable_shards:
        shards.setdefault(str(path), []).append([repr(s.index), np.asarray(s.data).tolist()])
print(json.dumps({"fills": fills, "shards": shards}))
"""


def test_two_processes_each_read_the_slices_their_devices_hold(sharded, tmp_path):
    """2 processes x 2 CPU devices, one fsdp=4 mesh: each process builds (reads) only the
    shards of its own devices, and they hold the one-process import's values."""
    import os
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        address = f"127.0.0.1:{s.getsockname()[1]}"
    env = os.environ | {"XLA_FLAGS": "--xla_force_host_platform_device_count=2"}
    # Output to files: two pipes read one after the other would block the process not read
    # yet, and the other waits for it at shutdown.
    logs = [(tmp_path / f"out{i}", tmp_path / f"err{i}") for i in range(2)]
    procs = []
    for i, (out, err) in enumerate(logs):
        with open(out, "w") as o, open(err, "w") as e:
            args = [sys.executable, "-c", TWO_PROCESSES, address, str(i), str(sharded)]
            procs.append(subprocess.Popen(args, cwd=ROOT, env=env, stdout=o, stderr=e))
    for p in procs:
        p.wait(timeout=240)
    assert all(p.returncode == 0 for p in procs), [e.read_text()[-2000:] for _, e in logs]
    results = [json.loads(o.read_text().strip().splitlines()[-1]) for o, _ in logs]
    _, model = load_hf(sharded)
    ref = {str(p): v for p, v in params_of(model).items()}
    embed = str(("embed", "embedding"))
    for mine, other in (results, results[::-1]):
        # each process's fills of the embedding are its own two shards, not the other's
        own = {i for p, i in mine["fills"] if p == embed}
        assert len(own) == 2 and own.isdisjoint(i for p, i in other["fills"] if p == embed)
        for path, shards in mine["shards"].items():
            for index, values in shards:
                np.testing.assert_array_equal(np.asarray(values), ref[path][eval(index)], path)


def test_mxfp4_experts_are_taken_packed_from_a_gpt_oss_directory(tmp_path):
    """sample.weights=mxfp4 from a gpt-oss directory as released (experts MXFP4): the experts
    stay packed (the checkpoint's own codes and scales, re-laid: the values of decoding them
    and packing again, though a code may differ where a block's scale could be smaller)."""
    from moe_jax.inference.weights import to_kind
    from moe_jax.model.int8 import Mxfp4Param

    model = hf_model("gpt_oss", seed=3)
    (tmp_path / "hf").mkdir()
    tensors = gpt_oss_as_released(model)
    save_file(tensors, str(tmp_path / "hf" / "model.safetensors"))
    config = model.config.to_dict() | {"quantization_config": {"quant_method": "mxfp4"}}
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config))

    packed = load_run(tmp_path / "hf", weights="mxfp4")[1]
    repacked = to_kind(load_run(tmp_path / "hf", weights="float32")[1], "mxfp4")
    want = dict(nnx.to_flat_state(nnx.state(repacked, nnx.Param)))
    got = dict(nnx.to_flat_state(nnx.state(packed, nnx.Param)))
    assert got.keys() == want.keys()
    for path, var in want.items():
        assert isinstance(got[path], Mxfp4Param) == isinstance(var, Mxfp4Param), path
        np.testing.assert_array_equal(got[path][...], var[...], str(path))  # decoded values
    assert sum(isinstance(v, Mxfp4Param) for v in got.values()) >= 3  # w_gate, w_up, w_down
    w_down = got[("blocks", "layers", 0, "ffn", "experts", "w_down")].get_raw_value()["blocks"]
    stored = tensors["model.layers.0.mlp.experts.down_proj_blocks"]  # [E, D, F / 32, 16]
    np.testing.assert_array_equal(np.asarray(w_down)[0], stored.transpose(0, 2, 3, 1))


# ----------------------------------------------------------------------------- mixed dtypes


@pytest.fixture(scope="module")
def mixed(tmp_path_factory):
    """(HF directory, its import) of a tiny GLM-4.5-shaped checkpoint released as GLM-4.5,
    DeepSeek-V3 and Kimi K2 are: bf16, but the routers' e_score_correction_bias float32."""
    from moe_jax.interop import save_hf
    from moe_jax.interop.safetensors_io import ShardWriter
    from tests.helpers import tiny_config
    from tests.test_interop import random_model

    root = tmp_path_factory.mktemp("mixed")
    cfg = tiny_config(
        "model.n_layers=2", "attention.nope_interval=0", "attention.temperature_tuning=false",
        "attention.partial_rotary_factor=0.5", "moe.score=sigmoid", "moe.correction_bias=true",
        "moe.shared_expert_hidden=40", "moe.interleave_step=1", "moe.first_dense_layers=1",
    )  # fmt: skip
    save_hf(cfg, random_model(cfg, seed=3), root / "f32")
    f32, hf = TensorReader(root / "f32"), root / "hf"
    hf.mkdir()
    writer = ShardWriter(hf, 1 << 40, ml_dtypes.bfloat16)
    for name in f32.names():
        writer.add(name, f32.get(name), np.float32 if name.endswith("correction_bias") else None)
    writer.close()
    (hf / "config.json").write_bytes((root / "f32" / "config.json").read_bytes())
    assert interop(["import", str(hf), "--out", str(root / "run")]) == 0
    return hf, root / "run"


def _assert_written_as(out: Path, source: Path) -> None:
    """`out`'s tensors bit for bit `source`'s: the correction biases float32, the rest bf16."""
    back, source = TensorReader(out), TensorReader(source)
    assert back.names() == source.names()
    biases = [n for n in source.names() if n.endswith("e_score_correction_bias")]
    assert biases
    for name in source.names():
        want = "F32" if name in biases else "BF16"
        assert (back.dtype(name), source.dtype(name)) == (want, want), name
        np.testing.assert_array_equal(back.get(name), source.get(name), name)


def test_export_writes_each_tensor_in_its_own_dtype(mixed, tmp_path):
    """A bf16 import keeps the float32 correction biases; the export writes them float32 as
    the source has them (it once wrote every tensor in the params' majority dtype, bf16)."""
    hf_dir, run = mixed
    assert interop(["export", str(run), "--out", str(tmp_path / "hf")]) == 0
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    _assert_written_as(tmp_path / "hf", hf_dir)


def test_export_hf_in_bf16_keeps_the_float32_params(mixed, tmp_path):
    """checkpoint.export_hf of a bf16 run (`hf_exports.export`, asking for bfloat16): every
    tensor bf16 but the params the model keeps float32 (`moe.FLOAT32_PARAMS`)."""
    from moe_jax.train import hf_exports
    from tests.helpers import tiny_config

    hf_dir, run = mixed
    cfg = tiny_config(f"run_dir={run}", "model.dtype=bfloat16")
    out = hf_exports.export(cfg, step=0)
    _assert_written_as(out, hf_dir)


@pytest.mark.parametrize("bad", [np.nan, np.inf])
def test_a_non_finite_weight_is_refused_by_name_unless_allowed(mixed, tmp_path, capsys, bad):
    """One NaN / inf in one tensor (the fixture's checkpoint rewritten): the import names the
    tensor in one line and writes nothing (it once imported it silently); with
    --allow-nonfinite it is imported as it is."""
    from moe_jax.interop.safetensors_io import ShardWriter

    hf_dir, _ = mixed
    source, poisoned, name = TensorReader(hf_dir), tmp_path / "hf", None
    poisoned.mkdir()
    writer = ShardWriter(poisoned, 1 << 40, ml_dtypes.bfloat16)
    for n in source.names():
        tensor = np.array(source.get(n))
        if n.endswith("layers.1.mlp.shared_experts.up_proj.weight"):
            tensor[2, 3], name = bad, n
        writer.add(n, tensor, tensor.dtype)
    writer.close()
    (poisoned / "config.json").write_bytes((hf_dir / "config.json").read_bytes())
    assert name is not None
    capsys.readouterr()
    assert interop(["import", str(poisoned), "--out", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: tensor '{name}' in '{poisoned}") and "NaN or inf" in err, err
    assert "--allow-nonfinite" in err and err.count("\n") == 1, err
    assert not (tmp_path / "run").exists()
    run = tmp_path / "allowed"
    assert interop(["import", str(poisoned), "--out", str(run), "--allow-nonfinite"]) == 0
