"""Compile the real train or decode step for a TPU slice or GPU cluster on this CPU, and say
what it needs per device: memory, FLOPs, collectives.

    python -m moe_jax.aot configs/mixtral_8x7b.yaml --topology v5p-128 mesh.fsdp=-1 \
        train.batch_size=64
    python -m moe_jax.aot configs/mixtral_8x7b.yaml --topology h100:8x8 mesh.fsdp=8 \
        mesh.expert=8 --max-batch
    python -m moe_jax.aot configs/qwen3_30b_a3b.yaml --topology h100:1x4 --step decode \
        mesh.fsdp=4

Needs the `aot` extra (libtpu and the jax CUDA plugin, compile-only: `pip install -e '.[aot]'`).
Nothing runs and nothing model-sized is allocated here: the mesh is laid over compile-only
devices (`moe_jax.aot.topology`), the train state is described by shapes and shardings, and the
program compiled is exactly the one `train.py` runs (`train_step.make_train_step`
over `train_step.init_state`), or with `--step decode` the sampler's prefill + decode program
(`sampling.Sampler`) for `sample.batch_size` rows of `sample.prompt_len` prompt tokens and
`sample.max_new_tokens` new ones, with the weights laid out over the mesh like the training
state's (the sampler itself is not yet mesh-aware: its program is partitioned by the compiler
from those layouts).

It prints a table and, last, one JSON line: topology, devices, hbm_bytes_per_device, fits,
per-device bytes {arguments, outputs, aliased, temps, host_temps, peak} (peak is the
compiler's `peak_memory_in_bytes`, which accounts for buffer lifetimes; arguments + temps
overstates it), flops_per_device (matmul FLOPs of the compiled program, loops counted by their
trip counts: `moe_jax.aot.hlo`), model_flops_per_device (the MFU formula's matmuls, attention over
every key, as the compiled program computes it), collectives
{op: {count, bytes}} per step, for a train step weight_collectives_floor (the weights'
all-gather, reduce-scatter and all-reduce bytes its sharding implies: `moe_jax.aot.collectives`),
compile_s. Exit 0: it compiles and fits; 1: it does not fit
(one line says by how much); 2: bad input.

`--max-batch` finds the largest batch that fits: rows per batch shard 1, 2, 4, ... until one
does not fit, then bisection between the last two, printing each probe.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import re
import resource
import sys
import time
from collections.abc import Sequence

from moe_jax.aot.report import GIB, format_report
from moe_jax.config.shipped import config_argv, config_path
from moe_jax.run.door import HelpFormatter, command

MAX_ROWS_PER_SHARD = 1 << 16  # --max-batch stops doubling here


class DoesNotFit(Exception):
    """The program needs more memory per device than the device has."""

    def __init__(self, needed: float | None, hbm: int, kind: str, what: str):
        self.needed, self.hbm, self.kind, self.what = needed, hbm, kind, what
        needs = f"needs {needed / GIB:.1f} GiB" if needed else "needs more memory"
        super().__init__(
            f"does not fit: {needs} per {what}, a {kind} {what} has {hbm / GIB:.2f} GiB"
        )


def quiet(verbose: bool):
    """The compilers' own logs: passed through with --verbose, else held back."""
    from moe_jax.process_setup import held_stderr

    return contextlib.nullcontext() if verbose else held_stderr()


# ----------------------------------------------------------------------------- programs


def lower_train(cfg, mesh):
    """The train step `train.py` runs, lowered for `mesh` from shapes alone."""
    import jax
    import jax.numpy as jnp

    from moe_jax import backends
    from moe_jax.sharding import batch_sharding
    from moe_jax.train.step import init_state, make_optimizer, make_train_step

    # dpo and grpo: their reference; grpo: its updates a step
    tx = make_optimizer(cfg.train, backends.compute_dtype(cfg.model.dtype), cfg.rl)
    graphdef, state = init_state(cfg, tx, abstract=True, mesh=mesh)
    step = make_train_step(cfg, graphdef, tx, jax.tree.map(lambda a: a.sharding, state))
    tokens = jax.ShapeDtypeStruct(
        (cfg.train.batch_size, cfg.train.seq_len + 1), jnp.int32, sharding=batch_sharding(mesh)
    )
    with jax.set_mesh(mesh):
        return step.lower(state, tokens)


