"""CI's two legs (.ci/legs.py, tests/legs.json): the split names real tests, each in one leg at
most, and its cover runs every line the whole suite runs at the least cost it finds."""

import ast
import importlib.util
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("ci_legs", ROOT / ".ci" / "legs.py")
legs = importlib.util.module_from_spec(spec)
spec.loader.exec_module(legs)


def test_the_split_names_existing_tests_each_in_one_leg():
    """A renamed or deleted test left in legs.json is found here (a renamed one would run in
    both legs, no longer split, until the split is made again)."""
    split = json.loads((ROOT / "tests" / "legs.json").read_text(encoding="utf-8"))
    oldest, newest = set(split["oldest_only"]), set(split["newest_only"])
    assert not oldest & newest
    functions: dict[str, set] = {}
    for test in oldest | newest:
        path, name = test.split("::")[0], test.split("::")[1].split("[")[0]
        if path not in functions:
            tree = ast.parse((ROOT / path).read_text(encoding="utf-8"))
            functions[path] = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert name in functions[path], f"{test} is not a test: rerun .ci/legs.py"


def test_the_cover_runs_every_line_and_prefers_cheap_tests():
    """Four tests over lines 1-5: the cheap pair that covers them is chosen over the slow test
    that covers four, and a test the others make redundant is pruned."""
    lines_of = {"a": {1, 2, 3, 4}, "b": {1, 2, 3}, "c": {4, 5}, "d": {5}}
    cost = {"a": 10.0, "b": 1.0, "c": 1.0, "d": 0.5}
    leg = legs.Leg(cost, shared={})
    legs.cover(leg, sorted(lines_of), lines_of, {1, 2, 3, 4, 5})
    assert leg.tests == {"b", "c"}  # d was chosen first (cheapest line), then made redundant
    assert leg.seconds == 2.0


def test_a_module_s_shared_fixtures_are_paid_once_a_leg():
    leg = legs.Leg({"m.py::x": 1.0, "m.py::y": 2.0}, shared={"m.py": 5.0}, slower=2.0)
    assert leg.extra("m.py::x") == 12.0  # (own + the module's fixtures) x the leg's slowness
    leg.add("m.py::x")
    assert leg.extra("m.py::y") == 4.0
    leg.add("m.py::y")
    assert leg.seconds == 16.0


def test_tests_that_import_an_extra_the_newest_leg_lacks_stay_in_the_oldest():
    assert legs.needs_an_extra("tests/test_interop.py::test_anything", {})  # at import
    mla = "tests/test_mla.py::test_"
    assert legs.needs_an_extra(mla + "attention_equals_transformers_deepseek_v3[False-half-0]", {})
    assert not legs.needs_an_extra(mla + "packed_documents_attend_only_within_themselves", {})


def test_workers_take_the_longest_units_first(tmp_path, monkeypatch):
    """xdist's queue (conftest.longest_first): units longest first by the recorded seconds, a
    module with a module-scoped fixture one unit (its fixture's seconds counted once, its
    tests kept together and in order), unrecorded tests last in collection order."""
    from types import SimpleNamespace

    from tests import conftest

    (tmp_path / "test_shared.py").write_text('@pytest.fixture(scope="module")\n')
    (tmp_path / "test_plain.py").write_text("")
    legs = tmp_path / "legs.json"
    legs.write_text(json.dumps({
        "seconds": {"test_plain.py::a": 5.0, "test_plain.py::c": 30.0, "test_shared.py::x": 4.0},
        "module_seconds": {"test_shared.py": 10.0},
    }))  # fmt: skip
    monkeypatch.setattr(conftest, "LEGS", legs)
    names = ["test_plain.py::a", "test_shared.py::x", "test_plain.py::b", "test_shared.py::y",
             "test_plain.py::c", "test_plain.py::d"]  # fmt: skip
    items = [SimpleNamespace(nodeid=n) for n in names]
    order = [i.nodeid for i in conftest.longest_first(items, tmp_path)]
    assert order == ["test_plain.py::c", "test_shared.py::x", "test_shared.py::y",
                     "test_plain.py::a", "test_plain.py::b", "test_plain.py::d"]  # fmt: skip
