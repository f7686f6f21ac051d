"""The run directory's names, and the error every reader and writer of one raises.

    RUN_DIR/config.yaml           the config the run was started with (marks a run directory)
    RUN_DIR/tokenizer/            a file tokenizer's files (tokenizer.json or tokenizer.model and
                                  its config files), written before the first checkpoint; each
                                  checkpoint's meta records their SHA-256s, checked on loading,
                                  so the run directory is self-contained (copy or move it whole)
    RUN_DIR/checkpoints/<step>/   one Orbax checkpoint per saved step, items:
        params/     the model's nnx.Param state        (Orbax PyTree, sharded arrays)
        opt_state/  the optax state                     (Orbax PyTree)
        data/       the Grain iterator position, one JSON file per process
        meta/       resolved config (YAML text), tokenizer, corpus fingerprint (JSON)
    RUN_DIR/metrics.jsonl, RUN_DIR/tb/   metrics (see moe_jax/observe/writers.py)
    RUN_DIR/train.lock            while a run trains: its pid and host (see `run.lock.RunLock`)
    RUN_DIR/superseded/<step>/    checkpoints after the one `train.resume_step` resumed from

An inference-only run (`python -m moe_jax.quantize`) has the same layout with `params/` and
`meta/` only; its meta says `"quantization": "int8"` (config.yaml says so in a comment), so
loading rebuilds the quantised model, and training it is refused.
"""

from __future__ import annotations

from moe_jax.errors import MoeJaxError

CONFIG_FILE = "config.yaml"


CHECKPOINT_DIR = "checkpoints"


UNFINISHED_GLOB = "*.orbax-checkpoint-tmp*"  # Orbax's name for a checkpoint being written


SUPERSEDED_DIR = "superseded"  # where train.resume_step moves the checkpoints after its step


LOCK_FILE = "train.lock"


TOKENIZER_DIR = "tokenizer"  # a file tokenizer's files (moe_jax/tokenizer/files.py)


ITEMS = ("params", "opt_state", "data", "meta")


class RunError(MoeJaxError, ValueError):
    """A run directory that cannot be used as asked; the message names the fix."""
