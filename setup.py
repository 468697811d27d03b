"""Build step only (the metadata is in pyproject.toml): copy the operator-facing project files
(inventory.py, deploy.py, group_data/, runbooks/) into the wheel as ``gpugate/project/``, so that
an installed gpugate runs them (``gpugate deploy``, ``gpugate runbook status``) without a checkout.
The checkout keeps them at its top level, where the layout puts them; gpugate.resources.project_dir()
finds either.
"""

from __future__ import annotations

import glob
import os
import shutil

from setuptools import setup
from setuptools.command.build_py import build_py

PROJECT_FILES = ("inventory.py", "deploy.py", "group_data/*.py", "runbooks/*.py")  # = gpugate.resources


class build_py_with_project(build_py):
    def run(self) -> None:
        super().run()
        if getattr(self, "editable_mode", False):
            return  # an editable install runs the checkout's own files (gpugate.resources.project_dir)
        here = os.path.dirname(os.path.abspath(__file__))
        target = os.path.join(self.build_lib, "gpugate", "project")
        for pattern in PROJECT_FILES:
            for source in sorted(glob.glob(os.path.join(here, pattern))):
                relative = os.path.relpath(source, here)
                destination = os.path.join(target, relative)
                os.makedirs(os.path.dirname(destination), exist_ok=True)
                shutil.copyfile(source, destination)


setup(cmdclass={"build_py": build_py_with_project})
