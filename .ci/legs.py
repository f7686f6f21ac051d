"""Split the suite between CI's two pytest legs without testing less: writes tests/legs.json.

Every test runs in at least one leg, and every line of moe_jax/ that the suite runs is run in
both: the oldest leg (Python 3.11, jax 0.10.2, the interop extra) and the newest (Python 3.13,
jax 0.12, DeprecationWarnings as errors). A leg is
  - a set of tests that together run every line the whole suite runs there (a cover chosen
    greedily by new lines per second, then pruned of tests the rest already cover),
  - plus its share of the other tests, each of which then runs in one leg only, balancing the
    two legs' time (tests that need an extra the newest leg lacks go to the oldest).
So a version-dependent line is exercised on both ends, and a test that adds no line to a cover
(another data point of a path both legs run) runs once. A test that tests/legs.json does not
name (a new one) runs in both legs until the next split.

Inputs, from one run of the whole oldest leg (with `pip install pytest-cov`):
    pytest -n 2 --cov=moe_jax --cov-context=test --durations=0 -q | tee durations.log
    python .ci/legs.py .coverage durations.log
(`--cov-context=test` records which test ran each line; `--durations=0`, each test's time.)
"""

from __future__ import annotations

import ast
import collections
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "tests" / "legs.json"
# The packages of the extras the newest leg does not install (interop, serve, trackers): a test
# that imports one runs in the oldest leg (tests/conftest.py fails a leg whose own tests skip
# for a missing package, so a test misplaced here is found, not lost).
OLDEST_ONLY_PACKAGES = ["torch", "transformers", "peft", "trl", "accelerate"]
OLDEST_ONLY_PACKAGES += ["fastapi", "uvicorn", "openai", "wandb", "mlflow"]
# The newest leg's tests run ~1.5x as long as the oldest's, relative to the seconds recorded by
# the coverage run (no classic XLA:CPU emitters from jaxlib 0.11; coverage's tracing slows the
# recording run about as much). Measured 2026-12-03: the 15 slowest tests both legs run took
# 302 s in the oldest leg, 472 s in the newest and 470 s in the coverage run; at 1.15 the split
# left the legs at 15:25 (oldest) and 21:23 (newest).
NEWEST_SLOWER = 1.5
# Tests shorter than this are not timed in legs.json: they go last, in collection order.
MIN_SECONDS = 1.0
DURATION = re.compile(r"^([0-9.]+)s (call|setup|teardown)\s+(\S+)$", re.M)


def read_lines(coverage_file: str) -> tuple[dict[str, set], set]:
    """The lines each test ran (its setup, call and teardown), and the lines run at import."""
    import coverage  # pytest-cov's, installed to make a split: the suite imports this module

    data = coverage.CoverageData(coverage_file)
    data.read()
    by_test: dict[str, set] = collections.defaultdict(set)
    for path in data.measured_files():
        name = path.split("/moe_jax/", 1)[-1]
        for line, contexts in data.contexts_by_lineno(path).items():
            for context in contexts:
                by_test[context.rsplit("|", 1)[0]].add((name, line))
    return by_test, by_test.pop("", set())


def read_costs(log: str, tests) -> tuple[dict[str, float], dict[str, float]]:
    """Each test's own seconds, and each module's shared (module-scoped) fixtures' seconds:
    a leg pays a module's fixtures once if it runs any of its tests."""
    setup, own = collections.Counter(), collections.Counter()
    for m in DURATION.finditer(log):
        (setup if m.group(2) == "setup" else own)[m.group(3)] += float(m.group(1))
    shared: dict[str, float] = collections.Counter()
    cost = {}
    for test in tests:
        module = test.split("::")[0]
        if 'scope="module"' in (ROOT / module).read_text(encoding="utf-8"):
            # the first test's setup builds the module's fixtures; the others' reuse them
            shared[module] = max(shared[module], setup[test])
            cost[test] = own[test] + min(setup[test], 0.3)
        else:
            cost[test] = own[test] + setup[test]
        cost[test] = max(cost[test], 0.02)
    return cost, shared


def needs_an_extra(test: str, sources: dict) -> bool:
    """The test (or its module, at import) imports a package the newest leg lacks: in its own
    body, in a fixture or module function it uses (followed through their own), or at the
    module's top; and the commands' parametrised cases whose command needs one."""
    path = test.split("::")[0]
    if path not in sources:
        text = (ROOT / path).read_text(encoding="utf-8")
        sources[path] = (text, ast.parse(text))
    text, tree = sources[path]
    names = re.compile(r"\b(" + "|".join(OLDEST_ONLY_PACKAGES) + r")\b")
    for node in tree.body:
        if isinstance(node, ast.FunctionDef | ast.ClassDef):
            continue
        segment = ast.get_source_segment(text, node) or ""
        if "importorskip" in segment and names.search(segment):
            return True
    # test_chaos / test_help parametrised over the commands: serve and the harness need extras
    if re.search(r"\[(python -m moe_jax\.)?(serve|harness)\b", test):
        return True
    functions = {n.name: n for n in tree.body if isinstance(n, ast.FunctionDef)}
    todo, seen = [test.split("::")[1].split("[")[0]], set()
    while todo:  # the test, then the module's fixtures and functions it reaches
        node = functions.get(todo.pop())
        if node is None or node.name in seen:
            continue
        seen.add(node.name)
        if names.search(ast.get_source_segment(text, node) or ""):
            return True
        todo += [a.arg for a in node.args.args]
        todo += [
            c.func.id
            for c in ast.walk(node)
            if isinstance(c, ast.Call | ast.Name) and isinstance(getattr(c, "func", None), ast.Name)
        ]
    return False


