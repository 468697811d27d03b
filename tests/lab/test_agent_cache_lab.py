"""The installed agent's compiled-code cache, in a lab container (issue 11's performance targets):
written by the ``start`` hand-off only, read by observe, never written by observe, and never needed.

    python3 -m pytest -q -p no:xdist tests/lab/test_agent_cache_lab.py

One lab host, container 129, no server: the commands go through the lab's real ``pct exec``.
"""

from __future__ import annotations

import subprocess

import pytest

from gpugate import agentcmd
from tests.conftest import module_lab

pytestmark = [pytest.mark.lab]

PY = "/usr/bin/python3"
CACHE_DIR = "/var/lib/gpugate/__pycache__"


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    yield from module_lab(tmp_path_factory, "lab-agent-cache", hosts=1, gpus=2)


def ct(lab, script: str, stdin: str | None = None) -> subprocess.CompletedProcess:
    from gpugate.lab import core

    argv = core.host_exec_argv(lab.dir, "pve1") + ["pct", "exec", "129", "--", "sh", "-c", script]
    return subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=120,
                          stdin=None if stdin is not None else subprocess.DEVNULL)


def cache_files(lab) -> list[str]:
    """The code caches of this controller's agent (the agent's own and the bundled probe's)."""
    out = ct(lab, f"ls {CACHE_DIR} 2>/dev/null; true").stdout.split()
    return sorted(name for name in out if name.startswith(f"agent-{agentcmd.agent_sha()}.") or name.startswith("bundle-"))


def observe(lab) -> dict:
    return agentcmd.parse_output(ct(lab, agentcmd.observe_command(PY, {"port": 30000})).stdout.splitlines())


def install(lab) -> dict:
    """The install-only hand-off the controller sends (a start document refused after the install)."""
    stdin = agentcmd.start_stdin({"run": "-install-only"}, include_source=True)
    return agentcmd.parse_output(ct(lab, agentcmd.start_command(PY), stdin).stdout.splitlines())


def test_start_writes_the_cache_observe_reads_it_and_works_without_it(lab):
    assert observe(lab).get("agent_missing")  # nothing installed yet
    answer = install(lab)
    assert "run must match" in answer.get("error", ""), answer  # installed, then the document refused
    written = cache_files(lab)
    assert any(name.endswith(".code") for name in written), written
    assert any(name.startswith("bundle-") for name in written), written
    doc = observe(lab)
    assert doc["agent"]["sha256"] == agentcmd.agent_sha() and doc["sglang"]["running"] is False, doc

    # Without the cache (deleted, or a full disk at install time) observe still answers and writes nothing.
    ct(lab, f"rm -f {CACHE_DIR}/*")
    doc = observe(lab)
    assert doc["agent"]["sha256"] == agentcmd.agent_sha() and "gpu" in doc, doc
    assert cache_files(lab) == []

    # A cache that is not ours (another interpreter's, torn, garbage) is ignored, not trusted.
    ct(lab, f"mkdir -p {CACHE_DIR} && printf garbage > {CACHE_DIR}/agent-{agentcmd.agent_sha()}.cpython-311.code")
    ct(lab, f"for f in {CACHE_DIR}/agent-*.code; do printf garbage > \"$f\"; done")
    doc = observe(lab)
    assert doc["agent"]["sha256"] == agentcmd.agent_sha() and "gpu" in doc, doc


def test_observe_names_the_flag_table_as_the_table_builder_does(lab):
    """observe's ``flag_table`` key is the one gpugate/remote/flag_table.py's collect gives (same
    version, same server_args.py hash), so a controller that has that table sends no command for it."""
    from gpugate.facts.sglang import flag_table_command

    install(lab)
    seen = observe(lab)["sglang"]["flag_table"]
    built = agentcmd.parse_output(ct(lab, flag_table_command(PY, (), False)).stdout.splitlines())
    assert seen["key"] and seen["key"] == built["key"], (seen, built)
    assert (seen["version"], seen["server_args_sha256"]) == (built["version"], built["server_args_sha256"])
    assert seen["cached"] is built["cached"]
