"""GRPO's rollouts drawn by the generation engine (`rl.rollout_engine=true`) instead of the
jitted sampler's batch program: the same draws and the same Generation, so `collect` makes
the same rows of it.

    gen = engine_generation(sampler, prompts, rl, seed=s, stop_ids=[eos], vocab_size=V,
                            width=bucket + rl.max_new_tokens)

Row r is a request keyed as the sampler keys its row r (fold_in(key(seed), r), then the
step: `SamplingParams.row`), so a resumed run draws what the uninterrupted one did, and the
engine what the sampler would (to float rounding). An engine is made for each draw, sized
for it: a slot per row and pages for every row's whole width (nothing is preempted), one
prefill chunk the prompt bucket (a prompt prefills in one call), every prompt's chunk in one
call; its G copies of a prompt wait for that prefill and share its full pages
(`Engine._admit`). Made afresh, it finds no prefix computed with the last step's weights,
and its pages are freed before the train step runs. Its programs are compiled once per
sampler graph (`programs._jitted`).
"""

from __future__ import annotations

from moe_jax.inference.engine import Engine, SamplingParams
from moe_jax.inference.sampling import Generation, Sampler

PAGE_SIZE = 16  # the engine's default: prompts longer than a page share their full pages


def engine_generation(
    sampler: Sampler, prompts, rl, *, seed: int, stop_ids, vocab_size: int, width: int
) -> Generation:
    """rl.max_new_tokens tokens (or to a stop id) of every prompt at rl.temperature, row r
    keyed by (seed, r) -> `Sampler.generate(record=True)`'s Generation."""
    R, max_len = len(prompts), sampler.cfg.model.max_seq_len
    pages_for = lambda n: -(-n // PAGE_SIZE)
    engine = Engine(
        sampler, record=True, max_slots=R, page_size=PAGE_SIZE,
        n_pages=max(R * pages_for(width), pages_for(max_len)), chunk=width - rl.max_new_tokens,
        prefill_rows=R, vocab_size=vocab_size,
    )  # fmt: skip
    params = [
        SamplingParams(
            max_tokens=rl.max_new_tokens,
            temperature=rl.temperature,
            seed=seed,
            stop_ids=tuple(stop_ids),
            row=r,
        )  # fmt: skip
        for r in range(R)
    ]
    return engine.generate_recorded(prompts, params)
