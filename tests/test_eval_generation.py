"""The harness's `generate_until` through the engine (moe_jax/eval/generation.py) against the
sampler it replaced: the same greedy texts, stop strings cut and ending requests early, many
requests sharing decode steps. A char tokenizer, so that every token is one character and a
stop string's place in the text does not depend on where decoding starts.
Budget: ~15 s on 2 cores (a tiny model; the engine's few shapes, the sampler's one program).
"""

import numpy as np
import pytest
from flax import nnx

from moe_jax.eval import EvalError
from moe_jax.eval.generation import Generator, GenOptions, cut_at_stops
from moe_jax.inference.engine.programs import PickMode
from moe_jax.inference.sampling import Sampler
from moe_jax.model import Transformer
from moe_jax.tokenizer.simple import CharTokenizer
from tests.helpers import tiny_config

BASE = ["model.init_std=0.05", "model.n_layers=2", "model.max_seq_len=64", "train.seq_len=64"]
N = 12  # max_gen_toks
MAX_LENGTH = 40  # room for prompts of 28 tokens: the longer ones lose their oldest tokens
LENGTHS = (5, 11, 30, 19, 3, 40, 8, 25, 14, 2)


@pytest.fixture(scope="module")
def setup():
    sampler = Sampler(Transformer(tiny_config(*BASE), rngs=nnx.Rngs(0)))
    tok = CharTokenizer("abcdefghijklmnopqrstuvwxyz0123456789 \n.,")
    tok.eos_id = int(tok.encode(",")[0])  # an EOS, which the texts leave out
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, tok.vocab_size, n).tolist() for n in LENGTHS]
    # The replaced path: the sampler, every prompt truncated as the harness does, greedy.
    kept = [p[-(MAX_LENGTH - N) :] for p in prompts]
    out = sampler.generate(kept, N, temperature=0, stop_tokens=[tok.eos_id], vocab_size=40)
    ids = [s[: s.index(tok.eos_id)] if tok.eos_id in s else s for s in out.sequences()]
    return sampler, tok, prompts, [tok.decode(s) for s in ids]


def test_greedy_texts_equal_the_samplers_cut_at_stop_strings_and_batched(setup):
    sampler, tok, prompts, free = setup
    # Even requests stop at two characters from the middle of their own text (a string of
    # several tokens: the host sees it and cancels the request); odd ones at a newline (one
    # token: an engine stop id).
    until = [(t[3:5],) if i % 2 == 0 and len(t) >= 5 else ("\n",) for i, t in enumerate(free)]
    gen = Generator(sampler, tok, batch_size=4, max_length=MAX_LENGTH)
    requests = [
        (p, GenOptions(until=u, max_gen_toks=N)) for p, u in zip(prompts, until, strict=True)
    ]
    texts = gen.generate(requests, progress=False)
    assert texts == [cut_at_stops(t, u) for t, u in zip(free, until, strict=True)]
    assert any(len(t) >= 5 for t in free[::2])  # some stop strings were met ...
    assert gen.tokens < sum(min(len(t) + 1, N) for t in free)  # ... and cut generation short
    greedy = PickMode(all_greedy=True, any_filter=False)
    assert ((4, 1), (4, 1), greedy) in gen.programs  # 4 requests decoded in one step
    assert gen.engine.pool.in_use() == 0 and not gen.engine.has_work()
    # Again, on the same engine: the same texts (nothing carried over but cached prefixes).
    assert gen.generate(requests, progress=False) == texts


def test_no_room_for_a_prompt_is_refused(setup):
    sampler, tok, prompts, _ = setup
    gen = Generator(sampler, tok, batch_size=4, max_length=MAX_LENGTH)
    with pytest.raises(EvalError, match="max_gen_toks"):
        gen.generate([(prompts[0], GenOptions(max_gen_toks=MAX_LENGTH))], progress=False)
