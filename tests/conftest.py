"""Test-wide setup: 8 simulated CPU devices (must precede the first jax import), quicker XLA
compiles, and one XLA compilation cache per test run, shared by the xdist workers and the
CLIs the tests start:
several tests compile the same program (a tiny train step run again to resume, the same
sampler in two processes), and a compile is most of a small test's time. The cache directory
is new for every run, so nothing compiled by an older checkout can be picked up. And under
xdist, a module whose tests share a module-scoped fixture runs on one worker (see below)."""

import functools
import json
import os
import shutil
import tempfile
import types
from importlib.metadata import version
from pathlib import Path

import pytest

# Compiling is most of a test's time and the tests' models are tiny, so XLA:CPU is told to
# compile fast rather than to generate fast kernels: LLVM at -O0 (halved the remat test, 28 ->
# 17 s) and, where XLA still has them (jaxlib < 0.11, the oldest leg), the classic elemental
# fusion emitters instead of the MLIR ones (tests/test_moe.py 33 -> 20 s, the oldest leg's suite
# 12:55 -> 9:29 on 2 cores, 2026-11-27; jaxlib 0.11 removed the flag, and an unknown XLA flag
# aborts). One LLVM module a program rather than split for parallel codegen (the workers
# already fill both cores), and no XNNPACK graph fusion pass: on a tiny train step's four
# compiles, 2.85-3.95 -> 1.76-2.22 s at jaxlib 0.10.2, 7.0-7.8 -> 6.1-6.8 s at 0.12.
# None turns on fast-math; the suite passes with and without them.
# `DEFAULT_EMITTERS` is the compiler option a test that inspects XLA:CPU's default pipeline
# compiles with.
CLASSIC_EMITTERS = tuple(map(int, version("jaxlib").split(".")[:2])) < (0, 11)
FAST_COMPILE = (
    "--xla_backend_optimization_level=0 --xla_cpu_parallel_codegen_split_count=1"
    " --xla_cpu_experimental_xnn_graph_fusion_mode=XNN_GRAPH_FUSION_MODE_DISABLED"
) + (" --xla_cpu_use_fusion_emitters=false" if CLASSIC_EMITTERS else "")
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

from moe_jax.run import programs  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")


# CI's two legs split the suite (`--leg oldest|newest`, .ci/legs.py says how and why): each runs
# every line that the whole suite runs and its share of the other tests. A test that legs.json
# names for one leg only is deselected in the other; one it does not name runs in both.
LEGS = Path(__file__).with_name("legs.json")
LEG_SKIP_REASONS_OK = ("GPU", "cuDNN")  # skipped in every leg on this machine
leg_own: set[str] = set()  # this leg's own tests, filled at configure
misplaced: list[str] = []


def pytest_addoption(parser):
    parser.addoption(
        "--leg",
        choices=("oldest", "newest"),
        help="run one CI leg's share of the suite (tests/legs.json; .ci/legs.py splits it)",
    )


def _leg_tests(config) -> tuple[set, set]:
    """This leg's own tests and the other leg's, as tests/legs.json names them."""
    leg = config.getoption("leg")
    legs = json.loads(LEGS.read_text(encoding="utf-8"))
    other = "newest" if leg == "oldest" else "oldest"
    return set(legs[f"{leg}_only"]), set(legs[f"{other}_only"])


def pytest_configure(config):
    if config.getoption("leg"):
        leg_own.update(_leg_tests(config)[0])


def pytest_collection_modifyitems(config, items):
    if config.getoption("leg"):
        others = _leg_tests(config)[1]
        dropped = [item for item in items if item.nodeid in others]
        if dropped:
            config.hook.pytest_deselected(items=dropped)
            items[:] = [item for item in items if item.nodeid not in others]
    if hasattr(config, "workerinput"):  # an xdist worker: the order it reports is the queue's
        items[:] = longest_first(items, config.rootpath)


def longest_first(items: list, root: Path) -> list:
    """`items` in xdist's units (a module with a module-scoped fixture, else a test), the
    units longest first by legs.json's recorded seconds, each unit's tests in their order.
    The workers take units from the front of the queue as they finish, so the long ones start
    early instead of leaving one worker running alone at the end (the greedy longest-first
    rule; measured in the log's durations). Unrecorded tests (short, or new) go last."""
    legs = json.loads(LEGS.read_text(encoding="utf-8"))
    seconds, shared = legs.get("seconds", {}), legs.get("module_seconds", {})
    units: dict[str, list] = {}
    for item in items:
        path = item.nodeid.split("::", 1)[0]
        units.setdefault(path if _has_module_fixture(root / path) else item.nodeid, []).append(item)
    cost = lambda unit: shared.get(unit, 0.0) + sum(seconds.get(i.nodeid, 0.0) for i in units[unit])
    order = sorted(units, key=lambda unit: -cost(unit))  # stable: ties keep collection order
    return [item for unit in order for item in units[unit]]


