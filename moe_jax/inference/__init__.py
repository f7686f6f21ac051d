"""Generation, in one room: the jitted sampler that `sample.py` runs (`sampling`: one prompt
batch, one compiled prefill and decode loop, `decoding` its loop skeleton), how the next token
is drawn (`next_token`: temperature, top-k, top-p, one key a row), speculative decoding with
the MTP layers as the draft (`speculative`, its acceptance rule `acceptance`), the form the
weights take (`weights`: float32, bf16, int8, MXFP4), a run or an HF directory loaded for
inference (`load`), and the engine (`engine/`: continuous batching over a paged KV cache) that
the server and eval's `generate_until` run on. `sample.py`, `python -m moe_jax.serve` and
`python -m moe_jax.quantize` are doors onto it."""
