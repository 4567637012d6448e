"""The package is described in pyproject.toml; this adds jaxpar_lm_eval.pth to the
wheel, and to an editable install's, so that `lm_eval --model jaxpar` finds jaxpar's
backend (jaxpar_lm_eval.py says how)."""

import shutil
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py
from setuptools.command.editable_wheel import editable_wheel

PTH = "jaxpar_lm_eval.pth"


class BuildWithPth(build_py):
    def run(self):
        super().run()
        self.copy_file(PTH, str(Path(self.build_lib, PTH)), preserve_mode=0)


class EditableWithPth(editable_wheel):
    def _run_build_commands(self, dist_name, unpacked_wheel, build_lib, tmp_dir):
        built = super()._run_build_commands(dist_name, unpacked_wheel, build_lib, tmp_dir)
        shutil.copy(PTH, Path(unpacked_wheel, PTH))
        return built


setup(cmdclass={"build_py": BuildWithPth, "editable_wheel": EditableWithPth})
