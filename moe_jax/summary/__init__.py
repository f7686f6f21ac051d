"""Parameter and FLOP accounting read off the real model (`counts`), and the chips' peak FLOP
rates and MFU's units (`peaks`): `python -m moe_jax.summary CONFIG`."""
