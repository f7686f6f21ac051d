"""Harness tasks found, checked and run: what the command and the trainer's eval share.

    suite = load_suite("hellaswag,arc_easy", include_path=None, num_fewshot=5)  # EvalError
    results = suite.run(lm, limit=100)          # the harness's results dict
    metrics(results)                             # {"hellaswag/acc": 0.25, ...}

Tasks are looked up in the harness's own task index plus `include_path` (a directory of task
YAML files: a local task reads its data with `dataset_path: json` and
`dataset_kwargs: {data_files: ...}`). Everything that can be checked before a model is
loaded is: each name is a task, group or tag the index knows (else the nearest names), and
no task is asked for more few-shot examples than its few-shot split holds (besides the
document evaluated, where that split is the evaluated one). The tasks' data is loaded once
per suite, so the trainer evaluates the same loaded tasks at every eval step.
"""

from __future__ import annotations

import difflib
import functools
from dataclasses import dataclass

from lm_eval import simple_evaluate
from lm_eval.api.model import LM
from lm_eval.tasks import TaskManager

from moe_jax.eval import EvalError


def task_manager(include_path: str | None, names: tuple[str, ...] = ()) -> TaskManager:
    """The harness's task index (its own tasks and `include_path`'s), built once a process:
    indexing the harness's ~15,000 task files takes 8-24 s on 2 cores. Where every one of
    `names` is a task of `include_path`'s, that directory's index alone: the same tasks
    (the harness gives include_path's precedence over its own), without the wait. A group
    there may name the harness's tasks, so groups take the whole index."""
    if include_path and names:
        own = _index(include_path, False)
        if set(names) <= set(own.all_subtasks):
            return own
    return _index(include_path, True)


@functools.cache
def _index(include_path: str | None, harness_tasks: bool) -> TaskManager:
    return TaskManager(include_path=include_path, include_defaults=harness_tasks)


def task_names(tasks: str) -> list[str]:
    """'a,b' -> ['a', 'b']; EvalError for an empty list or entry."""
    names = [t.strip() for t in tasks.split(",")]
    if not all(names):
        raise EvalError(f"tasks '{tasks}' has an empty name; give task names separated by commas")
    return names


def check_known(names: list[str], include_path: str | None, flag: str = "--include-path") -> None:
    """EvalError, naming the nearest known names, for a name the task index lacks (`flag`:
    the command's option for a directory of task YAMLs)."""
    manager = task_manager(include_path, tuple(names))
    for name in names:
        if name not in manager.all_tasks:
            close = difflib.get_close_matches(name, manager.all_tasks, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            where = "" if include_path else f" (tasks of your own: {flag} DIR of YAMLs)"
            raise EvalError(f"unknown task '{name}'{hint}{where}")


@dataclass
class Suite:
    """Loaded tasks, ready to run: `objects` are what the names stand for (tasks, groups)."""

    names: list[str]
    objects: list
    manager: TaskManager
    num_fewshot: int | None

    def run(
        self, lm: LM, limit: int | None, bootstrap_iters: int = 0, log_samples=False, **options
    ) -> dict:
        """The harness's evaluation of every task with `lm` (`limit`: documents per task;
        `log_samples`: keep each document's requests and answers; `options`:
        simple_evaluate's, e.g. apply_chat_template)."""
        return simple_evaluate(
            model=lm,
            tasks=self.objects,
            num_fewshot=self.num_fewshot,
            limit=limit,
            bootstrap_iters=bootstrap_iters,
            log_samples=log_samples,
            task_manager=self.manager,
            **options,
        )


def load_suite(tasks: str, include_path: str | None, num_fewshot: int | None) -> Suite:
    """The tasks `tasks` names (comma-separated), loaded with their data and checked."""
    names = task_names(tasks)
    manager = task_manager(include_path, tuple(names))
    check_known(names, include_path)
    objects = []
    for name in names:
        loaded = manager.load(name)
        group = loaded["groups"].get(name)
        objects += [group] if group is not None else list(loaded["tasks"].values())
        for task_name, task in loaded["tasks"].items():
            _check_fewshot(task_name, task, num_fewshot)
    return Suite(names, objects, manager, num_fewshot)


def _check_fewshot(name: str, task, asked: int | None) -> None:
    """EvalError if the task would be asked for more few-shot examples than it has: `asked`
    (the command's), unless the task fixes 0, else the task's own number."""
    own = task.get_config("num_fewshot")
    n = own if asked is None or own == 0 else asked
    if not n:
        return
    c, fewshot = task.config, task.fewshot_cfg
    split = fewshot.split
    if split is None and fewshot.samples is None:  # the harness's fallback (Task.fewshot_docs)
        split = c.training_split or c.validation_split or c.test_split
    pool = task.fewshot_docs()
    same = split is not None and split == (c.test_split or c.validation_split)
    room = (0 if pool is None else len(pool)) - same
    if n > room:
        source = f"its '{split}' split" if split else "its few-shot samples"
        besides = " besides the document evaluated" if same else ""
        raise EvalError(
            f"{n}-shot: task '{name}' has {max(room, 0)} example(s) in {source}{besides}; "
            f"lower --num-fewshot to at most {max(room, 0)}"
        )


def metrics(results: dict) -> dict[str, float]:
    """The harness's numbers as flat names: '<task>/<metric>' ('/<filter>' unless the
    filter is 'none'), stderrs left out."""
    out = {}
    for task, values in results["results"].items():
        for key, value in values.items():
            metric, sep, filt = key.partition(",")
            if not sep or "_stderr" in metric or not isinstance(value, int | float):
                continue
            out[f"{task}/{metric}" + ("" if filt == "none" else f"/{filt}")] = float(value)
    return out
