"""The `gpugate` command as an operator types it: version, help, mistakes, and which fleet file a run reads."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import gpugate
from gpugate import cli
from tests.conftest import pyinfra_exe

REPO = Path(__file__).resolve().parents[2]


def gpugate_cmd(*args: str, env: dict[str, str] | None = None, cwd: Path = REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpugate", *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})}, cwd=cwd, stdin=subprocess.DEVNULL)


def test_version_names_gpugate_pyinfra_and_python():
    result = gpugate_cmd("--version")
    assert result.returncode == 0
    assert result.stdout.startswith(f"gpugate {gpugate.__version__} (pyinfra 3.")


def _all_parsers(parser):
    yield parser
    for action in parser._actions:
        for sub in (getattr(action, "choices", None) or {}).values() if hasattr(action, "_name_parser_map") else ():
            yield from _all_parsers(sub)


def test_every_option_has_help_and_no_placeholder_leaks():
    parsers = list(_all_parsers(cli.build_parser()))
    assert len(parsers) >= 9  # gpugate, deploy, runbook, files, lab, up, down, status, fault, ssh
    for parser in parsers:
        for action in parser._actions:
            if action.option_strings or action.dest not in ("group", "action"):
                assert action.help, f"{parser.prog}: {action.option_strings or action.dest} has no help"
        text = parser.format_help()
        assert not re.search(r"\b[A-Z]+_LATE\b|dir_late", text), text
    up_help = gpugate_cmd("lab", "up", "--help").stdout
    assert "--dir DIR" in up_help and "--hosts N" in up_help


@pytest.mark.parametrize("argv, expected", [
    (["lab", "fault", "--host", "pve1", "--vmid", "129", "ignor-sigterm"],
     "unknown fault 'ignor-sigterm'; valid faults: ignore-sigterm"),
    (["lab", "ssh", "pve9"], "no lab host 'pve9' in"),
    (["lab", "fault", "--host", "pve9", "--vmid", "129", "ignore-sigterm"], "no lab host 'pve9' in"),
    (["runbook", "stauts"], "no runbook 'stauts'; runbooks: free_gpus, restart, rollback, status"),
    (["runbook"], "which runbook?"),
])
def test_a_mistyped_command_is_one_line_without_traceback(tmp_path, argv, expected):
    result = gpugate_cmd(*argv, env={"GPUGATE_LAB_DIR": str(tmp_path / "lab")})
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("gpugate: ") and expected in lines[0], result.stderr
    if "ignor-sigterm" in argv:
        assert "did you mean ignore-sigterm?" in lines[0]


def test_files_and_runbook_point_at_files_that_exist():
    out = gpugate_cmd("files").stdout
    paths = dict(line.split(":", 1) for line in out.strip().splitlines())
    for name in ("inventory.py", "deploy.py", "group_data", "runbooks", "templates"):
        assert Path(paths[name].strip()).exists(), out
    argv = cli.pyinfra_argv("runbook", ["status", "--limit", "pve1", "--data", "format=json"])
    assert argv[1:3] == ["-m", "pyinfra"] and Path(argv[3]).name == "inventory.py"
    assert Path(argv[4]).is_file() and argv[4].endswith("runbooks/status.py")
    assert argv[5:] == ["-y", "--limit", "pve1", "--data", "format=json"]  # read-only: never a prompt
    assert "-y" not in cli.pyinfra_argv("runbook", ["restart", "--limit", "pve1"])


FLEET = """
hosts:
  pve1:
    ssh: {hostname: 127.0.0.1, port: 2222, user: root}
    containers:
      129: {sglang: {model_path: /opt/models/lab-model}}
"""


def test_the_run_says_first_which_fleet_file_it_read(tmp_path):
    """One line on stderr, before anything else gpugate says; stdout stays clean for JSON."""
    fleet = tmp_path / "elsewhere.yaml"
    fleet.write_text(textwrap.dedent(FLEET))
    env = {k: v for k, v in os.environ.items() if k not in ("GPUGATE_FLEET", "GPUGATE_LAB_DIR")}
    pyinfra = pyinfra_exe()
    for extra, why in (({"GPUGATE_FLEET": str(fleet)}, "$GPUGATE_FLEET"),
                       ({"GPUGATE_LAB_DIR": str(tmp_path / "lab")}, "the lab's, $GPUGATE_LAB_DIR")):
        if "GPUGATE_LAB_DIR" in extra:
            fleet = tmp_path / "lab" / "fleet.yaml"
            fleet.parent.mkdir()
            fleet.write_text(textwrap.dedent(FLEET))
        result = subprocess.run([str(pyinfra), str(REPO / "inventory.py"), "debug-inventory"], cwd=tmp_path,
                                env={**env, **extra}, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
        said = [line for line in result.stderr.splitlines() if line.startswith("gpugate: fleet")]
        assert said == [f"gpugate: fleet {fleet} ({why})"], result.stderr
        assert "gpugate: fleet" not in result.stdout


LIMIT_PROBE = """
import json, sys
from pyinfra.api import State
from pyinfra.context import ctx_state
from pyinfra_cli.cli import _get_inventory_pattern_matches
from pyinfra_cli.inventory import make_inventory
with ctx_state.use(State()):
    inventory = make_inventory(sys.argv[1], cwd=sys.argv[2])
print(json.dumps({p: sorted(h.name for h in _get_inventory_pattern_matches(inventory, [p], "--limit"))
                  for p in sys.argv[3:]}))
"""


def test_limit_takes_the_proxmox_host_name_beside_the_pve_group(tmp_path):
    """`--limit pve1` selects pve1's containers, as `--limit pve_pve1` does (pyinfra's own matching)."""
    fleet = tmp_path / "fleet.yaml"
    fleet.write_text(textwrap.dedent(FLEET) + "  pve2:\n    ssh: {hostname: 127.0.0.2}\n    containers:\n"
                     "      129: {sglang: {model_path: /m}}\n      130: {sglang: {model_path: /m}}\n")
    env = {**os.environ, "GPUGATE_FLEET": str(fleet)}
    result = subprocess.run([sys.executable, "-c", LIMIT_PROBE, str(REPO / "inventory.py"), str(tmp_path),
                             "pve1", "pve_pve1", "pve2"], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    matches = __import__("json").loads(result.stdout)
    assert matches["pve1"] == matches["pve_pve1"] == ["@pct/pve1:129"]
    assert matches["pve2"] == ["@pct/pve2:129", "@pct/pve2:130"]


@pytest.mark.parametrize("argv, expected", [
    (["lab", "stat"], "gpugate lab: argument ACTION: invalid choice: 'stat'"),
    (["lab", "up", "--hosts", "0"], "gpugate lab up: argument --hosts: '0' must be 1 or more"),
    (["lab", "up", "--containers", "12"], "vmids are integers >= 100"),
    (["lab", "fault", "--host", "pve1", "--vmid", "x", "orphan-worker"], "argument --vmid: invalid int value: 'x'"),
])
def test_a_mistyped_option_is_one_line_too(argv, expected):
    result = gpugate_cmd(*argv)
    lines = result.stderr.strip().splitlines()
    assert result.returncode == 2 and len(lines) == 1 and expected in lines[0], result.stderr
    assert lines[0].endswith("--help)")
