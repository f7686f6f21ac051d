"""The decode loop that both samplers run (`moe_jax.inference.sampling`: a token a step;
`moe_jax.inference.speculative`: drafts checked a step), once: the request as one value, the model
called with its layer blocks kept apart, each row's key, the stop test, streaming, and the
while loop. A sampler gives its prefill (the loop's first carry) and its step.

    d = Decoding.start(graphdef, emit_host, weights, request, program)
    carry = loop(d, my_prefill(d), lambda c: my_step(d, c))

The carry is a dict with at least "it" (the loop's iteration, from 1) and "done" [B] (rows
finished); the loop runs while it < max_new_tokens and a row is unfinished, so a step that
emits at least one token of every unfinished row ends it within max_new_tokens - 1 steps.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from moe_jax.inference.next_token import Mode
from moe_jax.sharding import split_batch_axes


class Weights(NamedTuple):
    """The sampler's params without the stacked layer blocks, and those blocks one by one
    (`unstack_blocks`)."""

    params: object
    blocks: list


class Request(NamedTuple):
    """One generation's traced values: changing them does not recompile."""

    prompt_BP: jax.Array  # int32 [B, P]: the prompts, right-padded to the bucket
    prompt_len_B: jax.Array  # int32 [B]
    stop_S: jax.Array  # int32 [S]: stop ids, padded with -1 (never sampled)
    key: jax.Array  # the seed's PRNG key
    temperature: jax.Array  # float32 (1 where greedy)
    top_k: jax.Array  # int32 (>= V: off)
    top_p: jax.Array  # float32
    n_vocab: jax.Array  # int32: sample ids below it only


class Program(NamedTuple):
    """One generation's static values: one compiled program each."""

    max_new_tokens: int
    mode: Mode  # greedy, or which filters run
    stream: bool = False  # call the host back with every step's tokens
    record: bool = False  # keep each token's experts and each sampled token's log-prob


@dataclasses.dataclass(frozen=True)
class Decoding:
    """What a decode program works with (inside it: traced values)."""

    graphdef: object
    weights: Weights
    request: Request
    program: Program
    emit_host: Callable
    row_keys_B: jax.Array  # each row's key: fold_in(seed, row)

    @classmethod
    def start(cls, graphdef, emit_host, weights: Weights, request: Request, program: Program):
        B = request.prompt_BP.shape[0]
        row_keys_B = jax.vmap(lambda r: jax.random.fold_in(request.key, r))(jnp.arange(B))
        return cls(graphdef, weights, request, program, emit_host, row_keys_B)

    @property
    def N(self) -> int:
        return self.program.max_new_tokens

    def model(self):
        return model_of(self.graphdef, self.weights.params, self.weights.blocks)

    def unstacked(self, cache: dict) -> dict:
        """A cache as the loop carries it: sharded, its layer blocks apart."""
        cache = shard_cache(cache)
        return cache | {"blocks": unstack_blocks(cache["blocks"], len(self.weights.blocks))}

    def forward(self, tokens_BT, positions_BT, cache: dict, *, with_aux=False, **kw):
        """The model over the carried cache -> (its first output, the new carried cache),
        and with `with_aux` the model's aux (its "routes": the experts the tokens took)."""
        stacked = cache | {"blocks": stack_blocks(cache["blocks"])}
        out, aux, new = self.model()(tokens_BT, positions=positions_BT, cache=stacked, **kw)
        return (out, self.unstacked(new)) + ((aux,) if with_aux else ())

    def prompt_positions(self) -> jax.Array:
        """[B, P]: a prompt's positions, its padding at -1 (written to no sliding-window
        ring; other slots it writes are rewritten before any query reads them)."""
        r = self.request
        arange_P = jnp.arange(r.prompt_BP.shape[1], dtype=jnp.int32)
        return jnp.where(arange_P[None, :] < r.prompt_len_B[:, None], arange_P[None, :], -1)

    def is_stop(self, tokens) -> jax.Array:
        """Whether each token (of any shape) is a stop token."""
        return jnp.any(tokens[..., None] == self.request.stop_S, axis=-1)

    def emit(self, step, tok_B) -> None:
        """Stream one step's tokens [B] to the host (ordered on one device only: under a mesh
        the host puts the steps back in order)."""
        if self.program.stream:
            one_device = jax.sharding.get_abstract_mesh().empty
            jax.debug.callback(self.emit_host, step, tok_B, ordered=one_device)


