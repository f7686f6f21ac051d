"""A GRPO step compiled ahead of time (`python -m moe_jax.aot CONFIG --topology T
train.objective=grpo ...`): the two programs a step runs on one mesh, and a chip's memory
across them.

    report = compile_grpo(cfg, topo, mesh, compile_one)   # compile_one: moe_jax.aot.command's

- "sample": the sampler's recording generate that `rl.collect` runs each step
  (`Sampler.generate(record=True)`): train.batch_size x rl.group_size rows of a prompt bucket
  (`data.windows.bucket(rl.max_prompt_len)`) + rl.max_new_tokens, its weights the copy of the
  train state's params that `rl.collect` lays out for sampling each step (INFERENCE_RULES on
  `sharding.rollout_mesh`: nothing split over fsdp, so the decode loop gathers no weight),
  traced on that mesh as the trainer's loop does;
- "train": the train step on those rollouts (tokens, mask and log-probs [R, S], advantages,
  the recorded experts [R, n_moe_layers, S, K]), its rl.epochs x rl.minibatches updates.

A chip holds the train state throughout: weights and optimizer state (with the KL's frozen
reference where there is one). While sampling it also holds the sampler's copy of the
weights, laid out for sampling (`rl.collect` drops it before the update), and the sampler
program's temporaries (the KV cache among them; its size is reported apart); while
training, the train program (its arguments are the state and the rollouts). So peak =
max(sampler peak (its arguments are the copy) + the train state (weights and optimizer
state), train peak); each of those parts is in the report.

One host's view: the sampler's prompts are one replicated batch, as `aot --step decode`
compiles them; the trainer on several hosts is not there yet (rl.collect's note).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

GIB = 1 << 30


def rollout_shape(cfg) -> tuple[int, int, int]:
    """(rows R, prompt bucket P, new tokens N) of a step's rollouts: rows P + N wide."""
    from moe_jax.config import ConfigError
    from moe_jax.data.windows import bucket

    rl, m = cfg.rl, cfg.model
    if rl.rollout_engine:
        raise ConfigError(
            "aot compiles the sampler's rollouts; rl.rollout_engine=true draws them with the "
            "engine, whose programs it does not compile: set rl.rollout_engine=false"
        )
    if not rl.max_prompt_len:
        raise ConfigError(
            "aot compiles GRPO's rollouts at a fixed width: set rl.max_prompt_len (a prompt's "
            "most tokens, e.g. rl.max_prompt_len=512)"
        )
    limit = m.max_seq_len - rl.max_new_tokens
    return (
        cfg.train.batch_size * rl.group_size,
        bucket(rl.max_prompt_len, limit),
        (rl.max_new_tokens),
    )


def device_bytes(tree) -> int:
    """The bytes one device holds of a tree of abstract arrays laid out by their shardings."""
    total = 0
    for a in jax.tree.leaves(tree):
        shape = a.sharding.shard_shape(a.shape) if a.sharding is not None else a.shape
        total += math.prod(shape) * jnp.dtype(a.dtype).itemsize
    return total


def _sampler(cfg, graphdef, params, mesh):
    """The sampler `rl.collect` builds on the trainer's `mesh` from its copy of the train
    state's params laid out for sampling (abstract here)."""
    from moe_jax.inference.sampling import Sampler
    from moe_jax.sharding import INFERENCE_RULES, rollout_mesh, state_shardings, with_shardings

    sampling = rollout_mesh(mesh)
    laid = with_shardings(params, state_shardings(params, sampling, INFERENCE_RULES))
    return Sampler(nnx.merge(graphdef, laid), mesh=sampling)


def lower_sample(cfg, sampler, mesh=None):
    """The recording generate of a step's rollouts on `mesh` (default the sampler's), lowered.
    `Sampler.lower` takes no `record`, so its call is spelled out: the same inputs and
    program generate() makes."""
    mesh = mesh or sampler.mesh
    R, P_, N = rollout_shape(cfg)
    V = cfg.model.vocab_size
    request, program = sampler._inputs(
        [[0] * P_] * R, N, temperature=cfg.rl.temperature, stop_tokens=[0], vocab_size=V
    )
    replicated = NamedSharding(mesh, P())
    request = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=replicated),
                           request)  # fmt: skip
    with jax.set_mesh(mesh):
        return sampler.compiled.lower(sampler._weights(), request, program=program._replace(
            record=True))  # fmt: skip


def rollouts_abstract(cfg, mesh) -> dict:
    """The train step's batch of rollouts (`rl.grpo`'s module doc), rows over the batch axes."""
    from moe_jax.sharding import batch_sharding

    R, P_, N = rollout_shape(cfg)
    S, rows = P_ + N, batch_sharding(mesh)
    L = sum(cfg.is_moe(i) for i in range(cfg.model.n_layers))
    one = lambda shape, dtype: jax.ShapeDtypeStruct(shape, dtype, sharding=rows)
    batch = {
        "tokens": one((R, S), jnp.int32), "mask": one((R, S), jnp.float32),
        "old_logp": one((R, S), jnp.float32), "adv": one((R,), jnp.float32),
        "rewards": one((R,), jnp.float32), "routes": one((R, L, S, cfg.moe.top_k), jnp.int32),
    }  # fmt: skip
    if cfg.rl.dynamic_sampling:  # the rows of the groups kept (`rl.collect.informative`)
        batch["keep"] = one((R,), jnp.float32)
    return batch


