"""Evaluate a run's checkpoint on lm-evaluation-harness tasks; the results JSON goes into the
run directory.

    python -m moe_jax.eval RUN_DIR --tasks hellaswag,arc_easy [--num-fewshot N] [--limit N]
        [--batch-size N] [--step N] [--include-path DIR] [--apply-chat-template]
        [section.key=value ...]             # mesh.*, model.dtype, sample.weights, as sample.py

writes RUN_DIR/eval/STEP/results_<date>.json (the harness's results, plus how many requests
this backend answered in how many seconds with how many compiled programs) and prints each
task's metrics. Needs the `eval` extra (`pip install 'moe_jax[eval]'`: lm-eval). Errors
(an unknown task, a tokenizer that cannot write a task's text, more few-shot examples than a
task has, a bad run or override) print one `error: ...` line, exit 2 and write nothing.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import sys
from pathlib import Path

from moe_jax.run.door import HelpFormatter, command, writes

COUNT_FLAGS = {"limit": 1, "batch_size": 1, "num_fewshot": 0, "step": 0, "bootstrap_iters": 0}


def parse_args(argv: list[str]) -> argparse.Namespace:
    summary = " ".join(__doc__.split("\n\n")[0].split())  # the first paragraph, whole
    p = argparse.ArgumentParser(
        prog="moe-jax eval", description=summary, formatter_class=HelpFormatter
    )
    p.add_argument("run_dir", help="run directory written by train.py (or imported)")
    p.add_argument("--tasks", required=True, help="harness task names, comma-separated")
    p.add_argument("--num-fewshot", type=int, help="few-shot examples (default: each task's)")
    p.add_argument("--limit", type=int, help="documents per task (default: all)")
    p.add_argument("--batch-size", type=int, default=8, help="rows per compiled program")
    p.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    p.add_argument("--include-path", help="a directory of task YAML files of your own")
    p.add_argument("--apply-chat-template", action="store_true", help="prompts as chat turns")
    p.add_argument("--seed", type=int, default=0, help="seed of sampled generation")
    p.add_argument("--bootstrap-iters", type=int, default=100000, help="for stderrs; 0 = none")
    p.add_argument(
        "overrides",
        nargs="*",
        metavar="section.key=value",
        help="mesh.*, model.dtype and sample.* overrides, e.g. mesh.expert=2 sample.weights=int8",
    )
    return p.parse_intermixed_args(argv)


def check_flags(args: argparse.Namespace) -> str | None:
    """The first flag out of its range, as a message (before anything slow is imported)."""
    for name, least in COUNT_FLAGS.items():
        value = getattr(args, name)
        if value is not None and value < least:
            return f"--{name.replace('_', '-')} must be >= {least}, got {value}"
    if args.include_path is not None and not Path(args.include_path).is_dir():
        return f"--include-path '{args.include_path}' is not a directory"
    return None


@command
def main(argv: list[str]) -> int:
    args = parse_args(argv)
    from moe_jax.config import Config, sampling_config
    from moe_jax.eval import EvalError

    sampling_config(Config(), args.overrides)
    if problem := check_flags(args):
        raise EvalError(problem)
    if importlib.util.find_spec("lm_eval") is None:
        raise EvalError("the evaluation harness is not installed: pip install 'moe_jax[eval]'")
    return evaluate(args)


def evaluate(args: argparse.Namespace) -> int:
    from lm_eval.utils import handle_non_serializable

    from moe_jax.eval.backend import MoeJaxLM
    from moe_jax.eval.tasks import load_suite, metrics
    from moe_jax.inference.load import read_run_meta
    from moe_jax.run.output import check_place, new_file

    suite = load_suite(args.tasks, args.include_path, args.num_fewshot)
    # The step pinned first, so that the results go under the step that was evaluated.
    step = read_run_meta(args.run_dir, args.step)["step"]
    stamp = datetime.datetime.now().strftime("%Y-%m-%dT%H-%M-%S")
    out = Path(args.run_dir) / "eval" / str(step) / f"results_{stamp}.json"
    check_place(out.parent, "the results' directory")  # before the scoring, not after it
    writes(out)
    overrides = dict(item.split("=", 1) for item in args.overrides)
    lm = MoeJaxLM(args.run_dir, step, args.batch_size, seed=args.seed, **overrides)
    results = suite.run(
        lm,
        args.limit,
        args.bootstrap_iters,
        apply_chat_template=args.apply_chat_template,
        fewshot_as_multiturn=args.apply_chat_template,
    )
    results["moe_jax"] = {"run": args.run_dir, "step": step, **lm.stats()}
    out.parent.mkdir(parents=True, exist_ok=True)
    with new_file(out) as tmp:
        text = json.dumps(results, indent=2, default=handle_non_serializable)
        tmp.write_text(text + "\n", encoding="utf-8")
    for name, value in metrics(results).items():
        print(f"{name}: {value:.4f}")
    stats = results["moe_jax"]
    rate = stats["requests"] / max(stats["seconds"], 1e-9)
    print(
        f"{stats['requests']} requests in {stats['seconds']:.1f} s ({rate:.1f}/s, compiling "
        f"included), {stats['programs']} compiled programs; results: {out}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