def loop(d: Decoding, init: dict, step: Callable[[dict], dict]) -> dict:
    """`step` from `init` while it < max_new_tokens and a row is unfinished (module doc)."""
    cond = lambda c: (c["it"] < d.N) & ~jnp.all(c["done"])
    return jax.lax.while_loop(cond, step, init)


# ----------------------------------------------------------------------------- layer blocks


def unstack_blocks(tree, n: int, consume: bool = False) -> list:
    """Stacked layer blocks [n, ...] -> n per-block trees; `consume`: delete each stacked
    array once split, so that at most one weight is held twice at a time.

    The model slices block b out of each stacked weight and cache array. XLA does not hoist
    loop-invariant slices out of a while loop (it deems them too cheap to move), and on CPU a
    slice is a copy, so inside the decode loop every step would copy every weight. So the
    sampler keeps the blocks apart (the params split once, the cache carried split) and
    re-stacks them at each model call: slice(stack(...)) folds back to the block itself at
    compile time, and no copy is left.
    """
    leaves, treedef = jax.tree.flatten(tree)
    per_leaf = []
    for a in leaves:
        per_leaf.append([_block(a, b) for b in range(n)])
        if consume:
            a.delete()
    return [jax.tree.unflatten(treedef, [parts[b] for parts in per_leaf]) for b in range(n)]


def _block(a, b: int):
    """Block b of a stacked array; of an abstract one (compiling for other devices, see
    `moe_jax.aot.command`), its shape and the sharding of its other axes."""
    if not isinstance(a, jax.ShapeDtypeStruct):
        return a[b]
    sharding = a.sharding
    if isinstance(sharding, NamedSharding):
        sharding = NamedSharding(sharding.mesh, P(*tuple(sharding.spec)[1:]))
    return jax.ShapeDtypeStruct(a.shape[1:], a.dtype, sharding=sharding)


def stack_blocks(blocks: list):
    return jax.tree.map(lambda *a: jnp.stack(a), *blocks) if blocks else []


def model_of(graphdef, params, param_blocks):
    """The model with its layer blocks re-stacked (see `unstack_blocks`): inside a program
    the stacking copies nothing."""
    full = jax.tree.map(lambda a: a, params)  # a shallow copy of the State
    if param_blocks:
        full["blocks"] = stack_blocks(param_blocks)
    return nnx.merge(graphdef, full)


def shard_cache(cache: dict) -> dict:
    """The KV cache split over the mesh set by `jax.set_mesh` (if any): rows over the batch
    axes, kv heads over `tensor`, each where it divides (decode is bound by reading the
    weights and this cache, so neither may sit whole on every device)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return cache

    rows = split_batch_axes(mesh)
    n_rows = math.prod(mesh.shape[ax] for ax in rows)

    def one(path, a):  # [..., B, S, K, hd]; a ring's positions [..., B, S]
        is_pos = path[-1].key == "pos"
        B = a.shape[-2] if is_pos else a.shape[-4]
        spec = (rows if rows and B % n_rows == 0 else None, None)
        if not is_pos:
            K = a.shape[-2]
            spec += ("tensor" if K % mesh.shape["tensor"] == 0 else None, None)
        return jax.lax.with_sharding_constraint(a, P(*(None,) * (a.ndim - len(spec)), *spec))

    return jax.tree_util.tree_map_with_path(one, cache)
