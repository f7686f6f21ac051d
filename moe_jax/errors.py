"""The one base of the project's own errors, and what a command does with them.

Every error that means "this input, run, config or machine cannot do what was asked" (a bad
config, a damaged run, data a tokenizer cannot read, a kernel this backend lacks, a model
that cannot be quantised, an evaluation, import or sampling that cannot run) is a
`MoeJaxError`, whose message is one line naming the problem and the fix. The commands'
entry wrapper (`moe_jax.run.door`) prints any of them as `error: ...` and exits with its
`exit_code`; every other exception is a bug and stays a traceback. Most subclasses are also
`ValueError`s, as they were before this base existed, so that callers catching those still
work.

Imports nothing: the config module, which every command reads before jax, raises these.
"""

from __future__ import annotations


class MoeJaxError(Exception):
    """A failure of the input or the environment, not of the code; the message says what
    to change. Exit status 2 (bad input) unless a subclass says otherwise."""

    exit_code = 2