def lower_decode(cfg, mesh):
    """The sampler's prefill + decode program for `cfg.sample`, weights laid out over `mesh`."""
    from flax import nnx
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from moe_jax.inference.sampling import Sampler
    from moe_jax.inference.weights import abstract_model, weights_kind
    from moe_jax.sharding import INFERENCE_RULES, state_shardings, with_shardings

    abstract = abstract_model(cfg, weights_kind(cfg))
    graphdef, params = nnx.split(abstract, nnx.Param)
    params = with_shardings(params, state_shardings(params, mesh, INFERENCE_RULES))
    sampler = Sampler(nnx.merge(graphdef, params), mesh=mesh)
    s = cfg.sample
    prompts = [[0] * s.prompt_len] * s.batch_size
    return sampler.lower(
        prompts,
        s.max_new_tokens,
        sharding=NamedSharding(mesh, P()),
        temperature=s.temperature,
        top_k=s.top_k,
        top_p=s.top_p,
    )


# ----------------------------------------------------------------------------- one compile


def _oom_bytes(message: str) -> float | None:
    """What libtpu says the program needs, from its RESOURCE_EXHAUSTED message."""
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    for pattern in (
        r"Used ([\d.]+)([KMGT])i?B? of [\d.]+[KMGT]i?B? hbm",
        r"\(([\d.]+)([KMGT])\) exceeds available HBM",
        r"requires? ([\d.]+)([KMGT])i?B?",
    ):
        m = re.search(pattern, message)
        if m:
            return float(m.group(1)) * units[m.group(2)]
    return None


def _step_mesh(cfg, topo, step: str):
    """The step's mesh over all of `topo`'s devices, the batch split as train.py checks it."""
    from moe_jax.sharding import make_mesh

    mesh = make_mesh(cfg, list(topo.devices), inference=step == "decode")
    if mesh.size != topo.n_devices:
        from moe_jax.config import ConfigError

        raise ConfigError(
            f"the mesh uses {mesh.size} of the {topo.n_devices} devices of {topo.name}; set one "
            "axis to -1 (e.g. mesh.fsdp=-1) to use them all"
        )
    if step == "train":
        from moe_jax.sharding import check_batch_split

        # Each host feeds its own rows: the mesh must put them on its devices (train.py's check).
        check_batch_split(mesh, cfg.train.batch_size, lambda d: d.process_index, topo.n_hosts)
    return mesh


def compiled_program(lower, topo, verbose: bool = False):
    """-> (`lower()` compiled for `topo`'s devices, seconds). Traced for the target's kernels
    (moe_jax/backends.py), not the CPU's. Raises DoesNotFit where the compiler says so."""
    from moe_jax import backends

    what = "chip" if topo.platform == "tpu" else "GPU"
    t0 = time.perf_counter()
    with quiet(verbose), backends.targeting(topo.platform):
        try:
            compiled = lower().compile()
        except Exception as e:
            text = str(e)
            if "RESOURCE_EXHAUSTED" in text or "Ran out of memory" in text:
                raise DoesNotFit(_oom_bytes(text), topo.hbm_bytes, topo.devices[0].device_kind,
                                 what) from None  # fmt: skip
            raise
    return compiled, time.perf_counter() - t0


def program_figures(compiled, cfg, hlo_path: str | None = None, new_tokens=None) -> dict:
    """A compiled program's per-device bytes, matmul FLOPs and collectives (module doc); a
    loop of unknown trip count (the decode loop's) counted at `new_tokens` (default
    sample.max_new_tokens) - 1 iterations."""
    from moe_jax.aot import hlo
    from moe_jax.model import exchange_rounds

    mem = compiled.memory_analysis()
    text = compiled.as_text()
    if hlo_path:
        with open(hlo_path, "w") as f:
            f.write(text)
    analysis = hlo.analyze(
        text,
        unknown_trips=max((new_tokens or cfg.sample.max_new_tokens) - 1, 1),
        scoped_trips={exchange_rounds.ROUND_LOOP_SCOPE: exchange_rounds.ROUND_LOOP_TRIPS},
    )
    return {
        "bytes": {
            "arguments": mem.argument_size_in_bytes,
            "outputs": mem.output_size_in_bytes,
            "aliased": mem.alias_size_in_bytes,
            "temps": mem.temp_size_in_bytes,
            "host_temps": mem.host_temp_size_in_bytes,
            "peak": mem.peak_memory_in_bytes,
        },
        "flops_per_device": analysis.flops,
        "collectives": hlo.collectives_json(analysis.collectives),
        "conditionals": analysis.count("conditional"),
        # kernels whose FLOPs flops_per_device leaves out (no cost estimate: splash attention)
        "uncosted_kernels": analysis.count(hlo.UNCOSTED),
        "loops_of_unknown_trip_count": analysis.unknown_trip_loops,
        "exchange_round_loops": analysis.scoped_loops,  # counted at one round
    }