def pytest_sessionfinish(session):
    """The controller (not an xdist worker) removes the cache this run made, and fails a leg
    in which a test that runs in this leg only was skipped (a missing extra): it would run in
    neither, so the split (.ci/legs.py) must place it in the other leg."""
    if not hasattr(session.config, "workerinput"):
        shutil.rmtree(OWN_CACHE, ignore_errors=True)
        if misplaced:
            print(f"\n{len(misplaced)} test(s) of this leg alone were skipped, so run nowhere:")
            print("\n".join(misplaced))
            print("place them in the other leg: rerun .ci/legs.py (its docstring says how)")
            session.exitstatus = 1


@functools.cache
def _has_module_fixture(path: Path) -> bool:
    return path.is_file() and 'scope="module"' in path.read_text(encoding="utf-8")


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook; without it, never called
def pytest_xdist_make_scheduler(config, log):
    """`pytest -n N` (xdist's default `--dist load`) hands out tests one by one, so the tests
    of a module that share a module-scoped fixture (a trained run, a saved checkpoint) land on
    both workers and each builds it (measured: test_train.py's runs, ~12 s of CPU, twice).
    Such a module goes to one worker whole; every other test is still a unit of its own, and
    the units are queued longest first (`longest_first`) where legs.json has their seconds.
    Another --dist mode is left alone."""
    if config.getvalue("dist") != "load":
        return None
    from xdist.scheduler import LoadScopeScheduling

    if json.loads(LEGS.read_text(encoding="utf-8")).get("seconds"):
        config.option.loadscopereorder = False  # keep the workers' order: longest first
    # else xdist's own order, the units with most tests first (its long modules, early)

    class ModulesWithSharedFixtures(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            path = nodeid.split("::", 1)[0]
            return path if _has_module_fixture(config.rootpath / path) else nodeid

    return ModulesWithSharedFixtures(config, log)


def pytest_runtest_logreport(report):
    """MOE_JAX_INSTAFAIL=1 (the GPU kit): print a failure's report as it happens, so a run
    killed at its time limit still shows why the tests before it failed. Under `--leg`, note
    a skip of a test that runs in this leg alone."""
    if report.skipped and report.nodeid in leg_own:
        reason = str(report.longrepr[-1] if isinstance(report.longrepr, tuple) else "")
        if not any(ok in reason for ok in LEG_SKIP_REASONS_OK):
            misplaced.append(f"  {report.nodeid}: {reason}")
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


@pytest.fixture(autouse=True)
def _no_programs_from_earlier_tests():
    """A test starts with no training programs kept (moe_jax/train/programs.py): an earlier
    test's may have been traced under the patches it made."""
    programs.forget()


# What a program may read besides its arguments: our and our libraries' modules, and the
# environment variables they read (a test's own module or variable leaves programs kept).
PROGRAM_MODULES = ("moe_jax", "jax", "flax", "optax", "orbax")
PROGRAM_VARIABLES = ("MOE_JAX", "JAX", "XLA")


def _reaches_programs(name: str, args: tuple) -> bool:
    """Whether monkeypatch's `name`(*args) may change what a kept program traces to."""
    if name in ("setenv", "delenv"):
        return str(args[0]).startswith(PROGRAM_VARIABLES)
    if name in ("setitem", "delitem") and args[0] is os.environ:  # what setenv itself calls
        return str(args[1]).startswith(PROGRAM_VARIABLES)
    if name in ("setattr", "delattr"):
        target = args[0]  # "pkg.module.name", a module, a class or function, an object
        if isinstance(target, str):
            where = target
        elif isinstance(target, types.ModuleType):
            where = target.__name__
        else:
            where = getattr(target, "__module__", None) or type(target).__module__
        return where.split(".")[0] in PROGRAM_MODULES
    return True  # setitem / delitem: whose dict cannot be told


@pytest.fixture
def monkeypatch(monkeypatch):
    """pytest's `monkeypatch`, which also drops the kept training programs when it patches
    something a program may read (`_reaches_programs`) and when it undoes its patches: a
    patched module constant changes what a step traces to, so a program kept from before
    the patch (or from under it) must not be reused."""

    def forgetting(name, patch):
        @functools.wraps(patch)
        def patched(*args, **kwargs):
            if _reaches_programs(name, args):
                programs.forget()
            return patch(*args, **kwargs)

        return patched

    for name in ("setattr", "delattr", "setitem", "delitem", "setenv", "delenv"):
        setattr(monkeypatch, name, forgetting(name, getattr(monkeypatch, name)))
    yield monkeypatch
    programs.forget()  # pytest's own teardown undoes the patches right after this