class Leg:
    """A growing set of tests and its time: the tests' own plus each module's shared fixtures."""

    def __init__(self, cost, shared, slower=1.0):
        self.cost, self.shared, self.slower = cost, shared, slower
        self.tests: set[str] = set()
        self.modules: set[str] = set()

    def extra(self, test: str) -> float:
        module = test.split("::")[0]
        fixtures = self.shared.get(module, 0.0) if module not in self.modules else 0.0
        return self.slower * (self.cost[test] + fixtures)

    def add(self, test: str) -> None:
        self.tests.add(test)
        self.modules.add(test.split("::")[0])

    @property
    def seconds(self) -> float:
        own = sum(self.cost[t] for t in self.tests)
        return self.slower * (own + sum(self.shared.get(m, 0.0) for m in self.modules))


def cover(leg: Leg, candidates, lines_of, target: set, other: set = frozenset()) -> None:
    """Set `leg`'s tests to ones that run every line of `target`: greedily the most new lines
    a second, then drop each chosen test whose lines the others already run. A test of
    `other` (the other leg's cover) costs its seconds, since choosing it runs it twice; any
    other test costs a tenth of them, since it runs in one leg or the other anyway (the
    tenth still prefers the shorter of two)."""
    cost = lambda t: leg.extra(t) * (1.0 if t in other else 0.1)
    covered: set = set()
    chosen = []
    while True:
        gain = {t: len((lines_of[t] & target) - covered) for t in candidates}
        best = max(candidates, key=lambda t: gain[t] / cost(t))
        if not gain[best]:
            break
        chosen.append(best)
        leg.add(best)
        covered |= lines_of[best] & target
    for test in sorted(chosen, key=lambda t: -cost(t)):  # the dearest go first
        others = set().union(*(lines_of[t] & target for t in chosen if t != test))
        if others >= target:
            chosen.remove(test)
    leg.tests, leg.modules = set(), set()
    for test in chosen:
        leg.add(test)


def split(coverage_file: str, log_file: str) -> dict:
    lines_of, at_import = read_lines(coverage_file)
    log = Path(log_file).read_text(encoding="utf-8")
    tests = set(lines_of) | {m.group(3) for m in DURATION.finditer(log)}
    tests = {t for t in tests if (ROOT / t.split("::")[0]).is_file()}
    for test in tests:
        lines_of.setdefault(test, set())
    cost, shared = read_costs(log, tests)
    sources: dict = {}
    oldest_only = {t for t in tests if needs_an_extra(t, sources)}
    in_newest = sorted(tests - oldest_only)

    oldest, newest = Leg(cost, shared), Leg(cost, shared, NEWEST_SLOWER)
    all_lines = set().union(*lines_of.values()) - at_import
    newest_lines = set().union(*(lines_of[t] for t in in_newest)) - at_import
    # Each cover chosen again against the other's, so that few tests run in both: mostly
    # those that alone run some line (2026-12-03, one coverage run split both ways: 237 tests
    # in both legs and ~4,023 s a leg with each cover chosen on its own, 183 and ~3,920 s).
    cover(oldest, sorted(tests), lines_of, all_lines)
    for _ in range(2):
        cover(newest, in_newest, lines_of, newest_lines, other=oldest.tests)
        cover(oldest, sorted(tests), lines_of, all_lines, other=newest.tests)
    for test in oldest_only:
        oldest.add(test)
    for test in sorted(tests - oldest.tests - newest.tests, key=lambda t: -cost[t]):
        if oldest.seconds + oldest.extra(test) <= newest.seconds + newest.extra(test):
            oldest.add(test)
        else:
            newest.add(test)
    print(
        f"{len(tests)} tests, {sum(cost.values()) + sum(shared.values()):.0f} s in all; "
        f"{len(oldest.tests & newest.tests)} in both legs; oldest {len(oldest.tests)} tests "
        f"~{oldest.seconds:.0f} s, newest {len(newest.tests)} ~{newest.seconds:.0f} s "
        "(test seconds, over the workers)"
    )
    return {
        "oldest_only": sorted(oldest.tests - newest.tests),
        "newest_only": sorted(newest.tests - oldest.tests),
        # for the order the workers take tests in (tests/conftest.py): the longest first
        "seconds": {t: round(cost[t], 1) for t in sorted(tests) if cost[t] >= MIN_SECONDS},
        "module_seconds": {m: round(s, 1) for m, s in sorted(shared.items()) if s >= MIN_SECONDS},
    }


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit("usage: python .ci/legs.py COVERAGE_FILE DURATIONS_LOG (see the docstring)")
    legs = split(*sys.argv[1:])
    text = json.dumps({"_about": __doc__.split("\n")[0], **legs}, indent=1)
    OUT.write_text(text + "\n", encoding="utf-8")
    print(f"wrote {OUT.relative_to(ROOT)}")
