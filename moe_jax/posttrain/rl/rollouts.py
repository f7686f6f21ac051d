"""Rollouts as training rows, and the trainer's log-probs of their sampled tokens.

    gen = sampler.generate(prompts, N, temperature=1.0, record=True)
    rows = rollout_rows(prompts, gen)          # numpy: tokens, completion mask, routes, logp
    logp_BT, aux = token_logps(model, rows["tokens"], routes=rows["routes"])  # [B, S - 1]

A row is its prompt followed by its sampled tokens, from position 0, padded to the sampler's
layout (prompt bucket + max_new_tokens positions): so the sampler's recorded experts
(`Generation.routes`, [L, B, P + N, K] by position) replay position for position. Targets
are tokens[:, 1:]: target t is the token at position t + 1, scored from the logits at t
(so a row's "mask" and "old_logp", by position, are [:, 1:] for the targets).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from moe_jax import backends
from moe_jax.inference.sampling import Generation
from moe_jax.model.loss import head_statistics


def rollout_rows(
    prompts: Sequence[Sequence[int]], gen: Generation, width: int | None = None, pad_id: int = 0
) -> dict:
    """-> numpy arrays of `width` positions (default the sampler's: prompt bucket +
    max_new_tokens): "tokens" int32 [B, S]; "mask" float32 [B, S], 1 at the sampled tokens;
    "old_logp" float32 [B, S], the sampler's log-prob of each sampled token (0 elsewhere);
    with gen.routes, "routes" int32 [L, B, S, K] (-1 where nothing was recorded)."""
    B, N = gen.tokens.shape
    S = width or N + (gen.routes.shape[2] - N if gen.routes is not None else max(map(len, prompts)))
    tokens = np.full((B, S), pad_id, np.int32)
    mask = np.zeros((B, S), np.float32)
    old_logp = np.zeros((B, S), np.float32)
    for b, (prompt, n) in enumerate(zip(prompts, gen.lengths, strict=True)):
        p = len(prompt)
        tokens[b, :p] = prompt
        tokens[b, p : p + n] = gen.tokens[b, :n]
        mask[b, p : p + n] = 1.0
        if gen.logprobs is not None:
            old_logp[b, p : p + n] = gen.logprobs[b, :n]
    rows = {"tokens": tokens, "mask": mask, "old_logp": old_logp}
    if gen.routes is not None:
        L, _, S_gen, K = gen.routes.shape
        routes = np.full((L, B, S, K), -1, np.int32)
        routes[:, :, : min(S, S_gen)] = gen.routes[:, :, :S]
        rows["routes"] = routes
    return rows


def token_logps(model, tokens_BS, *, routes=None, temperature: float = 1.0):
    """-> (log p of each target tokens[:, 1:] given its prefix, float32 [B, S - 1]; the
    model's aux). `routes` [L, B, S, K]: routing replay of the rows' recorded experts.
    `temperature`: the sampler's (its log-probs are of logits / temperature)."""
    inputs_BT, targets_BT = tokens_BS[:, :-1], tokens_BS[:, 1:]
    replay = None if routes is None else jnp.asarray(routes)[:, :, :-1]
    x_BTD, aux = model(inputs_BT, head=False, routes=replay)
    chunk = backends.loss_chunk(model.cfg.train.loss_chunk, x_BTD.shape[1])
    head_DV = model.head_weight(x_BTD) / temperature
    logz_BT, target_BT = head_statistics(model.logits, x_BTD, targets_BT, chunk, head_DV)
    return target_BT - logz_BT, aux


def expert_agreement(recorded_LBSK, taken_LBSK, mask_BS) -> jax.Array:
    """The fraction of the recorded expert choices (at `mask_BS` positions with a record)
    that the trainer's forward took too, as sets per token and layer."""
    same_LBSK = jnp.any(recorded_LBSK[..., :, None] == taken_LBSK[..., None, :], axis=-1)
    w_LBS = (mask_BS[None] * (recorded_LBSK[..., 0] >= 0)).astype(jnp.float32)
    agree = jnp.sum(jnp.mean(same_LBSK, axis=-1) * w_LBS)
    return agree / jnp.maximum(jnp.sum(w_LBS), 1.0)
