"""The package as a user installs it: a wheel built from this checkout and installed into a
fresh virtual environment outside it gives `moe-jax` (and the older `moe-jax-train` and
`moe-jax-sample`), which train and sample from any directory, with the configs shipped in the
wheel found by name.

Offline: the wheel is built with the setuptools installed here (pip's build isolation only
where there is none, from the index pip is configured with), and the new environment gets
the wheel alone (`--no-deps`); its dependencies come from this environment's site-packages,
joined by a .pth path line. A directory named there is only appended to sys.path (its own
.pth files, such as an editable install's hook to this checkout, are not run), so `moe_jax`
can only come from the wheel, which the test checks. Budget ~30-40 s: a 2-layer model, 2
steps, 4 sampled tokens.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import site
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# What the wheel is built from (MANIFEST.in and setup.py say what goes in).
SOURCES = ("pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "moe_jax", "configs")
TINY_RUN = [
    "model.n_layers=2",
    "train.steps=2",
    "train.batch_size=2",
    "train.seq_len=16",
    "train.eval_every=2",
    "train.eval_batches=1",
    "train.log_every=1",
    "train.peak_flops=1e11",  # no peak measurement
    "checkpoint.every=2",
    "data.embedded_max_bytes=50000",
]


def build_wheel(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, src / name, ignore=ignore)
        else:
            shutil.copy2(ROOT / name, src / name)
    isolation = [] if importlib.util.find_spec("setuptools") is None else ["--no-build-isolation"]
    out = tmp_path / "dist"
    cmd = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", *isolation, "-w", str(out)]
    proc = subprocess.run([*cmd, str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (wheel,) = out.glob("moe_jax-*.whl")
    return wheel


def fresh_venv(tmp_path: Path, wheel: Path) -> Path:
    """A venv without system site-packages holding the wheel; -> its bin directory."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = venv / "bin" / "python"
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", str(python), "install", "-q", "--no-deps"]
        + [str(wheel)],
        check=True,
        timeout=300,
    )
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    ours = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    ours |= set(site.getsitepackages())
    (Path(purelib) / "_moe_jax_test_deps.pth").write_text("\n".join(sorted(ours)) + "\n")
    return venv / "bin"


def test_the_wheel_trains_and_samples_outside_the_clone(tmp_path):
    wheel = build_wheel(tmp_path)
    with zipfile.ZipFile(wheel) as z:
        files = set(z.namelist())
        (entry_points,) = [n for n in files if n.endswith(".dist-info/entry_points.txt")]
        scripts = z.read(entry_points).decode()
    shipped = {"moe_jax/configs/tiny.yaml", "moe_jax/configs/recipes/mixtral_8x7b_v5p128.yaml",
               "moe_jax/configs/finetune/dpo.yaml"}  # fmt: skip
    assert shipped <= files
    assert "moe-jax = moe_jax.cli.main:script" in scripts
    assert "moe-jax-train = moe_jax.cli.train:script" in scripts
    assert "moe-jax-sample = moe_jax.cli.sample:script" in scripts
    assert not any(n.startswith(("tests/", "benchmarks/")) for n in files)

    bin_dir = fresh_venv(tmp_path, wheel)
    work = tmp_path / "elsewhere"  # no checkout here nor above: tmp_path is outside ROOT
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(argv, cwd=work, env=env, capture_output=True, text=True, timeout=300)

    bin_python = str(bin_dir / "python")
    where = run(bin_python, "-c", "import moe_jax; print(moe_jax.__file__)")
    assert where.stdout.startswith(str(tmp_path / "venv")), where.stdout + where.stderr

    moe_jax = str(bin_dir / "moe-jax")
    train = run(moe_jax, "train", "tiny", *TINY_RUN, "run_dir=run")
    assert train.returncode == 0, train.stdout[-2000:] + train.stderr[-2000:]
    assert "step 2/2 | loss" in train.stdout
    assert (work / "run" / "checkpoints" / "2").is_dir()

    sample = run(moe_jax, "sample", "run", "--prompt", "def ")
    assert sample.returncode == 0, sample.stderr[-2000:]
    assert sample.stdout.startswith("def ")
    again = run(str(bin_dir / "moe-jax-sample"), "--run", "run", "--prompt", "def ")
    assert again.stdout == sample.stdout  # the older script: the same command

    # Every command finds the wheel's configs by name; the key reference reads the wheel's
    # schema.
    summary = run(moe_jax, "summary", "mixtral_8x7b")
    assert summary.returncode == 0 and summary.stdout.startswith("32 layers"), summary.stderr
    keys = run(moe_jax, "train", "--help-config", "moe")
    assert keys.returncode == 0 and "moe.n_experts (int) = 4" in keys.stdout, keys.stderr

    # A recipe by name, read from the wheel: its config loads (and a bad key is one line).
    recipe = run(str(bin_dir / "moe-jax-train"), "recipes/mixtral_8x7b_v5p128", "train.steps=0")
    assert (recipe.returncode, recipe.stderr) == (2, "error: train.steps must be positive, got 0\n")
    # The console script checks its input before importing jax (seconds), as train.py does.
    timed = run(bin_python, "-X", "importtime", str(bin_dir / "moe-jax-train"), "train.steps=0")
    lines = timed.stderr.splitlines()
    imported = {x.split("|")[-1].strip().split(".")[0] for x in lines if x.startswith("import t")}
    assert timed.returncode == 2 and "omegaconf" in imported and "jax" not in imported
    unknown = run(str(bin_dir / "moe-jax-train"), "no_such_config")
    assert unknown.returncode == 2 and unknown.stderr.count("\n") == 1
    assert "shipped: " in unknown.stderr and "recipes/deepseek_v3_v5p1024" in unknown.stderr
