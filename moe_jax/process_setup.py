"""Process setup: huge-page malloc for XLA:CPU, a quiet jax import, quiet gloo collectives.

XLA:CPU allocates each step's large temporaries (activations, gradients, attention logits) with
glibc malloc, which serves big blocks with fresh `mmap`s and unmaps them on free, so every step
page-faults its whole working set in again, 4 KiB at a time. The medium training benchmark took
1.2 M page faults per step (about 5 GB) and a third of its time went to the kernel. glibc's
`glibc.malloc.hugetlb=1` tunable asks for transparent huge pages on the memory malloc maps:
the same step then takes 0.12 M faults and runs 1.3-1.4x faster, with the same peak RSS.

A glibc tunable is read only at process start, so the CLIs call `reexec_with_hugepages()`
first thing: it restarts the interpreter once with the tunable added to `GLIBC_TUNABLES`
(same pid, arguments, stdin/stdout). Elsewhere (notebooks, your own scripts) set it yourself:
`GLIBC_TUNABLES=glibc.malloc.hugetlb=1 python ...`. `MOE_JAX_HUGEPAGES=0` turns it off.
"""

from __future__ import annotations

import atexit
import contextlib
import glob
import importlib.util
import os
import platform
import re
import sys
import tempfile
import threading
from collections.abc import Callable

TUNABLE = "glibc.malloc.hugetlb=1"
# What jax's CUDA plugin logs from each of its extension modules as jax is imported on a
# machine without an NVIDIA driver (the `aot` extra compiles for GPUs without one).
_NO_DRIVER_NOISE = re.compile(r"cudart_stub\.cc|All log messages before absl::InitializeLog")


def hugepages_enabled() -> bool:
    return TUNABLE in os.environ.get("GLIBC_TUNABLES", "").split(":")


def reexec_with_hugepages() -> None:
    """Restart this process with huge-page malloc unless it has it, is off glibc, or opted out."""
    if (
        hugepages_enabled()
        or os.environ.get("MOE_JAX_HUGEPAGES", "1") == "0"
        or sys.platform != "linux"
        or platform.libc_ver()[0] != "glibc"
    ):
        return
    current = os.environ.get("GLIBC_TUNABLES")
    os.environ["GLIBC_TUNABLES"] = f"{current}:{TUNABLE}" if current else TUNABLE
    sys.stdout.flush()
    sys.stderr.flush()
    os.execv(sys.executable, [sys.executable, *sys.orig_argv[1:]])


@contextlib.contextmanager
def held_stderr(keep_line: Callable[[str], bool] = lambda line: False):
    """Hold what native code (libtpu, XLA, the CUDA plugin) writes to fd 2 inside the block,
    then write back only the lines `keep_line` accepts (by default none)."""
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile(mode="w+b") as held:
        os.dup2(held.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            held.seek(0)
            text = held.read().decode(errors="replace")
            sys.stderr.write("".join(line for line in text.splitlines(True) if keep_line(line)))


def accelerator_present() -> bool:
    """Whether this machine has a TPU or an NVIDIA GPU attached (their device files)."""
    patterns = ("/dev/accel[0-9]*", "/dev/vfio/[0-9]*", "/dev/nvidia[0-9]*")
    return any(glob.glob(p) for p in patterns)


_platform_reason = "jax imported before moe_jax chose a platform"


def platform_line() -> str:
    """The platform jax runs on, its devices and why it was chosen, in one line (a GPU or TPU
    machine whose device files are missing, or a JAX_PLATFORMS left set, runs on the CPU)."""
    import jax

    devices = jax.devices()
    return (
        f"platform: {jax.default_backend()}, {len(devices)} x {devices[0].device_kind} "
        f"({_platform_reason})"
    )


def import_jax() -> None:
    """Import jax for a CLI, quietly: call it before the first jax import; the CLIs do once
    their config and flags are checked, as the import takes seconds.

    On a machine without a TPU or GPU, the CPU is the platform (`JAX_PLATFORMS=cpu` unless the
    environment already names one): with the `aot` extra installed, libtpu and the CUDA plugin
    would otherwise each try to start on hardware that is not there and print a page of
    warnings and tracebacks. The CUDA plugin still logs that it found no driver, once as
    jax imports and once as it registers with jax; both happen here, with fd 2 held, and only
    those lines are dropped. Registering the plugins starts no backend, so a multi-process run
    can still join (`jax.distributed.initialize`) afterwards."""
    global _platform_reason
    if "jax" in sys.modules:
        return
    if "JAX_PLATFORMS" in os.environ:
        _platform_reason = f"JAX_PLATFORMS={os.environ['JAX_PLATFORMS']} in the environment"
    elif accelerator_present():
        _platform_reason = "accelerator device files found"
    else:
        os.environ["JAX_PLATFORMS"] = "cpu"
        _platform_reason = "no /dev/accel*, /dev/vfio/* or /dev/nvidia* found"
    if importlib.util.find_spec("jax_cuda12_plugin") is None:
        return
    with held_stderr(lambda line: not _NO_DRIVER_NOISE.search(line)):
        import jax  # noqa: F401
        from jax._src import xla_bridge  # jax has no public call that only registers plugins

        xla_bridge._discover_and_register_pjrt_plugins()


# What gloo (XLA:CPU's cross-process collectives) prints on stdout each time it connects a
# group of processes, "[Gloo] Rank 0 is connected to 3 peer ranks. Expected number of connected
# peer ranks is : 3": a few lines per process as a run starts, more as new programs first run.
# jaxlib's gloo writes them with std::cout and has no log level that turns them off. Its
# threads (one per local device) write at once, so the pieces of two lines can interleave,
# but a line never mixes with Python's: C's stdout buffer goes out whole at each line end.
_GLOO_PIECES = re.compile(
    rb"(?:\[Gloo\] Rank | is connected to | peer ranks\. "
    rb"|Expected number of connected peer ranks is : |\d)+"
)


def is_gloo_noise(line: bytes) -> bool:
    """A line made of pieces of gloo's reports only (a line of digits could be anyone's). A
    peer that cannot connect is an error of the collective, which still shows."""
    return _GLOO_PIECES.fullmatch(line) is not None and not line.isdigit()


def drop_gloo_noise() -> None:
    """For the rest of the process, pass what is written to fd 1 through a thread that drops
    `is_gloo_noise` lines. Gloo prints from C++ whenever a collective first runs, so only the
    file descriptor can hold its lines back. Everything else comes out in order, a line once
    it is whole (stderr, where errors go, is not touched); at exit the pipe is drained."""
    sys.stdout.flush()
    stdout = os.fdopen(os.dup(1), "wb")
    read_end, write_end = os.pipe()
    os.dup2(write_end, 1)
    os.close(write_end)

    def pump() -> None:
        with open(read_end, "rb", buffering=0) as pipe:
            unfinished = b""
            while chunk := pipe.read(1 << 16):
                *lines, unfinished = (unfinished + chunk).split(b"\n")
                stdout.write(b"".join(s + b"\n" for s in lines if not is_gloo_noise(s)))
                stdout.flush()
            stdout.write(unfinished)
            stdout.flush()

    thread = threading.Thread(target=pump, name="drop_gloo_noise", daemon=True)
    thread.start()

    def restore() -> None:
        sys.stdout.flush()
        os.dup2(stdout.fileno(), 1)  # closes the pipe's last write end: the thread drains it
        thread.join(timeout=5)

    atexit.register(restore)