def compile_step(cfg, topo, step: str, verbose: bool = False, hlo_path: str | None = None):
    """Compile `step` ("train" | "decode") of `cfg` for `topo`. -> report dict; a GRPO
    train step (train.objective=grpo) is its sampler's program and its update's
    (`aot.grpo.compile_grpo`). Raises DoesNotFit, or ConfigError / SamplingError for a config
    the step cannot take."""
    from moe_jax import backends
    from moe_jax.summary.counts import decode_flops, train_flops_per_token

    mesh = _step_mesh(cfg, topo, step)
    if step == "train" and cfg.train.objective == "grpo":
        from moe_jax.aot.grpo import compile_grpo

        def compile_one(lower, new_tokens, name):
            compiled, seconds = compiled_program(lower, topo, verbose)
            path = hlo_path and f"{hlo_path}.{name}"  # --hlo FILE: FILE.sample, FILE.train
            return program_figures(compiled, cfg, path, new_tokens), seconds

        report = compile_grpo(cfg, topo, mesh, compile_one)
        if not report["fits"]:
            what = "chip" if topo.platform == "tpu" else "GPU"
            raise DoesNotFit(report["peak"], topo.hbm_bytes, report["device_kind"], what)
        return report
    kind = topo.devices[0].device_kind
    what = "chip" if topo.platform == "tpu" else "GPU"
    lower = (lambda: lower_train(cfg, mesh)) if step == "train" else lambda: lower_decode(cfg, mesh)
    compiled, compile_s = compiled_program(lower, topo, verbose)
    figures = program_figures(compiled, cfg, hlo_path)
    s = cfg.sample
    if step == "train":
        tokens = cfg.train.batch_size * cfg.train.seq_len
        model_flops = train_flops_per_token(cfg, causal=False) * tokens
        rows = cfg.train.batch_size
    else:
        model_flops = decode_flops(cfg, s.batch_size, s.prompt_len, s.max_new_tokens)
        rows = s.batch_size
    peak = figures["bytes"]["peak"]
    report = {
        "topology": topo.name,
        "step": step,
        "devices": topo.n_devices,
        "device_kind": kind,
        "hosts": topo.n_hosts,
        "mesh": dict(mesh.shape),
        "batch": rows,
        "batch_per_device": rows / topo.n_devices,
        "seq_len": cfg.train.seq_len if step == "train" else s.prompt_len + s.max_new_tokens,
        "hbm_bytes_per_device": topo.hbm_bytes,
        "fits": peak <= topo.hbm_bytes,
        **figures,
        "model_flops_per_device": model_flops / topo.n_devices,
        "compile_s": round(compile_s, 1),
    }
    if step == "train":  # the weights' share of the collectives, as the sharding implies it
        from moe_jax.aot.collectives import weight_collectives

        with backends.targeting(topo.platform):
            dtype = backends.compute_dtype(cfg.model.dtype)
        report["weight_collectives_floor"] = weight_collectives(cfg, dict(mesh.shape), dtype)
    if not report["fits"]:  # the GPU compiler does not check; libtpu would have refused
        raise DoesNotFit(peak, topo.hbm_bytes, kind, what)
    return report


# ----------------------------------------------------------------------------- reports


def _host_peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


# ----------------------------------------------------------------------------- max batch


def _with_batch(cfg, step: str, rows_per_shard: int, n_shards: int):
    if step == "train":
        t = cfg.train
        return dataclasses.replace(
            cfg, train=dataclasses.replace(t, batch_size=rows_per_shard * n_shards * t.grad_accum)
        )
    return dataclasses.replace(
        cfg, sample=dataclasses.replace(cfg.sample, batch_size=rows_per_shard)
    )


def max_batch(
    cfg, topo, step: str, verbose: bool, log, limit: int = MAX_ROWS_PER_SHARD
) -> tuple[dict | None, DoesNotFit | None]:
    """Largest batch that fits: doubling, then bisection. Training batches step by the batch
    shards (data x fsdp x expert, times train.grad_accum); decode batches by one row.
    -> (report of the largest that fits or None, the smallest refusal seen)."""
    from moe_jax.sharding import BATCH_AXES, mesh_shape

    n_shards = 1
    if step == "train":  # the batch shards, whatever batch the config names
        any_batch = dataclasses.replace(cfg.train, batch_size=cfg.train.grad_accum << 20)
        sizes = mesh_shape(dataclasses.replace(cfg, train=any_batch), topo.n_devices)
        n_shards = math.prod(sizes[a] for a in BATCH_AXES)
    best, refusal = None, None
    fits_at, fails_at = 0, None

    def probe(k: int) -> bool:
        nonlocal best, refusal
        probe_cfg = _with_batch(cfg, step, k, n_shards)
        rows = probe_cfg.train.batch_size if step == "train" else k
        try:
            r = compile_step(probe_cfg, topo, step, verbose)
        except DoesNotFit as e:
            refusal = e
            log(f"probe: batch {rows} ({rows / topo.n_devices:g} per device): {e}")
            return False
        best = r
        log(
            f"probe: batch {rows} ({rows / topo.n_devices:g} per device): peak "
            f"{r['bytes']['peak'] / GIB:.2f} GiB, temps {r['bytes']['temps'] / GIB:.2f} GiB: fits "
            f"({r['compile_s']:.0f} s)"
        )
        return True

    k = 1
    while k <= limit:
        if probe(k):
            fits_at, k = k, 2 * k
        else:
            fails_at = k
            break
    if fails_at is None:
        return best, refusal
    while fails_at - fits_at > 1 and fits_at:
        mid = (fits_at + fails_at) // 2
        if probe(mid):
            fits_at = mid
        else:
            fails_at = mid
    if best is not None and fits_at and best["batch"] != _rows(cfg, step, fits_at, n_shards):
        probe(fits_at)  # the report is of the largest that fits
    return (best if fits_at else None), refusal


