"""Log-likelihoods of continuations, batched: the harness's `loglikelihood` requests (and the
windows of `loglikelihood_rolling`) as one jitted forward per batch shape.

    scorer = Scorer(sampler, batch_size=8, max_length=1024)
    scorer.loglikelihood([(context_ids, continuation_ids), ...])  # [(logprob, is_greedy), ...]

A request is scored as the harness's Hugging Face backend scores it: the model reads
(context + continuation)[-(max_length + 1):][:-1], and the continuation's log-probability is
the sum over its tokens of log_softmax(logits) at the positions that predict them; is_greedy
says whether each of them is also the argmax there. Rows are batched by `buckets` and padded
on the right; the padding is a segment of its own (segment 0), so it takes no expert's work
and no real token attends to it, and with the sampler's no-drop MoE (`moe.capacity_factor=0`)
a row's numbers do not depend on the other rows of its batch: batched equals one at a time.

The head runs at the scored positions only: the last layer's output is gathered at C
positions per row ([B, C, D], C the batch's longest continuation rounded up to a bucket)
before the final norm and the head, so the logits are [B, C, V] instead of [B, T, V] (the
whole sequence's logits would be most of the work at a large vocabulary). The model is the
sampler's own (its params, split into blocks once, re-stacked inside the program, which
copies nothing: see `inference.sampling.unstack_blocks`), so a run is loaded and held once for
scoring and generation, sharded over the sampler's mesh when it has one (rows then split over
the batch axes where they divide).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Sequence
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from tqdm import tqdm

from moe_jax.eval import EvalError
from moe_jax.eval.batching import batches, bucket
from moe_jax.inference.sampling import Sampler, model_of
from moe_jax.sharding import split_batch_axes

MIN_SCORED = 8  # fewest scored positions per row a program computes: short continuations share


def _score(graphdef, params, param_blocks, tokens_BT, length_B, start_B, target_BC, n_B):
    """-> (log-probability of each row's continuation [B], whether it is greedy [B]).
    Row b reads tokens_BT[b, :length_B[b]]; its n_B[b] targets are predicted at positions
    start_B[b] .. start_B[b] + n_B[b] - 1."""
    model = model_of(graphdef, params, param_blocks)
    T, C = tokens_BT.shape[1], target_BC.shape[1]
    segments_BT = (jnp.arange(T)[None, :] < length_B[:, None]).astype(jnp.int32)
    x_BTD, _ = model(tokens_BT, segments=segments_BT, head=False)
    at_BC = jnp.minimum(start_B[:, None] + jnp.arange(C)[None, :], T - 1)
    logits_BCV = model.logits(jnp.take_along_axis(x_BTD, at_BC[..., None], axis=1))
    logz_BC = jax.nn.logsumexp(logits_BCV, axis=-1)
    target_logit_BC = jnp.take_along_axis(logits_BCV, target_BC[..., None], axis=-1)[..., 0]
    scored_BC = jnp.arange(C)[None, :] < n_B[:, None]
    logprob_B = jnp.sum(jnp.where(scored_BC, target_logit_BC - logz_BC, 0.0), axis=1)
    hit_BC = jnp.argmax(logits_BCV, axis=-1) == target_BC
    return logprob_B, jnp.all(hit_BC | ~scored_BC, axis=1)


class Scorer:
    """Scores (context, continuation) token requests with a sampler's model."""

    def __init__(self, sampler: Sampler, batch_size: int, max_length: int):
        """`max_length`: the longest sequence the model reads (at most model.max_seq_len);
        longer requests lose their oldest context tokens, as in the harness."""
        self.sampler, self.batch_size, self.max_length = sampler, batch_size, max_length
        self.jitted = jax.jit(partial(_score, sampler.graphdef))
        self.programs: set[tuple[int, int, int]] = set()  # (rows, length, scored) compiled
        self.seconds = 0.0  # spent in `loglikelihood`, compiling included
        self.requests = 0  # scored so far

    def loglikelihood(
        self, requests: Sequence[tuple[Sequence[int], Sequence[int]]], progress: bool = True
    ) -> list[tuple[float, bool]]:
        """(log-probability, is_greedy) of each (context ids, continuation ids) request.
        EvalError for an empty context or a continuation longer than `max_length`."""
        t0 = time.perf_counter()
        L = self.max_length
        rows = []  # (input ids, continuation ids)
        for context, continuation in requests:
            whole = [*context, *continuation]
            n = len(continuation)
            if not context or n > L:
                raise EvalError(
                    f"a request of {len(context)} context and {n} continuation tokens cannot be "
                    f"scored with a context of {L} tokens: it needs at least one context token "
                    f"and at most {L} continuation tokens"
                )
            rows.append((whole[-(L + 1) : -1], list(continuation)))
        out: list[tuple[float, bool]] = [(0.0, True)] * len(rows)
        with tqdm(total=len(rows), desc="scoring", disable=not progress or None) as bar:
            for batch in batches([len(ids) for ids, _ in rows], self.batch_size):
                logprob_B, greedy_B = self._run([rows[i] for i in batch])
                for j, i in enumerate(batch):
                    out[i] = (float(logprob_B[j]), bool(greedy_B[j]))
                bar.update(len(batch))
        self.seconds += time.perf_counter() - t0
        self.requests += len(rows)
        return out

    def _run(self, rows: list[tuple[list[int], list[int]]]) -> tuple[np.ndarray, np.ndarray]:
        """One batch (longest row first) padded to its bucket shape, through the program."""
        B, L = self.batch_size, self.max_length
        T = bucket(len(rows[0][0]), L)
        C = bucket(max(len(target) for _, target in rows), T, MIN_SCORED)
        tokens_BT = np.zeros((B, T), np.int32)
        target_BC = np.zeros((B, C), np.int32)
        length_B, start_B, n_B = (np.zeros(B, np.int32) for _ in range(3))
        for b, (ids, target) in enumerate(rows):  # rows past len(rows) stay empty, unread
            n = len(target)
            tokens_BT[b, : len(ids)] = ids
            target_BC[b, :n] = target
            length_B[b], start_B[b], n_B[b] = len(ids), len(ids) - n, n
        self.programs.add((B, T, C))
        args = self._place((tokens_BT, length_B, start_B, target_BC, n_B))
        s = self.sampler
        with jax.set_mesh(s.mesh) if s.mesh is not None else contextlib.nullcontext():
            logprob_B, greedy_B = self.jitted(s.params, s.param_blocks, *args)
        return np.asarray(logprob_B), np.asarray(greedy_B)

    def _place(self, arrays):
        """The batch's arrays on the sampler's mesh: rows over its batch axes where they
        divide the batch, else replicated (one device: as they are)."""
        mesh = self.sampler.mesh
        if mesh is None:
            return arrays
        axes = split_batch_axes(mesh)
        split = axes and self.batch_size % math.prod(mesh.shape[a] for a in axes) == 0
        return jax.device_put(arrays, NamedSharding(mesh, P(axes) if split else P()))
