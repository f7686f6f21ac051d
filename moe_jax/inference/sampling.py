"""Text generation: prefill + KV-cache decode in one compiled program.

    cfg, sampler, tok = load_sampler("runs/x", ["mesh.expert=2"])   # a run (moe_jax.inference.load)
    sampler = Sampler(model)                       # splits the params once; keep it around
    out = sampler.generate([ids_a, ids_b], max_new_tokens=100, temperature=0.8, top_k=40)
    out.sequences()                                # generated ids per prompt, stop token included

One call is one jitted program: prefill of the right-padded prompt batch, then a
`jax.lax.while_loop` that feeds each sampled token back through the KV cache until every
sequence has hit a stop token or `max_new_tokens` are out. The program is compiled once per
(batch size, prompt bucket, max_new_tokens, sampling mode) and reused: prompt lengths are
padded up to a power of two, so most prompts share a compile, and the sampling *values*
(temperature, top-k, top-p, seed, up to 8 stop tokens) are traced arguments, so changing them
does not recompile. The mode (greedy, or sampling with or without the top-k / top-p filters)
is static, because a greedy or unfiltered step can skip the sort over the vocabulary.

Padding: row b's prompt occupies positions [0, len_b); its pad tokens are prefilled at
positions [len_b, bucket) and write junk into those cache slots, but attention masks by
position, and row b's decode step t writes position len_b + t - 1 before any query can see it,
so a padded prompt yields exactly what it yields alone.

MoE at inference: every token reaches its experts (`moe.capacity_factor = 0` on the sampling
copy of the graph). Capacity drops are a training-time device; at inference they would make a
sequence's tokens depend on the other sequences of the batch (and on the pad tokens), and the
result differ from the same prompt alone. The decode step then takes one of the MoE layer's
two paths by shape: with B * top_k < n_experts assignments in flight (batch 1-3 for top-2 of
8, 1-7 for top-1) it *gathers* just the picked experts' weights, so a step reads top_k /
n_experts of the expert weights instead of all of them; with more it runs the [E, C, D]
buffers, which read every expert once (B * top_k >= E assignments touch most experts anyway).
The price of no drops is in the prefill: its buffers hold C = all B * T tokens per expert, so
the prefill computes every expert on every token (n_experts / top_k times the routed work).
benchmarks/decode.py, benchmarks/results/decode.md and aot.md ("Sampling") show both costs.

Decode speed is bound by reading the weights, so nothing in the loop may copy them: layers run
unrolled here whatever `model.scan_layers` says, and the stacked layer blocks are split once
(see `decoding.unstack_blocks`). The KV cache has `bucket + max_new_tokens` slots; each step
attends over all of them under the position mask.

Under a mesh (`Sampler(model, mesh=mesh)`, the params sharded by `sharding.INFERENCE_RULES`,
as `load.load_run(mesh=...)` restores them) the same program runs sharded: the MoE
layers take the expert-parallel path, whose tokens move to the experts and back (a batch the
batch axes do not divide, e.g. one sequence, runs replicated: each device runs its own
experts and the outputs are summed), attention's heads and the experts' hidden dims split
over `tensor`, weights split over `fsdp` are gathered as each layer runs, and the KV cache is
split over the batch and kv-head axes (`decoding.shard_cache`). No weight is gathered across
`expert`, so decoding reads each device's own weights once per step. `consume=True` lets the
sampler take the model's stacked weights, freeing each once split, so they are held once.

An int8 model (`moe_jax.model.int8`) runs the same program: its weights enter as int8 values
and scales, and each layer's are dequantised inside the loop in that layer's turn (XLA would
otherwise hoist them out of the loop as float copies; see `moe_jax.model.int8.after`).
So does a bf16 model on CPU, which computes in float32: its weights are converted in their
turn and in parts (`moe_jax.model.in_turn`), and the program is compiled without XLA's
loop-invariant code motion, which would hoist every conversion out of the loop (a float32 copy
of every weight for the whole loop: 2x the weights' bytes in temporaries).

Streaming (`on_token`) calls back to the host from inside the compiled loop
(`jax.debug.callback`, ordered) rather than running the loop in chunks from Python: the
stream is the batch program plus one callback per step, so the default path and the streamed
one are the same code, there is no second (resumable) program, and each token shows the moment
it is sampled. The callback syncs with the host every step, which costs nothing that matters
on CPU or for text a person reads; batches compile without it. JAX orders callbacks on one
device only; under a mesh they are unordered and the host puts the steps back in order.

Drawing tokens (temperature, top-k, top-p, one key a row): `inference.next_token`. The loop's
scaffolding (the request as one value, the model calls, row keys, stop test, streaming), which
the speculative sampler shares: `moe_jax.inference.decoding`.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from moe_jax import backends
from moe_jax.config import sampling_problem
from moe_jax.data.windows import bucket
from moe_jax.errors import MoeJaxError
from moe_jax.inference.decoding import (
    Decoding,
    Program,
    Request,
    Weights,
    loop,
    model_of,
    unstack_blocks,
)
from moe_jax.inference.next_token import Mode, pick_tokens
from moe_jax.model import Transformer, in_turn
from moe_jax.model.int8 import is_quantized, quantize_model

STOP_BUCKET = 8  # stop-token lists are padded to a multiple of this


class SamplingError(MoeJaxError, ValueError):
    """Unusable generation request; the message names the problem and the fix."""


@dataclasses.dataclass(frozen=True)
class Generation:
    tokens: np.ndarray  # int32 [B, max_new_tokens]; -1 after a sequence's stop token
    lengths: np.ndarray  # int32 [B]: tokens generated per sequence, its stop token included
    steps: int  # decode-loop iterations run (max_new_tokens - 1 unless all stopped early)
    # With generate(record=True) (routing replay, `_record_prefill`): routes int32
    # [n_moe_layers, B, bucket + max_new_tokens, K], logprobs float32 [B, max_new_tokens].
    # Keyword-only: a subclass adds fields without defaults after these.
    routes: np.ndarray | None = dataclasses.field(default=None, kw_only=True)
    logprobs: np.ndarray | None = dataclasses.field(default=None, kw_only=True)

    def sequences(self) -> list[list[int]]:
        return [row[:n].tolist() for row, n in zip(self.tokens, self.lengths, strict=True)]


# ----------------------------------------------------------------------------- the program


def _generate(graphdef, emit_host, weights: Weights, request: Request, *, program: Program):
    """Prefill + decode loop (`decoding.loop`). -> (tokens [B, N] with -1 after a stop,
    decode iterations run)."""
    d = Decoding.start(graphdef, emit_host, weights, request, program)
    c = loop(d, _prefill(d), lambda c: _step(d, c))
    if program.record:
        return c["out"], c["it"] - 1, c["routes"], c["logp"]
    return c["out"], c["it"] - 1


def _pick(d: Decoding, logits_BV, step):
    r = d.request
    return pick_tokens(
        logits_BV, step, d.row_keys_B, r.n_vocab, r.temperature, r.top_k, r.top_p, d.program.mode
    )


def _prefill(d: Decoding) -> dict:
    """The first new token from each row's own last prompt position -> the loop's carry."""
    r = d.request
    B, P = r.prompt_BP.shape
    cache = d.unstacked(d.model().init_cache(B, P + d.N))
    # The head only at each row's last prompt position: [B, 1, V], not [B, P, V].
    last_B = r.prompt_len_B - 1
    logits_B1V, cache, *aux = d.forward(
        r.prompt_BP, d.prompt_positions(), cache, logits_at=last_B, with_aux=d.program.record
    )
    tok_B = _pick(d, logits_B1V[:, 0], 0)
    d.emit(0, tok_B)
    out_BN = jnp.full((B, d.N), -1, jnp.int32).at[:, 0].set(tok_B)
    done_B = d.is_stop(tok_B)
    c = {"it": jnp.int32(1), "tok": tok_B, "cache": cache, "out": out_BN, "done": done_B}
    return c | (_record_prefill(d, aux[0]["routes"], logits_B1V[:, 0], tok_B) if aux else {})


def _step(d: Decoding, c: dict) -> dict:
    """Feed token `step - 1` at its row's position; sample token `step`."""
    step, done_B = c["it"], c["done"]
    positions_B1 = (d.request.prompt_len_B + step - 1)[:, None]
    logits_B1V, cache, *aux = d.forward(
        c["tok"][:, None], positions_B1, c["cache"], with_aux=d.program.record
    )
    new_B = _pick(d, logits_B1V[:, 0], step)
    out_tok_B = jnp.where(done_B, -1, new_B)
    d.emit(step, out_tok_B)
    out_BN = jax.lax.dynamic_update_slice(c["out"], out_tok_B[:, None], (0, step))
    if aux:
        c = c | _record_step(d, c, aux[0]["routes"], positions_B1[:, 0], logits_B1V, out_tok_B)
    done_B = done_B | d.is_stop(new_B)
    new = {"it": step + 1, "tok": new_B, "cache": cache, "out": out_BN, "done": done_B}
    return c | new


