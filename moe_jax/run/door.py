"""The one door every command goes through: how a command ends when it cannot finish.

    @command
    def main(argv):                 # the command's body: parse, check, work, return 0
        args = parse(argv)
        writes(args.out)            # where it writes, for the line a stop prints
        ...

`main(argv)` then returns the exit status instead of raising, for every command alike:

- a project error (`moe_jax.errors.MoeJaxError`: a bad config, run, input, kernel, ...):
  `error: MESSAGE` on one line, exit 2 (1 for the training errors after which the run's last
  checkpoint is whole);
- SIGTERM, SIGINT or SIGHUP at any moment: the command's cleanup runs (the signal is raised
  in the main thread, `run.output.stop_on_signals`), then `error: stopped by SIGNAL` on one
  line, naming the output left unwritten, exit 128 + the signal's number;
- a full disk, a used-up quota or a read-only file system: one line naming the file, exit 1;
- anything else is a bug and stays a traceback.

The commands keep no lists of the errors they turn into a line: a new error type is a
`MoeJaxError` and ends the same way everywhere.
"""

from __future__ import annotations

import argparse
import contextvars
import functools
import sys
from collections.abc import Callable
from pathlib import Path

from moe_jax.errors import MoeJaxError
from moe_jax.run.output import one_line, stop_on_signals

# The output place the running command named (`writes`); None: none, or not yet known.
_OUTPUT: contextvars.ContextVar[Path | None] = contextvars.ContextVar("output", default=None)


def writes(out: str | Path | None) -> None:
    """Tell the door where this command writes its output: a stop before the output exists
    says that nothing was written there."""
    _OUTPUT.set(None if out is None else Path(out))


def error_line(message: str) -> str:
    """`message` as the one line a command prints: its lines joined (a library's message
    may run over several)."""
    return " ".join(part.strip() for part in str(message).splitlines() if part.strip())


def say(message: str, code: int = 2) -> int:
    """Print `error: message` on one line to stderr; -> `code`, for the command to return."""
    print(f"error: {error_line(message)}", file=sys.stderr, flush=True)
    return code


def ending(e: BaseException) -> int | None:
    """Print the one line for `e` and return the exit status, or None for a bug."""
    if isinstance(e, MoeJaxError):
        return say(str(e) or type(e).__name__, e.exit_code)
    out = _OUTPUT.get()
    unwritten = out if out is not None and not out.exists() else None
    if (line := one_line(e, unwritten)) is None:
        return None
    return say(*line)


def run(call: Callable[[], int | None]) -> int:
    """`call()`'s exit status (None is 0), or its ending's (see the module doc)."""
    token = _OUTPUT.set(None)
    try:
        with stop_on_signals() as check:
            code = call()
            check()  # a signal whose stop was lost (raised in a gc callback) still stops
        return 0 if code is None else code
    except BaseException as e:
        if isinstance(e, SystemExit) or (code := ending(e)) is None:
            raise
        return code
    finally:
        _OUTPUT.reset(token)


def command(body: Callable[..., int | None]) -> Callable[..., int]:
    """`body` (a command's main) behind the door: same arguments, returns the exit status."""

    @functools.wraps(body)
    def main(*args, **kwargs) -> int:
        return run(functools.partial(body, *args, **kwargs))

    main.door = True  # tests/test_chaos.py finds every command's main marked
    return main


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every command's --help: the description as written, and each option's default where it
    has one worth saying (not None, not a switch's False, not already in its help)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        shown = default not in (None, False, argparse.SUPPRESS) and "default" not in text
        if shown and action.option_strings and action.nargs != 0:
            return f"{text} (default: %(default)s)"
        return text
