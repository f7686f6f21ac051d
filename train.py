"""Train a Mixture-of-Experts language model.

    python train.py                                   # configs/tiny.yaml on the embedded corpus
    python train.py configs/tiny.yaml train.steps=100 moe.top_k=1 moe.renormalize=false
    python train.py run_dir=runs/exp1 data.path=shakespeare.txt data.tokenizer=char

A run directory that already holds checkpoints is resumed from the latest one, or from an
earlier one with `train.resume_step=N` (e.g. when the latest is damaged; the checkpoints after N
are moved to RUN_DIR/superseded). SIGTERM or Ctrl-C saves a checkpoint after the current step
and stops; run the same command to resume. One run at a time trains in a run directory (a
second one exits with an error naming the first); sample.py and the other readers may read it
meanwhile. A full disk stops training with one error line; the last complete checkpoint stays.
Metrics: RUN_DIR/metrics.jsonl and TensorBoard files in RUN_DIR/tb; plots with
`python -m moe_jax.plot RUN_DIR`.
"""

import sys
from pathlib import Path

DEFER_JAX_IMPORT = True  # see moe_jax/__init__.py: jax only once the input is checked

from moe_jax.runtime import import_jax, reexec_with_hugepages  # noqa: E402

if __name__ == "__main__":  # first: a glibc tunable is read only when a process starts
    reexec_with_hugepages()

from moe_jax.config import ConfigError, cli_config  # noqa: E402

USAGE = "usage: python train.py [CONFIG.yaml] [section.key=value ...]"


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(__doc__.strip() + "\n\n" + USAGE)
        return 0
    cfg = cli_config(argv, default_path=Path(__file__).resolve().parent / "configs/tiny.yaml")
    # Only now jax and what imports it (seconds): a bad config has failed before that.
    import_jax()
    from moe_jax.backends import KernelError
    from moe_jax.run.layout import RunError
    from moe_jax.run.store import SaveError
    from moe_jax.sharding import init_distributed
    from moe_jax.tokenizer import DataError
    from moe_jax.trainer import TrainingError, train

    try:
        init_distributed(cfg)
        result = train(cfg)
    except (ConfigError, KernelError, DataError, RunError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (TrainingError, SaveError) as e:  # the last complete checkpoint is kept
        print(f"error: {e}", file=sys.stderr)
        return 1
    if result.stopped_by is not None:
        return 128 + result.stopped_by  # the shell convention for "terminated by a signal"
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
