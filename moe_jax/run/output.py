"""Outputs written whole or not at all, by every command that writes one (prepare, import,
export, quantize, plot), and the one-line endings of a command stopped or out of space.

    with new_output(out, "--out") as tmp:     # a new directory: write into tmp
        ...                                    # renamed to `out` when the block completes
    with new_file(path) as tmp_path:          # one file replaced in place (plot's PNGs)
        ...

The temporary sibling is named `.NAME.tmp-PID-RANDOM` and removed on any exception. SIGTERM
(and SIGHUP) raise `Interrupted` inside the block, so that removal runs too; SIGINT does the
same through KeyboardInterrupt. A signal that lands where Python cannot raise (a gc callback)
is raised again before the output is committed. Only kill -9 leaves a sibling behind: the
next command writing next to it removes every sibling whose process is gone (the pid in its
name).
`one_line` turns those endings into what a command prints and returns (`moe_jax.run.door`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import signal
import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from moe_jax.run.layout import RunError

NO_SPACE = (errno.ENOSPC, errno.EDQUOT)  # a full disk or a used-up quota: free space there
_SIBLING = re.compile(r"^\.(?P<name>.+)\.tmp-(?P<pid>\d+)-[0-9a-f]{12}$")


class Interrupted(BaseException):  # noqa: N818 (a signal, like KeyboardInterrupt)
    """SIGTERM or SIGHUP arrived inside a `stop_on_signals` block."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def _handlers(signals, handler) -> Iterator[None]:
    """`handler` for `signals` during the block, the old handlers restored after it. Outside
    the main thread (where Python refuses handlers) the signals stay as they are."""
    try:
        old = {s: signal.signal(s, handler) for s in signals}
    except ValueError:
        yield
        return
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


_QUIET: list[Callable[[object], bool]] = []  # quiet_unraisable's predicates


def quiet_unraisable(predicate: Callable[[object], bool]) -> None:
    """Process-wide: the unraisable exceptions (`sys.unraisablehook`'s argument) `predicate`
    accepts are not printed; every other one goes to the hook there was. One hook serves every
    predicate; it is put back if something replaced it since (pytest does, test by test)."""
    if predicate not in _QUIET:
        _QUIET.append(predicate)
    if getattr(sys.unraisablehook, "quiets", False):
        return
    previous = sys.unraisablehook

    def hook(unraisable) -> None:
        if not any(p(unraisable) for p in _QUIET):
            previous(unraisable)

    hook.quiets = True
    sys.unraisablehook = hook


class _Stopping:
    """The stopping signals of the outermost `stop_on_signals` block and those nested in it
    (the entry wrapper's, an output writer's): one record, so that a stop raised once is
    not raised again by a second signal while its cleanup runs."""

    def __init__(self):
        self.depth = 0
        self.noted: list[int] = []
        self.unwinding = False  # a stop was raised and has not been lost


_STOPPING = _Stopping()


def _noted_stop(unraisable) -> bool:
    if getattr(unraisable.exc_value, "noted_by_stop_on_signals", False):
        _STOPPING.unwinding = False  # raised where Python could not: the next signal raises
        return True
    return False


def stop_exception(signum: int) -> BaseException:
    """The exception that stops a command on signal `signum`: KeyboardInterrupt for SIGINT,
    else `Interrupted` (the door ends either as `error: stopped by SIGNAL`, 128 + signum)."""
    e = KeyboardInterrupt() if signum == signal.SIGINT else Interrupted(signum)
    e.noted_by_stop_on_signals = True
    return e


def _on_signal(signum, frame) -> None:
    _STOPPING.noted.append(signum)
    if not _STOPPING.unwinding:
        _STOPPING.unwinding = True
        raise stop_exception(signum)
    # A second signal while the first one's stop unwinds: the cleanup (a writer's threads
    # joined, a temporary sibling removed) runs to its end; kill -9 still ends it at once.


