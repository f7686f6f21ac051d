"""Peak host memory of importing (and exporting) a released-size MoE checkpoint, by depth.

    python benchmarks/hf_import_memory.py [--layers 1 4 12] [--dir /tmp] [--export] [--sample]

Writes a Qwen3-30B-A3B-width checkpoint (d 2048, 32 heads / 4 KV of 128, 128 experts of 768,
vocab 151936: the released tensor names and shapes) with N layers of random bf16 values to a
temporary directory, in ~4 GB shards with an index as `save_pretrained` writes them, then
runs `python -m moe_jax.interop import` (and with --export, `export` of that run; with
--sample, `sample.py --run HF_DIR sample.weights=bfloat16` for two tokens, and the same
load without sampling, `load_sampler` alone, then both again of the imported run directory,
`--run RUN`) in a subprocess of its own and reports each one's peak RSS (the kernel's
high-water mark, file pages of the memory maps included; the sampling columns also as a
multiple of the weights' bytes) and wall time, next to the time of reading the files once
(`cat > /dev/null`). Each file is dropped from the page cache first (posix_fadvise), so all
of them read from disk. A depth whose checkpoint, and its import, do not fit on the disk
with 8 GB to spare is skipped, saying so.

`--compiled` instead compiles the sampler of each depth on abstract bf16 weights (nothing
written or read: seconds, any depth) and prints its program's temporaries
(`memory_analysis()`): what generating adds to the weights.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # this checkout's package (--compiled, --load-only), as sample.py's
D, H, KV, HD, E, F, V = 2048, 32, 4, 128, 128, 768, 151936
SHARD_BYTES = 4 * 10**9
CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "vocab_size": V,
    "hidden_size": D,
    "intermediate_size": 6144,
    "moe_intermediate_size": F,
    "num_attention_heads": H,
    "num_key_value_heads": KV,
    "head_dim": HD,
    "num_experts": E,
    "num_experts_per_tok": 8,
    "norm_topk_prob": True,
    "decoder_sparse_step": 1,
    "mlp_only_layers": [],
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "torch_dtype": "bfloat16",
}


def tensors(n_layers: int):
    """(name, shape) of every tensor, in the order the checkpoint stores them."""
    yield "model.embed_tokens.weight", (V, D)
    for i in range(n_layers):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (D,)
        yield p + "post_attention_layernorm.weight", (D,)
        yield p + "self_attn.q_proj.weight", (H * HD, D)
        yield p + "self_attn.k_proj.weight", (KV * HD, D)
        yield p + "self_attn.v_proj.weight", (KV * HD, D)
        yield p + "self_attn.o_proj.weight", (D, H * HD)
        yield p + "self_attn.q_norm.weight", (HD,)
        yield p + "self_attn.k_norm.weight", (HD,)
        yield p + "mlp.gate.weight", (E, D)
        for e in range(E):
            yield p + f"mlp.experts.{e}.gate_proj.weight", (F, D)
            yield p + f"mlp.experts.{e}.up_proj.weight", (F, D)
            yield p + f"mlp.experts.{e}.down_proj.weight", (D, F)
    yield "model.norm.weight", (D,)
    yield "lm_head.weight", (V, D)


# Random bf16 bit patterns of magnitude ~1e-3..3e-2 with a random sign, cycled through.
_NOISE = (
    np.random.default_rng(0).integers(0x3A80, 0x3CF0, 1 << 23, dtype=np.uint16)
    | (np.random.default_rng(1).integers(0, 2, 1 << 23, dtype=np.uint16) << 15)
).tobytes()


def _write_shard(path: Path, group: list[tuple[str, tuple]]) -> None:
    """One safetensors file of bf16 tensors, written as a stream (no tensor held)."""
    header, offset = {}, 0
    for name, shape in group:
        n = 2 * int(np.prod(shape))
        header[name] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        left, pos = offset, 0
        while left:
            n = min(left, len(_NOISE) - pos)
            f.write(_NOISE[pos : pos + n])
            left, pos = left - n, (pos + n) % len(_NOISE)


def write_checkpoint(directory: Path, n_layers: int) -> int:
    """The checkpoint of `n_layers` layers in `directory`; returns its tensor bytes."""
    directory.mkdir(parents=True)
    groups, size, total = [[]], 0, 0
    for name, shape in tensors(n_layers):
        n = 2 * int(np.prod(shape))
        if groups[-1] and size + n > SHARD_BYTES:
            groups.append([])
            size = 0
        groups[-1].append((name, shape))
        size, total = size + n, total + n
    weight_map = {}
    for i, group in enumerate(groups):
        fname = f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors"
        _write_shard(directory / fname, group)
        weight_map.update(dict.fromkeys((n for n, _ in group), fname))
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    (directory / "config.json").write_text(json.dumps(CONFIG | {"num_hidden_layers": n_layers}))
    return total


def uncache(directory: Path) -> None:
    """Drop the directory's files from the page cache, so the next read comes from disk."""
    for f in directory.rglob("*"):
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd) if os.access(f, os.W_OK) else None
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def measure(cmd: list[str]) -> tuple[float, float, str]:
    """(peak RSS in GiB, wall seconds, last progress line) of running `cmd`, the only child
    this process runs (`--one`), so the children's high-water mark is its own."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    start = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.monotonic() - start
    if done.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr[-3000:]}")
    lines = [ln for ln in done.stderr.splitlines() if ln.startswith(("import:", "export:"))]
    peak_kib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    return peak_kib / 2**20, wall, (lines or [""])[-1]


SAMPLE_OVERRIDES = ["sample.weights=bfloat16"]


def one(kind: str, src: Path, out: Path) -> None:
    """Run one import, export, sample or load and print its peak RSS (`--one`, a process
    each)."""
    cmd = [sys.executable, "-m", "moe_jax.interop", kind, str(src), "--out", str(out)]
    if kind == "import":
        cmd.append("data.tokenizer=byte")
    if kind == "sample":  # bf16 weights, two tokens: of the HF directory or the import
        cmd = [sys.executable, "sample.py", "--run", str(src), "--prompt", "To be"]
        cmd += ["--max-new-tokens", "2", "--num-samples", "1", *SAMPLE_OVERRIDES]
    if kind == "load":  # what sample.py does before it generates
        cmd = [sys.executable, __file__, "--load-only", str(src)]
    rss, wall, line = measure(cmd)
    print(json.dumps({"rss_gib": rss, "wall_s": wall, "progress": line}))


def load_only(src: Path) -> None:
    """`--load-only`: the sampler loaded as sample.py loads it (huge pages, the same
    overrides), and nothing generated: the load's share of sampling's peak RSS."""
    from moe_jax.process_setup import import_jax, reexec_with_hugepages

    reexec_with_hugepages()
    import_jax()
    from moe_jax.inference.load import load_sampler

    load_sampler(str(src), SAMPLE_OVERRIDES)


def compiled(n_layers: int) -> tuple[float, float]:
    """(bf16 weights, temporaries) in GiB of the program `sample` runs at `n_layers`, compiled
    for abstract weights (the HF directory's config: float32 compute, bf16 weights)."""
    import jax
    from flax import nnx

    from moe_jax.config import load_config
    from moe_jax.inference.sampling import Sampler
    from moe_jax.inference.weights import abstract_model

    qwen3 = ROOT / "configs" / "qwen3_30b_a3b.yaml"
    cfg = load_config(qwen3, [f"model.n_layers={n_layers}", "model.dtype=float32"])
    model = abstract_model(cfg, "bfloat16")
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    weights = sum(int(np.prod(a.shape)) * a.dtype.itemsize for a in leaves)
    prompt = list(b"To be")  # as `sample` prompts: one bucket of 16, two new tokens
    program = Sampler(model).lower([prompt], 2, temperature=0.8).compile()
    return weights / 2**30, program.memory_analysis().temp_size_in_bytes / 2**30


def cat_time(directory: Path) -> float:
    uncache(directory)
    files = sorted(str(f) for f in directory.glob("*.safetensors"))
    start = time.monotonic()
    subprocess.run(f"cat {' '.join(files)} > /dev/null", shell=True, check=True)
    return time.monotonic() - start


def run_one(kind: str, src: Path, out: Path) -> dict:
    uncache(src)
    cmd = [sys.executable, __file__, "--one", kind, str(src), str(out)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if done.returncode:
        sys.exit(done.stderr[-3000:])
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str]) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, nargs="+", default=[1, 4, 12])
    p.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()))
    p.add_argument("--export", action="store_true", help="also export each import")
    p.add_argument(
        "--sample", action="store_true", help="also sample.py --run HF_DIR, and --run RUN"
    )
    p.add_argument("--compiled", action="store_true", help="the sampler's temporaries only")
    p.add_argument("--one", nargs=3, help=argparse.SUPPRESS)
    p.add_argument("--load-only", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        return one(args.one[0], Path(args.one[1]), Path(args.one[2]))
    if args.load_only:
        return load_only(args.load_only)
    if args.compiled:
        print("| layers | bf16 weights | sampler's temporaries (compiled) |\n|---|---|---|")
        for n in args.layers:
            weights, temps = compiled(n)
            print(f"| {n} | {weights:.2f} GiB | {temps:.3f} GiB ({temps / weights:.3f}x) |")
        return None
    extra = [name for name, on in (("export", args.export), ("sample", args.sample)) if on]
    sampled = ("HF dir: sampler load", "HF dir: sample", "run: sampler load", "run: sample")
    extra = [n for name in extra for n in (sampled if name == "sample" else (name,))]
    print("| layers | params | safetensors | cat > /dev/null | import: peak RSS, time |"
          + "".join(f" {name}: peak RSS, time |" for name in extra))  # fmt: skip
    print("|---|---|---|---|---|" + "---|" * len(extra))
    for n in args.layers:
        size = 2 * sum(int(np.prod(s)) for _, s in tensors(n))
        free = shutil.disk_usage(args.dir).free
        if free < 2 * size * (1.5 if args.export else 1) + 8 * 10**9:
            print(f"| {n} | skipped: {size / 1e9:.1f} GB checkpoint, {free / 1e9:.0f} GB free |")
            continue
        work = Path(tempfile.mkdtemp(prefix="hf_import_", dir=args.dir))
        try:
            write_checkpoint(work / "hf", n)
            cat = cat_time(work / "hf")
            imp = run_one("import", work / "hf", work / "run")
            row = (
                f"| {n} | {size / 2 / 1e9:.2f} B | {size / 2**30:.1f} GiB | {cat:.1f} s "
                f"| {imp['rss_gib']:.2f} GiB, {imp['wall_s']:.0f} s |"
            )
            if args.export:
                exp = run_one("export", work / "run", work / "export")
                row += f" {exp['rss_gib']:.2f} GiB, {exp['wall_s']:.0f} s |"
            if args.sample:  # the HF directory, then the import of it: the same weights
                for src, kind in itertools.product(("hf", "run"), ("load", "sample")):
                    r = run_one(kind, work / src, work / "unused")
                    times = r["rss_gib"] / (size / 2**30)
                    row += f" {r['rss_gib']:.2f} GiB ({times:.2f}x), {r['wall_s']:.0f} s |"
            print(row, flush=True)
        finally:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