# ----------------------------------------------------------------------------- recording


def _record_prefill(d: Decoding, routes_LBPK, logits_BV, tok_B) -> dict:
    """The carry's record for routing replay: "routes" [L, B, P + N, K], the experts of each
    MoE layer at every position of the row as a trainer lays it out (prompt, then the new
    tokens), -1 where no token was fed (the prompt's padding, the last new token, which no
    step feeds); "logp" [B, N], each sampled token's log-prob (`_logp`)."""
    L, B, P, K = routes_LBPK.shape
    in_prompt_BP = jnp.arange(P)[None, :] < d.request.prompt_len_B[:, None]
    routes_LBPK = jnp.where(in_prompt_BP[None, :, :, None], routes_LBPK, -1)
    routes = jnp.full((L, B, P + d.N, K), -1, jnp.int32).at[:, :, :P].set(routes_LBPK)
    logp_BN = jnp.zeros((B, d.N), jnp.float32).at[:, 0].set(_logp(d, logits_BV, tok_B))
    return {"routes": routes, "logp": logp_BN}


def _record_step(d: Decoding, c, routes_LB1K, pos_B, logits_B1V, out_tok_B) -> dict:
    """The fed token's experts at its position; the new token's log-prob (0 once done)."""
    B = pos_B.shape[0]
    routes = c["routes"].at[:, jnp.arange(B), pos_B].set(routes_LB1K[:, :, 0])
    logp_B = jnp.where(out_tok_B >= 0, _logp(d, logits_B1V[:, 0], out_tok_B), 0.0)
    logp_BN = jax.lax.dynamic_update_slice(c["logp"], logp_B[:, None], (0, c["it"]))
    return {"routes": routes, "logp": logp_BN}