def kv_cache_bytes(cfg, mesh, model) -> int:
    """A chip's bytes of the sampler's KV cache for a step's rollouts, laid out as the
    sampler lays it out (`decoding.shard_cache`, compiled for the mesh to read it back)."""
    from moe_jax.inference.decoding import shard_cache

    R, P_, N = rollout_shape(cfg)
    make = jax.jit(lambda: shard_cache(model.init_cache(R, P_ + N)))
    with jax.set_mesh(mesh):
        lowered = make.lower()
    shapes = jax.eval_shape(lambda: model.init_cache(R, P_ + N))
    shardings = lowered.compile().output_shardings
    laid = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s),
                        shapes, shardings)  # fmt: skip
    return device_bytes(laid)


def compile_grpo(cfg, topo, mesh, compile_one) -> dict:
    """Both programs of a GRPO step compiled for `topo` on `mesh` -> the report (module doc),
    whose "fits" says whether the chip's peak across them fits. `compile_one(lower,
    new_tokens, name)` -> (the program's figures, compile seconds): `moe_jax.aot`'s, passed in so
    that this module does not import the one that imports it."""
    from moe_jax import backends
    from moe_jax.train.step import init_state, make_optimizer, make_train_step

    R, P_, N = rollout_shape(cfg)
    with backends.targeting(topo.platform):
        tx = make_optimizer(cfg.train, backends.compute_dtype(cfg.model.dtype), cfg.rl)
        graphdef, state = init_state(cfg, tx, abstract=True, mesh=mesh)
        sampler = _sampler(cfg, graphdef, state["params"], mesh)
        kv = kv_cache_bytes(cfg, sampler.mesh, nnx.merge(graphdef, state["params"]))
    step = make_train_step(cfg, graphdef, tx, jax.tree.map(lambda a: a.sharding, state))

    def lower_train():
        with jax.set_mesh(mesh):
            return step.lower(state, rollouts_abstract(cfg, mesh))

    programs, seconds = {}, 0.0
    for name, lower in (("sample", lambda: lower_sample(cfg, sampler)),
                        ("train", lower_train)):  # fmt: skip
        figures, s = compile_one(lower, new_tokens=N, name=name)  # the decode loop's trips
        programs[name] = figures | {"compile_s": round(s, 1)}
        seconds += s
    resident = {
        "weights": device_bytes(state["params"]),
        "optimizer_state": device_bytes(state["opt_state"]),
        "sampler_copy": device_bytes(sampler._weights()),
        "kv_cache": kv,
    }
    sampling = (
        programs["sample"]["bytes"]["peak"] + resident["weights"] + resident["optimizer_state"]
    )
    training = programs["train"]["bytes"]["peak"]
    peak = max(sampling, training)
    kind = topo.devices[0].device_kind
    report = {
        "topology": topo.name, "step": "grpo", "devices": topo.n_devices, "device_kind": kind,
        "hosts": topo.n_hosts, "mesh": dict(mesh.shape), "prompts": cfg.train.batch_size,
        "rollouts": R, "prompt_bucket": P_, "max_new_tokens": N,
        "updates": cfg.rl.updates, "hbm_bytes_per_device": topo.hbm_bytes,
        "programs": programs, "resident": resident,
        "peak_sampling": sampling, "peak_training": training, "peak": peak,
        "fits": peak <= topo.hbm_bytes, "compile_s": round(seconds, 1),
    }  # fmt: skip
    return report


def format_grpo(r: dict, config_name: str) -> str:
    """The report as `aot` prints it (GiB a device)."""
    g = lambda n: f"{n / GIB:8.2f}"
    mesh = " x ".join(f"{k} {v}" for k, v in r["mesh"].items())
    lines = [
        f"{config_name}: GRPO step on {r['topology']} ({r['devices']} x {r['device_kind']}, "
        f"{r['hosts']} host(s)), compiled in {r['compile_s']:.1f} s",
        f"mesh {mesh}; {r['prompts']} prompts x {r['rollouts'] // r['prompts']} samples = "
        f"{r['rollouts']} rollouts of {r['prompt_bucket']} + {r['max_new_tokens']} tokens; "
        f"{r['updates']} update(s) a step",
        "",
        "per device              sample     train   (GiB)",
    ]
    for key in ("arguments", "outputs", "aliased", "temps", "peak"):
        s, t = r["programs"]["sample"]["bytes"][key], r["programs"]["train"]["bytes"][key]
        lines.append(f"  {key:<18}{g(s)}  {g(t)}")
    res = r["resident"]
    lines += [
        "",
        f"  weights {g(res['weights'])}, optimizer state {g(res['optimizer_state'])}, sampler's "
        f"copy {g(res['sampler_copy'])} (in its arguments), KV cache {g(res['kv_cache'])} "
        "(in its temps)",
        f"  peak while sampling {g(r['peak_sampling'])}, while training {g(r['peak_training'])}: "
        f"{g(r['peak'])} of {r['hbm_bytes_per_device'] / GIB:.2f} HBM: "
        + ("fits" if r["fits"] else "does not fit"),
    ]
    return "\n".join(lines)
