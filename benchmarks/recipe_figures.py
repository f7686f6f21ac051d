"""Accelerator figures of the training recipes (`configs/recipes/`), compiled on this CPU.

    python benchmarks/recipe_figures.py                                   # every recipe
    python benchmarks/recipe_figures.py recipes/mixtral_8x7b_v5p128 --out recipes.jsonl
    python benchmarks/recipe_figures.py recipes/mixtral_8x7b_h100x8 --layers 4   # a quick check

Each recipe names its slice on a `# topology:` line; this runs `python -m moe_jax.aot RECIPE
--topology T` on it as it stands (its mesh, batch, remat and chunks: the program train.py
would run there) and prints one row per recipe: per-device bytes, compiled / model FLOPs and
collective GiB a step, in aot_figures.py's format. `--layers N` compiles the first N layers
only (model.n_layers=N): minutes instead of up to ten, for checking a recipe's keys, not its
fit. A full-depth compile takes 2-10 minutes and 4-12 GiB of host memory, so recipes run one
after another; --out keeps each result as it comes (a JSON line) and a rerun skips those there.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

from aot_figures import row  # noqa: E402

TOPOLOGY_LINE = re.compile(r"^# topology: (\S+)\s*$", re.M)


def recipe_topology(path: Path) -> str:
    """The slice a recipe is written for: its `# topology: NAME` line."""
    m = TOPOLOGY_LINE.search(path.read_text())
    if m is None:
        raise ValueError(f"{path} has no '# topology: NAME' line")
    return m.group(1)


def recipe_names() -> list[str]:
    return sorted(f"recipes/{p.stem}" for p in (ROOT / "configs/recipes").glob("*.yaml"))


def run_recipe(name: str, layers: int | None, extra: list[str]) -> dict:
    from moe_jax.config.shipped import config_path

    path = config_path(name)
    topology = recipe_topology(path)
    cmd = [sys.executable, "-m", "moe_jax.aot", str(path), "--topology", topology, *extra]
    if layers:
        cmd.append(f"model.n_layers={layers}")
    print(f"{name} on {topology}: {' '.join(cmd[1:])}", flush=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    for line in lines[:-1] if proc.returncode == 0 else lines:  # the table, not the JSON
        print(f"  {line}", flush=True)
    result = {"model": name.removeprefix("recipes/"), "topology": topology, "layers": layers}
    result |= {"exit": proc.returncode, "wall_s": round(time.perf_counter() - t0)}
    if proc.returncode == 0:
        result["report"] = json.loads(lines[-1])
    else:
        tail = lines or proc.stderr.strip().splitlines() or ["(no output)"]
        result["message"] = tail[-1]
    return result


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    p.add_argument("recipes", nargs="*", help="recipe names (default: all), e.g. recipes/NAME")
    p.add_argument("--layers", type=int, help="compile only this many layers (a quick check)")
    p.add_argument("--out", type=Path, help="JSON lines of the results, appended as they come")
    p.add_argument("--aot", nargs=argparse.REMAINDER, default=[], help="passed on to moe_jax.aot")
    args = p.parse_args(argv)
    names = args.recipes or recipe_names()
    done = {}
    if args.out and args.out.exists():
        for line in args.out.read_text().splitlines():
            r = json.loads(line)
            done[(r["model"], r.get("layers"))] = r
    results = []
    for name in names:
        key = (name.removeprefix("recipes/"), args.layers)
        r = done.get(key) or run_recipe(name, args.layers, args.aot)
        results.append(r)
        if args.out and key not in done:
            with args.out.open("a") as f:
                f.write(json.dumps(r) + "\n")
    print(
        "\nrecipe   topology  seq/dev  args GiB temps GiB peak GiB  FLOPs c/m  collective GiB "
        "per step"
    )
    for r in results:
        print(row(r) + (f"  ({r['layers']} layers)" if r.get("layers") else ""))
    return 0 if all(r["exit"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