def _logp(d: Decoding, logits_BV, tok_B) -> jax.Array:
    """log p(token) under the model's logits at the request's temperature, over the whole
    vocabulary (no top-k / top-p / vocab_size filter): what a trainer recomputes."""
    logp_BV = jax.nn.log_softmax(logits_BV.astype(jnp.float32) / d.request.temperature, -1)
    return jnp.take_along_axis(logp_BV, jnp.maximum(tok_B, 0)[:, None], axis=-1)[:, 0]


# ----------------------------------------------------------------------------- the API


def _pad_stops(stop_tokens: Sequence[int]) -> np.ndarray:
    """Stop ids padded with -1 (never sampled) to a multiple of STOP_BUCKET: one program serves
    every request with up to STOP_BUCKET stop tokens, none included."""
    n = max(STOP_BUCKET, -(-len(stop_tokens) // STOP_BUCKET) * STOP_BUCKET)
    padded = np.full(n, -1, np.int32)
    padded[: len(stop_tokens)] = stop_tokens
    return padded


class Sampler:
    """Generation from one model's parameters: split once, programs compiled and cached per
    sampler (so keep one Sampler per model rather than one per call)."""

    RECORDS = True  # generate(record=True) keeps routes and log-probs (routing replay)

    def __init__(self, model: Transformer, *, mesh: Mesh | None = None, consume: bool = False):
        """`mesh`: generate under it (params sharded over it, e.g. by `load_run(mesh=...)`):
        the MoE layers route through the expert-parallel path and the KV cache is split over
        the batch and kv-head axes. Without it, a mesh set by the caller (`jax.set_mesh`)
        applies. `consume`: take `model`'s arrays instead of copying its stacked layer blocks
        (`_split_blocks`), so that the weights are held once; `model` is unusable
        afterwards."""
        cfg = model.cfg
        self.cfg = cfg
        self.mesh = mesh
        # The same graph with no capacity drops and unrolled layers (see the module
        # docstring); only static attributes change, so the trained params plug straight in.
        infer_cfg = dataclasses.replace(
            cfg,
            model=dataclasses.replace(cfg.model, scan_layers=False),
            moe=dataclasses.replace(cfg.moe, capacity_factor=0),
        )
        build = lambda: Transformer(infer_cfg, rngs=nnx.Rngs(0))
        if is_quantized(model):  # the same int8 weights (moe_jax.quantize)
            build = lambda: quantize_model(Transformer(infer_cfg, rngs=nnx.Rngs(0)))
        self.graphdef, _ = nnx.split(nnx.eval_shape(build), nnx.Param)
        # The stacked layer blocks are split once here, so that no program slices them
        # (see `unstack_blocks`): this holds a copy of them while `model` lives too, unless
        # `consume` takes them (`_split_blocks`).
        params = nnx.state(model, nnx.Param)
        self.params = jax.tree.map(lambda a: a, params)  # a shallow copy to pop from
        blocks = self.params.pop("blocks") if model.n_blocks else None
        self.param_blocks = _split_blocks(blocks, model.n_blocks, consume) if blocks else []
        # One jitted function per sampler: the graph is bound, not hashed at every call.
        self.compiled = self._jit(partial(_generate, self.graphdef, self._emit))
        self._listener: Callable[[int, np.ndarray], None] | None = None
        self._pending: dict[int, np.ndarray] = {}  # streamed steps not yet handed on
        self._next_step = 0

    def _jit(self, program: Callable):
        """`program` jitted, its `program` argument static. 16-bit weights for a wider compute
        dtype (bf16 weights on CPU) compile without the loop-invariant code motion, which
        would hoist each weight's conversion out of the decode loop: a float copy of every
        weight alive for the whole loop (`moe_jax.model.in_turn`)."""
        dtype = backends.compute_dtype(self.cfg.model.dtype)
        converts = in_turn.any_in_turn((self.params, self.param_blocks), dtype)
        options = backends.loop_compiler_options(converts)
        return jax.jit(program, static_argnames="program", compiler_options=options)

    def _on_mesh(self):
        """The context the programs trace in: `self.mesh` set, or the caller's."""
        return jax.set_mesh(self.mesh) if self.mesh is not None else contextlib.nullcontext()

    def _emit(self, step, tokens_B) -> None:
        """Host side of the streaming callback: hand the steps' tokens to the listener in
        step order (unordered callbacks, under a mesh, may arrive out of it)."""
        if self._listener is None:
            return
        self._pending[int(step)] = np.asarray(tokens_B)
        while self._next_step in self._pending:
            self._listener(self._next_step, self._pending.pop(self._next_step))
            self._next_step += 1

    def inference_model(self) -> Transformer:
        """The model exactly as generation runs it (no capacity drops), for references."""
        return model_of(self.graphdef, self.params, self.param_blocks)

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int,
        *,
        temperature: float = 1.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int = 0,
        stop_tokens: Sequence[int] = (),
        vocab_size: int | None = None,
        on_token: Callable[[int, np.ndarray], None] | None = None,
        record: bool = False,
    ) -> Generation:
        """Continue every prompt (token ids) by up to `max_new_tokens` tokens.

        A sequence ends after it emits any of `stop_tokens`; the loop ends when all have.
        `vocab_size` restricts sampling to ids below it: a char tokenizer's alphabet is usually
        smaller than the model's vocabulary, and the ids beyond it decode to nothing.
        `on_token(step, tokens_B)` streams each step's tokens (-1 for finished rows) from
        inside the compiled loop; it compiles a separate (otherwise identical) program.
        `record` (routing replay): the Generation's `routes` and `logprobs` too (see
        `_record_prefill`); a separate program.
        """
        if record and not self.RECORDS:
            raise SamplingError(f"{type(self).__name__} does not record routes; use Sampler")
        request, program = self._inputs(
            prompts, max_new_tokens, temperature, top_k, top_p, seed, stop_tokens, vocab_size
        )
        if self.mesh is not None:  # prompts and sampling values replicated over the mesh
            request = jax.device_put(request, NamedSharding(self.mesh, P()))
        program = program._replace(stream=on_token is not None, record=record)
        self._listener, self._pending, self._next_step = on_token, {}, 0
        try:
            with self._on_mesh():
                outputs = self.compiled(self._weights(), request, program=program)
            outputs = jax.device_get(outputs)  # waits for the program (and its callbacks)
        finally:
            self._listener = None
        if record:
            out_BN, steps, routes, logp_BN = outputs
            return dataclasses.replace(
                self._generation(out_BN, steps), routes=routes, logprobs=logp_BN
            )
        return self._generation(*outputs)

    def _generation(self, out_BN: np.ndarray, steps) -> Generation:
        """The program's outputs as the caller gets them (`speculative` adds its own)."""
        return Generation(out_BN, np.sum(out_BN >= 0, axis=1).astype(np.int32), int(steps))

    def lower(self, prompts, max_new_tokens: int, *, sharding=None, **kw) -> jax.stages.Lowered:
        """The program `generate(prompts, max_new_tokens, **kw)` runs, lowered and not run:
        for reading its HLO or its compiled memory (`.compile().memory_analysis()`).

        `sharding`: give the prompts and sampling values as abstract arrays with this sharding
        instead of arrays on this host's device (the sampler's params are then abstract too:
        compiling for a TPU slice or GPU cluster from this machine, see `moe_jax.aot.command`)."""
        request, program = self._inputs(prompts, max_new_tokens, **kw)
        if sharding is not None:
            as_abstract = lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=sharding)
            request = jax.tree.map(as_abstract, request)
        with self._on_mesh():
            return self.compiled.lower(self._weights(), request, program=program)

    def _weights(self) -> Weights:
        return Weights(self.params, self.param_blocks)

    def _inputs(
        self,
        prompts,
        max_new_tokens,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        seed=0,
        stop_tokens=(),
        vocab_size=None,
    ):
        """Checked arguments of the compiled program: (its request, its program)."""
        V, max_len = self.cfg.model.vocab_size, self.cfg.model.max_seq_len
        lengths = self._check(prompts, max_new_tokens, temperature, top_k, top_p, stop_tokens)
        if problem := sampling_problem({"seed": seed}):  # a PRNG key takes 32 bits
            raise SamplingError(problem)
        if vocab_size is not None and not 0 < vocab_size <= V:
            raise SamplingError(f"vocab_size must be within [1, {V}], got {vocab_size}")
        longest = max(lengths)
        if longest + max_new_tokens > max_len:
            raise SamplingError(
                f"prompt of {longest} tokens + max_new_tokens {max_new_tokens} exceeds the "
                f"model's context (model.max_seq_len={max_len}); shorten the prompt or lower "
                "max_new_tokens"
            )
        P = bucket(longest, max_len - max_new_tokens)
        prompt_BP = np.zeros((len(prompts), P), np.int32)
        for row, ids in zip(prompt_BP, prompts, strict=True):
            row[: len(ids)] = ids
        greedy = temperature == 0  # then the filters cannot change the argmax
        request = Request(
            prompt_BP=jnp.asarray(prompt_BP),
            prompt_len_B=jnp.asarray(lengths, jnp.int32),
            stop_S=jnp.asarray(_pad_stops(stop_tokens)),
            key=jax.random.key(seed),
            temperature=jnp.float32(temperature if temperature > 0 else 1.0),
            top_k=jnp.int32(min(top_k, V)),  # any top_k >= V is off; int32 holds V
            top_p=jnp.float32(top_p),
            n_vocab=jnp.int32(vocab_size or V),
        )
        mode = Mode(greedy, not greedy and 0 < top_k < V, not greedy and top_p < 1)
        return request, Program(max_new_tokens, mode)

    def _check(self, prompts, max_new_tokens, temperature, top_k, top_p, stop_tokens):
        V = self.cfg.model.vocab_size
        if isinstance(prompts, str | bytes) or len(prompts) == 0:
            raise SamplingError("prompts must be a non-empty list of token-id sequences")
        lengths = []
        for i, ids in enumerate(prompts):
            ids = np.asarray(ids)
            if ids.ndim != 1 or ids.size == 0:
                raise SamplingError(
                    f"prompt {i} is empty or not a flat list of token ids; give each prompt at "
                    "least one token (e.g. a newline)"
                )
            if not np.issubdtype(ids.dtype, np.integer) or ids.min() < 0 or ids.max() >= V:
                raise SamplingError(
                    f"prompt {i} has token ids outside [0, {V}) (the model's vocabulary); "
                    "encode it with the run's tokenizer"
                )
            lengths.append(int(ids.size))
        if any(not 0 <= int(t) < V for t in stop_tokens):
            raise SamplingError(f"stop_tokens must be token ids in [0, {V})")
        if max_new_tokens < 1:
            raise SamplingError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
        rule = dict(temperature=temperature, top_k=top_k, top_p=top_p)
        if problem := sampling_problem(rule):
            raise SamplingError(problem)
        return lengths


