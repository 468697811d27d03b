"""Files that ship with gpugate, found the same way from a checkout and from an installed wheel.

Two kinds:

- **package data** (templates, the remote code, the lab's extras): inside the ``gpugate`` package,
  read through ``importlib.resources`` so a wheel or a zip import finds them, never through a path
  computed from ``__file__`` and the checkout's layout;
- **the project files** an operator runs with pyinfra (``inventory.py``, ``deploy.py``,
  ``group_data/``, ``runbooks/``): at the top of a checkout, and copied into the wheel as
  ``gpugate/project/`` by setup.py's build step. ``project_dir()`` finds whichever exists, so
  ``gpugate deploy`` and ``gpugate runbook status`` work from both.

Example:

    >>> "ExecStart=" in read_text("templates", "sglang.service.j2")
    True
    >>> (project_dir() / "deploy.py").is_file()
    True
"""

from __future__ import annotations

import os
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the annotation alone needs it (importlib.abc's name is the one 3.10 has)
    from importlib.abc import Traversable

PACKAGE = "gpugate"
# The operator-facing files, relative to the project directory; setup.py copies exactly these.
PROJECT_FILES = ("inventory.py", "deploy.py", "group_data/*.py", "runbooks/*.py")


def resource(*parts: str) -> "Traversable":
    """A file or directory inside the installed ``gpugate`` package (``resource("templates")``)."""
    node = resources.files(PACKAGE)
    for part in parts:
        node = node.joinpath(part)
    return node


def read_text(*parts: str) -> str:
    """The text of a package data file, e.g. ``read_text("remote", "flag_table.py")``."""
    return resource(*parts).read_text(encoding="utf-8")


def template_environment() -> Any:
    """A Jinja2 environment over the package's ``templates/`` (strict: an unknown name is an error,
    not an empty string in a systemd unit)."""
    import jinja2  # only the controller renders templates; the lab and the remote code never do

    return jinja2.Environment(loader=jinja2.PackageLoader(PACKAGE, "templates"), keep_trailing_newline=True,
                              undefined=jinja2.StrictUndefined, autoescape=False)


# Values a template may leave to its defaults (the unit's restart policy).
TEMPLATE_DEFAULTS: dict[str, dict[str, Any]] = {
    "sglang.service.j2": {"restart_sec": 5, "restart_burst": 3, "restart_interval_s": 600},
}


def render_template(name: str, **values: Any) -> str:
    """``render_template("sglang.service.j2", port=30000, ...)``: the rendered text (a value the
    template needs and nobody gave is an error, except TEMPLATE_DEFAULTS)."""
    merged = {**TEMPLATE_DEFAULTS.get(name, {}), **values}
    return str(template_environment().get_template(name).render(**merged))


def project_dir() -> Path:
    """The directory holding ``inventory.py``, ``deploy.py``, ``group_data/`` and ``runbooks/``.

    From a wheel: ``<site-packages>/gpugate/project``. From a checkout (editable install or
    ``PYTHONPATH``): the checkout's root. ``$GPUGATE_PROJECT_DIR`` overrides both (a site copy
    with its own runbooks).
    """
    explicit = os.environ.get("GPUGATE_PROJECT_DIR")
    if explicit:
        return Path(explicit)
    packaged = Path(str(resource("project")))
    if (packaged / "deploy.py").is_file():
        return packaged
    return Path(str(resources.files(PACKAGE))).parent


def runbook_names() -> list[str]:
    """The runbooks available to ``gpugate runbook NAME``: ``['free_gpus', 'restart', ...]``."""
    folder = project_dir() / "runbooks"
    return sorted(p.stem for p in folder.glob("*.py") if not p.name.startswith("_"))
