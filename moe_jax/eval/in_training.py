"""The trainer's downstream eval: harness tasks on the live params at eval steps.

    tasks = TaskEval.start(cfg, tokenizer)      # None without eval.tasks; ConfigError if bad
    if tasks.due(step, final):
        record = tasks.run(graphdef, params, mesh, step)   # {"kind": "downstream", ...}

`eval.tasks` are loaded and checked once, before the run directory is touched (an unknown task,
more few-shot examples than a task has, or no harness installed stop the run at its start,
as a bad config does). At every `eval.every` steps (0: train.eval_every) and at the end the
params of that step are scored through the same backend as `python -m moe_jax.eval` with the
same tasks, so the numbers are the ones the command gives for that step's checkpoint. The
programs are compiled at the first eval and reused: one sampler is kept, and each eval puts
that step's params into it (split into blocks, a copy of the weights held during the eval
only). A task the run's tokenizer cannot write (a char vocabulary) ends the downstream evals
with one line, not the training.
"""

from __future__ import annotations

import contextlib
import importlib.util

from flax import nnx

from moe_jax.config import Config, ConfigError
from moe_jax.inference.sampling import Sampler
from moe_jax.tokenizer import DataError, Tokenizer

KIND = "downstream"  # the records' kind in metrics.jsonl


class TaskEval:
    def __init__(self, cfg: Config, tokenizer: Tokenizer, suite):
        self.cfg, self.tokenizer, self.suite = cfg, tokenizer, suite
        self.lm = None  # the backend, made at the first eval (its sampler needs params)
        self.failed: str | None = None  # why the downstream evals stopped, if they did

    @classmethod
    def start(cls, cfg: Config, tokenizer: Tokenizer) -> TaskEval | None:
        """The run's task eval, its tasks loaded and checked; None without eval.tasks."""
        e = cfg.eval
        if not e.tasks:
            return None
        if importlib.util.find_spec("lm_eval") is None:
            raise ConfigError(
                "eval.tasks needs the evaluation harness: pip install 'moe_jax[eval]', or set "
                'eval.tasks=""'
            )
        from moe_jax.eval import EvalError
        from moe_jax.eval.tasks import load_suite

        try:
            return cls(cfg, tokenizer, load_suite(e.tasks, e.include_path, e.num_fewshot))
        except EvalError as err:
            raise ConfigError(f"eval.tasks: {err}") from None

    def due(self, step: int, final: bool) -> bool:
        every = self.cfg.eval.every or self.cfg.train.eval_every
        return self.failed is None and (step % every == 0 or final)

    def run(self, graphdef, params, mesh, step: int) -> dict | None:
        """The tasks' metrics for the params of `step`, as a metrics record; None (and
        `failed` set) if the tasks cannot be run with this run's tokenizer."""
        from moe_jax.eval import EvalError
        from moe_jax.eval.backend import MoeJaxLM
        from moe_jax.eval.tasks import metrics

        fresh = Sampler(nnx.merge(graphdef, params), mesh=mesh)
        if self.lm is None:
            e = self.cfg.eval
            self.lm = MoeJaxLM(sampler=fresh, tokenizer=self.tokenizer, batch_size=e.batch_size)
        try:
            with self._params_of(fresh):
                results = self.suite.run(self.lm, self.cfg.eval.limit)
        except (EvalError, DataError) as err:
            self.failed = str(err)
            return None
        return {"kind": KIND, "step": step, **metrics(results)}

    @contextlib.contextmanager
    def _params_of(self, fresh: Sampler):
        """The kept sampler (whose programs are compiled) with `fresh`'s params, for the
        block; released after it, so that no second copy stays between evals."""
        kept = self.lm.scorer.sampler
        kept.params, kept.param_blocks = fresh.params, fresh.param_blocks
        try:
            yield
        finally:
            kept.params, kept.param_blocks = None, None
