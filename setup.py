"""The one build step pyproject.toml cannot say: the wheel carries the clone's configs/ as
package data, moe_jax/configs/ (found by name: moe_jax/config/shipped.py). Everything else about
the package is in pyproject.toml. An editable install copies nothing: the clone's configs/ is
read where it lies."""

from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithConfigs(build_py):
    def run(self):
        super().run()
        if self.editable_mode:
            return
        src = Path(__file__).resolve().parent / "configs"
        for path in sorted(src.rglob("*.yaml")):
            target = Path(self.build_lib, "moe_jax", "configs", path.relative_to(src))
            self.mkpath(str(target.parent))
            self.copy_file(str(path), str(target))


setup(cmdclass={"build_py": BuildPyWithConfigs})
