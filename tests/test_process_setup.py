"""The huge-page re-exec (the CLIs restart once with glibc's THP tunable, arguments intact) and
the one line that says which platform jax was given and why."""

import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import pytest

from moe_jax.process_setup import accelerator_present

pytestmark = pytest.mark.skipif(
    sys.platform != "linux" or platform.libc_ver()[0] != "glibc", reason="glibc only"
)

# Re-execs itself, then reports its tunables, its arguments and the VmFlags of the mapping that
# holds a 256 MB buffer malloc served. The tunable's whole effect is that glibc madvises such a
# mapping MADV_HUGEPAGE ("hg" in its VmFlags); how many 2 MB pages the kernel then finds for it
# depends on how fragmented memory is at that moment (98 of 256 MB beside a busy xdist worker in
# one CI run), so the test reads the advice, not the page count.
CHILD = """
import json, os, sys
from moe_jax.process_setup import reexec_with_hugepages
reexec_with_hugepages()
import numpy as np
buf = np.ones(64 * 2**20, np.float32)
address, flags = buf.ctypes.data, None
inside = False
for line in open("/proc/self/smaps"):
    head = line.split()[0]
    if "-" in head and not head.endswith(":"):
        start, end = (int(h, 16) for h in head.split("-"))
        inside = start <= address < end
    elif inside and line.startswith("VmFlags:"):
        flags = line.split()[1:]
print(json.dumps({"tunables": os.environ.get("GLIBC_TUNABLES"), "argv": sys.argv[1:],
                  "vm_flags": flags}))
"""


def run_child(tmp_path: Path, **overrides: str) -> dict:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {k: v for k, v in os.environ.items() if k not in ("GLIBC_TUNABLES", "MOE_JAX_HUGEPAGES")}
    out = subprocess.run(
        [sys.executable, str(script), "a b", "--flag"],
        env={**env, **overrides},
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def thp_madvise() -> bool:
    """Whether THP is in "madvise" mode, the one mode in which glibc's tunable madvises (in
    "always" malloc's mappings get huge pages unasked; in "never" nothing does)."""
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return path.exists() and "[madvise]" in path.read_text()


def test_reexec_adds_the_tunable_and_keeps_arguments(tmp_path):
    out = run_child(tmp_path)
    assert "glibc.malloc.hugetlb=1" in out["tunables"].split(":")
    assert out["argv"] == ["a b", "--flag"]
    if thp_madvise():  # the point of it: malloc's big mappings ask for 2 MB pages
        assert "hg" in out["vm_flags"]


def test_existing_tunables_are_kept(tmp_path):
    out = run_child(tmp_path, GLIBC_TUNABLES="glibc.malloc.check=0")
    assert out["tunables"] == "glibc.malloc.check=0:glibc.malloc.hugetlb=1"


def test_opt_out(tmp_path):
    out = run_child(tmp_path, MOE_JAX_HUGEPAGES="0")
    assert out["tunables"] is None
    assert out["argv"] == ["a b", "--flag"]
    if thp_madvise():  # the control: without the tunable no advice is given
        assert "hg" not in out["vm_flags"]


PLATFORM_CHILD = "from moe_jax.process_setup import platform_line; print(platform_line())"


@pytest.mark.parametrize(
    "platforms, expected",
    [
        (
            None,
            re.escape("platform: cpu, 1 x cpu (no /dev/accel*, /dev/vfio/* or /dev/nvidia* found)"),
        ),
        ("cpu", re.escape("platform: cpu, 1 x cpu (JAX_PLATFORMS=cpu in the environment)")),
    ],
)
def test_the_chosen_platform_is_one_line_with_its_reason(platforms, expected):
    """`expected` is a pattern: on a machine with a GPU or TPU, the unset case names it."""
    if platforms is None and accelerator_present():  # jax picks the device's own platform
        expected = r"platform: (gpu|tpu), \d+ x .+ \(accelerator device files found\)"
    env = {k: v for k, v in os.environ.items() if k not in ("JAX_PLATFORMS", "XLA_FLAGS")}
    if platforms:
        env["JAX_PLATFORMS"] = platforms
    out = subprocess.run(
        [sys.executable, "-c", PLATFORM_CHILD], env=env, capture_output=True, text=True, check=True
    )
    (line,) = out.stdout.strip().splitlines()
    assert re.fullmatch(expected, line), line
