"""Train a Mixture-of-Experts language model: `moe-jax-train` as a script of the clone.

    python train.py                                   # configs/tiny.yaml on the embedded corpus
    python train.py configs/tiny.yaml train.steps=100 moe.top_k=1 moe.renormalize=false
    python train.py recipes/mixtral_8x7b_v5p128 run_dir=/nfs/runs/mixtral

`python train.py --help` says the rest; the command itself is moe_jax/cli/train.py.
"""

import sys

DEFER_JAX_IMPORT = True  # see moe_jax/__init__.py: jax only once the input is checked

from moe_jax.process_setup import reexec_with_hugepages  # noqa: E402

if __name__ == "__main__":  # first: a glibc tunable is read only when a process starts
    reexec_with_hugepages()

from moe_jax.cli.train import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