@contextlib.contextmanager
def stop_on_signals() -> Iterator[Callable[[], None]]:
    """SIGTERM and SIGHUP raise `Interrupted`, SIGINT KeyboardInterrupt, in the main thread
    for the block's duration (SIGTERM's default action would end the process without running
    any cleanup). Once one has been raised, further signals are only noted: the stop's
    cleanup is not cut short by a second one. A handler runs wherever the main thread is,
    and where that is a gc callback or a `__del__` (jax's `_xla_gc_callback` was one) Python
    cannot raise: it printed the exception as "ignored" and carried on, and an export
    SIGTERM'd there finished its output. So each signal is also noted, such an exception is
    kept from printing (and the next signal raises again), and the yielded `check()` raises
    the first one noted again: the block calls it before it commits anything (a signal noted
    after the commit ends nothing: the output is whole). Blocks nest; the outermost one's
    end forgets the signals noted."""

    def check() -> None:
        if _STOPPING.noted:
            _STOPPING.unwinding = True
            raise stop_exception(_STOPPING.noted[0])

    quiet_unraisable(_noted_stop)
    _STOPPING.depth += 1
    try:
        with _handlers((signal.SIGINT, signal.SIGTERM, signal.SIGHUP), _on_signal):
            yield check
    finally:
        _STOPPING.depth -= 1
        if _STOPPING.depth == 0:
            _STOPPING.noted.clear()
            _STOPPING.unwinding = False


STOPPING = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def signals_deferred() -> Iterator[None]:
    """Stopping signals held back for the block's duration and raised again as it ends, to
    their handlers then: for steps that must not be cut in half, such as starting worker
    processes. (Python runs handlers in the main thread, whatever thread a signal reached,
    so a thread's signal mask would not hold them back.)"""
    pending: list[int] = []
    with _handlers(STOPPING, lambda signum, frame: pending.append(signum)):
        yield
    if pending:
        signal.raise_signal(pending[0])


def worker_signals() -> None:
    """In a worker process: Ctrl-C is its parent's to handle (the terminal sends it to the
    whole process group)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def pid_alive(pid: int) -> bool:
    """Whether process `pid` runs. A zombie does not: a killed command stays one until its
    parent reaps it, which a parent reading the command's output does only after the pipes
    close, i.e. after the command's workers have noticed it is gone."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    with contextlib.suppress(OSError, IndexError):
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    return True


def remove_dead_siblings(out: Path) -> None:
    """Remove the temporary siblings of `out` left by processes that are gone (kill -9)."""
    with contextlib.suppress(OSError):
        for entry in out.parent.iterdir():
            m = _SIBLING.match(entry.name)
            if m and m["name"] == out.name and not pid_alive(int(m["pid"])):
                if entry.is_dir() and not entry.is_symlink():
                    shutil.rmtree(entry, ignore_errors=True)
                else:
                    entry.unlink(missing_ok=True)


def check_place(directory: Path, what: str) -> None:
    """RunError unless `directory` exists as a writable directory or `make_dir` could make
    it (its nearest existing ancestor is one): checked, not made, so that a command whose
    work is long (an evaluation) fails before it rather than after, with nothing written."""
    path = Path(directory).absolute()
    for place in (path, *path.parents):
        if place.is_dir():
            if os.access(place, os.W_OK | os.X_OK):
                return
            reason = f"'{place}' is not writable"
            break
        if place.exists() or place.is_symlink():
            reason = f"'{place}' is a file, not a directory"
            break
    else:
        return
    raise RunError(f"cannot create {what} '{directory}' ({reason}); choose a writable path")


def sibling_name(out: Path) -> Path:
    return out.parent / f".{out.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}"


