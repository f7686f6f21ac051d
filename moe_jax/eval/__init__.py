"""Downstream evaluation with EleutherAI's lm-evaluation-harness (the `eval` extra).

    python -m moe_jax.eval RUN_DIR --tasks hellaswag,arc_easy [--num-fewshot N] [--limit N]
    python -m moe_jax.eval.harness run --model moe_jax --model_args run=RUN_DIR --tasks ...
    train.py eval.tasks=hellaswag eval.limit=200          # at train.eval_every (or eval.every)

The harness builds each task's requests as text; `backend.MoeJaxLM` (registered with the
harness as "moe_jax") answers them from a run: `loglikelihood` and `loglikelihood_rolling`
through `scoring.Scorer` (requests sorted by length into a few padded buckets, one compiled
forward per bucket shape, the head only at the scored positions), `generate_until` through
the run's jitted sampler (`generation.py`). `tasks.py` finds and checks the tasks and runs
the harness; `__main__.py` is the command, `in_training.py` the trainer's hook. Only the
modules that talk to the harness import it (backend, tasks, harness, in_training).
"""

from __future__ import annotations

from moe_jax.errors import MoeJaxError


class EvalError(MoeJaxError, ValueError):
    """An evaluation that cannot run as asked; the message names the problem and the fix."""
