"""The package's import structure: no import cycle among moe_jax modules, the model apart from
the tools built on it, and every module importable on its own.

A cycle works or breaks depending on which of its modules is imported first, and one closed
by an import inside a function is the same circle, only deferred; so the graph below holds
every import of a module, wherever it is written. Read with `ast`, nothing is imported.
"""

from __future__ import annotations

import ast
import graphlib
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(p): p for p in sorted((ROOT / "moe_jax").rglob("*.py"))}


def imports(name: str) -> set[str]:
    """The moe_jax modules that module `name` imports, at its top or in a function."""
    found = set()
    for node in ast.walk(ast.parse(MODULES[name].read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{name}: relative import"  # the package uses none
            # `from package import name`: the package's own code, unless every name is a
            # submodule (its package is then a parent, which is set up before any child)
            names = {f"{node.module}.{alias.name}" for alias in node.names}
            submodules = names & MODULES.keys()
            found |= submodules if submodules == names else submodules | {node.module}
    return {m for m in found if m in MODULES and m != name}


def test_no_module_imports_itself_back():
    graph = {name: imports(name) for name in MODULES}
    assert graph["moe_jax.run.checkpoints"] and graph["moe_jax.quantize"]  # the walk sees imports
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        pytest.fail(f"import cycle: {' -> '.join(e.args[1])}")


def _unit(name: str) -> str:
    return name.split(".")[1] if name != "moe_jax" else name


def test_imports_only_run_down_the_layers():
    """Each module imports only from its own unit (top-level module or package) or from a
    unit earlier in `moe_jax.LAYERS`, read in order within a layer too: no import upward."""
    from moe_jax import LAYERS

    order = [unit for layer in LAYERS for unit in layer]
    rank = {unit: i for i, unit in enumerate(order)}
    assert len(rank) == len(order), "a unit named twice in LAYERS"
    units = {_unit(name) for name in MODULES} - {"moe_jax"}
    assert units == set(rank), f"units not in LAYERS: {sorted(units ^ set(rank))}"
    upward = [
        f"{name} -> {dep}"
        for name in MODULES
        if name != "moe_jax"
        for dep in imports(name)
        if dep != "moe_jax" and rank[_unit(dep)] > rank[_unit(name)]
    ]
    assert not upward, "imports up the layers: " + "; ".join(sorted(upward))


def test_the_layer_check_sees_an_upward_import(monkeypatch, tmp_path):
    """The check above on a module that imports the trainer from the model: refused."""
    fake = tmp_path / "fake.py"
    fake.write_text("from moe_jax.train.loop import train\n")
    monkeypatch.setitem(MODULES, "moe_jax.model.fake", fake)
    with pytest.raises(AssertionError, match="moe_jax.model.fake -> moe_jax.train.loop"):
        test_imports_only_run_down_the_layers()


def test_the_model_imports_only_the_config_and_sharding():
    """The model is what checkpoints, quantisation, interop and training are built on
    (`scopes`: the names of a step's parts, a leaf that imports only jax; `errors`: the
    project's error base, a leaf that imports nothing)."""
    allowed = {
        "moe_jax.config", "moe_jax.sharding", "moe_jax.backends", "moe_jax.named_scopes",
        "moe_jax.errors", "moe_jax.kernels.mosaic_gmm", "moe_jax.kernels.cudnn_attention",
        "moe_jax.kernels.picked_matmul",
    }  # fmt: skip
    for name in MODULES:
        if name.startswith("moe_jax.model"):
            outside = {m for m in imports(name) if not m.startswith("moe_jax.model")}
            assert outside <= allowed, f"{name} imports {sorted(outside - allowed)}"


def test_every_module_imports_on_its_own():
    """One interpreter, every moe_jax module dropped from sys.modules before each import, so
    that each is imported first (jax and the other libraries stay loaded: seconds, not a
    minute)."""
    script = """
import importlib, sys
for name in sys.argv[1:]:
    for loaded in [m for m in sys.modules if m == "moe_jax" or m.startswith("moe_jax.")]:
        del sys.modules[loaded]
    try:
        importlib.import_module(name)
    except Exception as e:
        print(f"{name}: {type(e).__name__}: {e}")
"""
    proc = subprocess.run(
        [sys.executable, "-c", script, *MODULES],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout == ""
