"""One writer per run directory, and directories made safely: the run lock, process 0's
agreement in a multi-process run, directories made with a one-line error.

One writer: `store.Checkpointer` holds the run's `RunLock` from opening to `close()`, so a
second training process on the same run_dir stops before writing anything. Readers (loading,
hence sampling, quantising and exporting) take no lock: they can read a run that is training.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import time
from pathlib import Path

import jax
import numpy as np

from moe_jax.run.layout import LOCK_FILE, RunError


def make_dir(path: Path, what: str) -> None:
    """mkdir -p, with an OSError (a file in the way, no permission) as a one-line RunError."""
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        reason = "a file of that name is in the way" if path.is_file() else e.strerror
        raise RunError(
            f"cannot create {what} '{path}' ({reason}); choose a writable path"
        ) from None


class RunLock:
    """The right to train in a run directory: an exclusive `fcntl.flock` on RUN_DIR/train.lock
    from `RunLock(run_dir)` to `release()`; RunError if another process holds it.

    The kernel drops a flock when its holder exits, however it dies (kill -9, the OOM killer),
    so the lock file of a dead run is free by construction and simply taken over. The file
    records the holder's pid and host for the message of a run refused, and is removed on
    release. On NFS, Linux emulates flock with NFS byte-range locks, which exclude other hosts
    too; there the lock of a client that dies holds until the server notices (NFSv4: one lease
    time, typically 90 s).
    """

    def __init__(self, run_dir: Path):
        self.path = run_dir / LOCK_FILE
        while True:
            try:
                fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except OSError as e:
                raise RunError(
                    f"cannot create the lock file '{self.path}' ({e.strerror}); choose a "
                    "writable run_dir"
                ) from None
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = os.read(fd, 512).decode(errors="replace").strip() or "pid not written yet"
                os.close(fd)
                raise RunError(
                    f"run_dir '{run_dir}' is in use by another training run ({holder}); wait "
                    "for it to finish or stop it (SIGTERM saves a checkpoint), or choose "
                    "another run_dir"
                ) from None
            except OSError as e:
                os.close(fd)
                raise RunError(
                    f"cannot lock '{self.path}' ({e.strerror}); choose a run_dir on a "
                    "filesystem with file locks"
                ) from None
            # A holder removes the file as it lets go: a lock taken on the removed file just
            # after that would exclude no one, so lock the file now at that path instead.
            try:
                current = os.path.samestat(os.fstat(fd), os.stat(self.path))
            except FileNotFoundError:
                current = False
            if current:
                break
            os.close(fd)
        since = time.strftime("%Y-%m-%d %H:%M:%S")
        holder = f"pid {os.getpid()} on host {socket.gethostname()}, since {since}"
        # On a full disk (a rerun after a failed save) even this may not fit: the lock holds
        # without it, and opening the run goes on to delete the failed save's files.
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
            os.write(fd, holder.encode())
        self._fd = fd

    def release(self) -> None:
        self.path.unlink(missing_ok=True)  # while still locked: see the check above
        os.close(self._fd)


def on_process_0(open_run, run_dir: Path) -> RunLock | None:
    """`open_run()` on process 0 only, the one that writes the run's own files and holds its
    lock. In a multi-process run the others learn whether it succeeded (a collective, which
    also waits for it), so that all of them stop on its RunError instead of waiting for
    process 0 in the next collective."""
    lock, error = None, None
    if jax.process_index() == 0:
        try:
            lock = open_run()
        except RunError as e:
            error = e
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        if multihost_utils.broadcast_one_to_all(np.int32(error is not None)) and error is None:
            error = RunError(
                f"process 0 could not open run_dir '{run_dir}' for training; its error line "
                "says why and what to do"
            )
    if error is not None:
        raise error
    return lock