def _rows(cfg, step, k, n_shards):
    return k * n_shards * cfg.train.grad_accum if step == "train" else k


# ----------------------------------------------------------------------------- CLI


def parse_args(argv: Sequence[str]) -> tuple[argparse.Namespace, str | None, list[str]]:
    p = argparse.ArgumentParser(
        prog="moe-jax aot",
        formatter_class=HelpFormatter,
        description="Compile the train or decode step for a TPU slice or GPU cluster on this "
        "CPU and report per-device memory, FLOPs and collectives.",
        epilog="Exit status: 0 compiles and fits, 1 does not fit, 2 bad input.",
    )
    p.add_argument(
        "config", nargs="?", help="a YAML file or a shipped config's name (default: tiny)"
    )
    p.add_argument("overrides", nargs="*", help="section.key=value config overrides")
    p.add_argument("--topology", required=True, help="e.g. v5p-128, v6e-256, h100:8x8")
    p.add_argument("--step", choices=("train", "decode"), default="train")
    p.add_argument("--max-batch", action="store_true", help="find the largest batch that fits")
    p.add_argument(
        "--max-rows",
        type=int,
        default=MAX_ROWS_PER_SHARD,
        help="--max-batch tries at most this many rows per batch shard",
    )
    p.add_argument(
        "--hlo",
        metavar="FILE",
        help="write the optimised HLO text here (GRPO: FILE.sample, FILE.train)",
    )
    p.add_argument("--verbose", action="store_true", help="pass the compilers' own logs through")
    args = p.parse_intermixed_args(argv)
    items = ([args.config] if args.config else []) + list(args.overrides)
    path = str(config_path("tiny"))
    if items and "=" not in items[0]:
        path, *items = config_argv(items)
    return args, path, items


@command
def main(argv: Sequence[str] | None = None) -> int:
    args, path, overrides = parse_args(sys.argv[1:] if argv is None else argv)
    from moe_jax.config import ConfigError, load_config
    from moe_jax.config.checks import check_inference

    cfg = load_config(path, overrides)
    if args.step == "decode":  # the checks sample.py makes of the same keys
        check_inference(cfg)
        if cfg.sample.speculative:
            raise ConfigError(
                "aot --step decode compiles the plain sampler's program; speculative "
                "decoding (sample.speculative) is not compiled ahead of time: drop it"
            )
    # Compile-only: this machine's CPU is the only device anything runs on (also on a TPU or
    # GPU host). JAX's CUDA plugin offers its compile-only topology only when the CPU is the
    # chosen platform. `python -m` has imported jax quietly already (moe_jax/__init__.py).
    import jax

    jax.config.update("jax_platforms", "cpu")
    with quiet(args.verbose):  # the plugins' start-up logs
        from moe_jax.aot.topology import get_topology

    log = lambda msg: print(msg, flush=True)
    try:
        with quiet(args.verbose):
            topo = get_topology(args.topology, cfg.mesh.slices)
        if args.max_batch and cfg.train.objective == "grpo":
            raise ConfigError(
                "aot --max-batch searches token batches; for train.objective=grpo set "
                "train.batch_size (prompts) and rl.group_size and compile that"
            )
        if args.max_batch:
            report, refusal = max_batch(cfg, topo, args.step, args.verbose, log, args.max_rows)
            if report is None:
                raise refusal or DoesNotFit(None, topo.hbm_bytes, "", "device")
            report["max_batch"] = True
        else:
            report = compile_step(cfg, topo, args.step, args.verbose, args.hlo)
    except DoesNotFit as e:  # an answer, not an error: exit 1 says it (see the module doc)
        print(str(e))
        return 1
    report["host_peak_rss_bytes"] = _host_peak_rss()
    print(format_report(report, path))
    print(json.dumps(report))
    return 0
