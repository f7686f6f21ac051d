"""Test-wide setup: 8 simulated CPU devices (must precede the first jax import), quicker XLA
compiles, and one XLA compilation cache per test run, shared by the xdist workers and the
CLIs the tests start:
several tests compile the same program (a tiny train step run again to resume, the same
sampler in two processes), and a compile is most of a small test's time. The cache directory
is new for every run, so nothing compiled by an older checkout can be picked up. And under
xdist, a module whose tests share a module-scoped fixture runs on one worker (see below)."""

import functools
import os
import shutil
import tempfile
from importlib.metadata import version
from pathlib import Path

import pytest

# Compiling is most of a test's time and the tests' models are tiny, so XLA:CPU is told to
# compile fast rather than to generate fast kernels: LLVM at -O0 (halved the remat test, 28 ->
# 17 s) and, where XLA still has them (jaxlib < 0.11, the oldest leg), the classic elemental
# fusion emitters instead of the MLIR ones (tests/test_moe.py 33 -> 20 s, the oldest leg's suite
# 12:55 -> 9:29 on 2 cores, 2026-11-27; jaxlib 0.11 removed the flag, and an unknown XLA flag
# aborts). Neither turns on fast-math; the suite passes with and without them.
# `DEFAULT_EMITTERS` is the compiler option a test that inspects XLA:CPU's default pipeline
# compiles with.
CLASSIC_EMITTERS = tuple(map(int, version("jaxlib").split(".")[:2])) < (0, 11)
FAST_COMPILE = "--xla_backend_optimization_level=0" + (
    " --xla_cpu_use_fusion_emitters=false" if CLASSIC_EMITTERS else ""
)
DEFAULT_EMITTERS = {"xla_cpu_use_fusion_emitters": True} if CLASSIC_EMITTERS else {}
# The GPU kit (benchmarks/gpu/run.sh) runs the tests marked `gpu` with JAX_PLATFORMS=cuda: the
# CPU-only flags stay off there (-O0 would apply to the GPU's generated kernels too).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
ON_CPU = os.environ["JAX_PLATFORMS"] == "cpu"
if ON_CPU:
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "")
        + f" --xla_force_host_platform_device_count=8 {FAST_COMPILE}"
    ).strip()
run_id = os.environ.get("PYTEST_XDIST_TESTRUNUID", f"pid{os.getpid()}")  # same for all workers
OWN_CACHE = os.path.join(tempfile.gettempdir(), f"moe_jax_tests_{run_id}")
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", OWN_CACHE)  # a user's own cache wins
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.5")

from moe_jax.process_setup import import_jax  # noqa: E402

import_jax()  # without the CUDA plugin's no-driver lines (the `aot` extra)
import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


def pytest_sessionfinish(session):
    """The controller (not an xdist worker) removes the cache this run made."""
    if not hasattr(session.config, "workerinput"):
        shutil.rmtree(OWN_CACHE, ignore_errors=True)


@functools.cache
def _has_module_fixture(path: Path) -> bool:
    return path.is_file() and 'scope="module"' in path.read_text(encoding="utf-8")


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook; without it, never called
def pytest_xdist_make_scheduler(config, log):
    """`pytest -n N` (xdist's default `--dist load`) hands out tests one by one, so the tests
    of a module that share a module-scoped fixture (a trained run, a saved checkpoint) land on
    both workers and each builds it (measured: test_train.py's runs, ~12 s of CPU, twice).
    Such a module goes to one worker whole, and first (xdist orders the units by their test
    count); every other test is still a unit of its own. Another --dist mode is left alone."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class ModulesWithSharedFixtures(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if _has_module_fixture(config.rootpath / path) else nodeid

    return ModulesWithSharedFixtures(config, log)


def pytest_runtest_logreport(report):
    """MOE_JAX_INSTAFAIL=1 (the GPU kit): print a failure's report as it happens, so a run
    killed at its time limit still shows why the tests before it failed."""
    if report.failed and os.environ.get("MOE_JAX_INSTAFAIL") == "1":
        print(f"\nFAILED {report.nodeid} ({report.when})\n{report.longreprtext}", flush=True)


@pytest.fixture
def ragged_on_cpu(monkeypatch):
    """The ragged exchange on this CPU, with the collective's stand-in (`ragged_stand_in`),
    for the tiny tests' exchanges too (smaller than a training step's, they would keep the
    buffers)."""
    from moe_jax import backends
    from moe_jax.model import exchange_rounds, experts
    from tests import ragged_stand_in

    monkeypatch.setitem(backends.EXCHANGE, "cpu", "ragged")
    monkeypatch.setattr(experts, "MAP_MIN_CAPACITY", 1)
    monkeypatch.setattr(exchange_rounds, "ragged_all_to_all", ragged_stand_in.ragged_all_to_all)