@contextlib.contextmanager
def new_output(out: Path, what: str) -> Iterator[Path]:
    """A new directory `out`, written into a temporary sibling that becomes `out` by a rename
    when the block completes; on any exception or stopping signal the sibling is removed and
    `out` never exists. An empty `out` (made by a caller) is replaced; the caller refuses a
    non-empty one before the work starts. Not `tempfile.mkdtemp`, whose mode 700 the renamed
    output would keep: this one gets the user's umask."""
    from moe_jax.run.lock import make_dir  # here: lock imports jax, and the commands' door
    # (moe_jax.run.door) imports this module before a command has checked its input

    out = Path(out)
    new_parents = [d for d in out.absolute().parents if not d.exists()]  # removed on failure
    make_dir(out.parent, f"the parent directory of {what}")
    remove_dead_siblings(out)
    tmp = sibling_name(out)
    try:  # the signals raise from before the sibling exists: a SIGTERM never leaves it
        with stop_on_signals() as check:
            make_dir(tmp, f"a temporary directory next to {what}")
            yield tmp
            check()
            if out.is_dir() and not out.is_symlink() and not any(out.iterdir()):
                out.rmdir()
            tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        for d in new_parents:  # innermost first
            with contextlib.suppress(OSError):
                d.rmdir()
        raise


@contextlib.contextmanager
def new_file(path: Path) -> Iterator[Path]:
    """`path` written whole: the block writes the yielded temporary sibling, renamed over
    `path` when it completes, removed on any exception or stopping signal."""
    path = Path(path)
    remove_dead_siblings(path)
    tmp = sibling_name(path)
    try:
        with stop_on_signals() as check:
            yield tmp
            check()
            os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text(path: Path, text: str) -> None:
    """`path`'s new text, whole or not at all (a full disk leaves the old file or none)."""
    with new_file(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


def no_space(e: BaseException | None) -> bool:
    """Whether `e` or what caused it is a full disk: an OSError from Python, or a ValueError
    from TensorStore that names the OS error code."""
    while e is not None:
        if isinstance(e, OSError) and e.errno in NO_SPACE:
            return True
        if any(f"os_error_code='{code}'" in str(e) for code in NO_SPACE):
            return True
        e = e.__cause__ or e.__context__
    return False


def disk_problem(e: BaseException) -> str | None:
    """What an exception says about the disk written to (full, read-only), or None."""
    if no_space(e):
        return "no space left on the device, or the quota is used up"
    if isinstance(e, OSError) and e.errno == errno.EROFS:
        return "read-only file system"
    return None


def stop_in(e: BaseException) -> BaseException | None:
    """The stop (KeyboardInterrupt, `Interrupted`) that `e` is or that its chain of causes
    and contexts holds, else None. A library that catches every exception wraps a stop that
    lands inside it in a plain one: Orbax's array read turns it into
    `Exception("Encountered error while reading array index ...") from` the stop, which must
    still end the command as a stop, never as a damaged checkpoint."""
    seen, todo = set(), [e]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        if isinstance(e, (KeyboardInterrupt, Interrupted)):
            return e
        seen.add(id(e))
        todo += [e.__context__, e.__cause__]  # the cause looked at first
    return None


def raise_stop_in(e: BaseException) -> None:
    """Raise the stop `e` holds (`stop_in`), if it holds one: before `e` is told as a
    failure."""
    if (stop := stop_in(e)) is not None:
        raise stop from None


def one_line(e: BaseException, out: str | Path | None = None) -> tuple[str, int] | None:
    """A command's ending for a stopping signal (also one wrapped in another exception:
    `stop_in`) or a disk it cannot write: (the line to print, the exit status), or None for
    any other exception (the CLI's own handling)."""
    kept = f"; nothing was written to '{out}'" if out is not None else ""
    e = stop_in(e) or e
    if isinstance(e, Interrupted):
        return f"stopped by {signal.Signals(e.signum).name}{kept}", 128 + e.signum
    if isinstance(e, KeyboardInterrupt):
        return f"stopped by SIGINT (Ctrl-C){kept}", 128 + signal.SIGINT
    if problem := disk_problem(e):
        where = f" '{e.filename}'" if getattr(e, "filename", None) else ""
        fix = "choose a writable place" if "read-only" in problem else "free some space there"
        return f"cannot write{where} ({problem}){kept}; {fix}", 1
    return None