def _split_blocks(tree, n: int, consume: bool) -> list:
    """The stacked layer blocks [n, ...] as n per-block trees (`unstack_blocks`). Taken
    (`consume`), an array held whole on one CPU device splits into views of its own memory:
    no copy. Elsewhere each block is copied out and, taken, the stacked array deleted once
    split; until then it is held twice (Qwen3-30B-A3B's width at 4 layers: an expert stack
    of 1.5 GiB, the sampler's peak 1.34x the weights' bytes on CPU, the load's 1.27x)."""
    leaves, treedef = jax.tree.flatten(tree)
    per_leaf = []
    for a in leaves:
        views = _block_views(a, n) if consume else None
        per_leaf.append(views or unstack_blocks(a, n, consume))
    return [jax.tree.unflatten(treedef, [parts[b] for parts in per_leaf]) for b in range(n)]


def _block_views(a, n: int) -> list | None:
    """Block b of `a` (stacked, whole on one CPU device) as a view of a's memory: a numpy
    view of the device buffer put back on the device, which XLA:CPU takes without a copy and
    which keeps a's memory alive. None elsewhere, or where the runtime copied after all."""
    if not isinstance(a, jax.Array) or len(a.devices()) != 1:
        return None
    device = next(iter(a.devices()))
    if device.platform != "cpu":
        return None
    host = np.asarray(a)  # on CPU, the device buffer itself
    views = [jax.device_put(host[b], device) for b in range(n)]
    start = a.unsafe_buffer_pointer()
    inside = lambda v: start <= v.unsafe_buffer_pointer() < start + a.nbytes
    return views if all(map(inside, views)) else None


def generate(model: Transformer, prompts: Sequence[Sequence[int]], max_new_tokens: int, **kw):
    """One-off `Sampler(model).generate(...)`; keep a Sampler to skip the split per call."""
    return Sampler(model).generate(prompts, max_new_tokens, **kw)
