"""The installed agent's compiled-code cache, in a lab container (issue 11's performance targets):
written by the ``start`` hand-off only, read by observe, never written by observe, and never needed.

    python3 -m pytest -q -p no:xdist tests/lab/test_agent_cache_lab.py

One lab host, container 129, no server: the commands go through the lab's real ``pct exec``.
"""

from __future__ import annotations

import json
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
    from gpugate_lab import core

    argv = core.host_exec_argv(lab.dir, "pve1") + ["pct", "exec", "129", "--", "sh", "-c", script]
    return subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=120,
                          stdin=None if stdin is not None else subprocess.DEVNULL)


def cache_files(lab) -> list[str]:
    """The code caches of this controller's agent (the agent's own and the bundled probe's)."""
    out = ct(lab, f"ls {CACHE_DIR} 2>/dev/null; true").stdout.split()
    return sorted(name for name in out if name.startswith(f"agent-{agentcmd.agent_sha()}.") or name.startswith("bundle-"))


def observe(lab) -> dict:
    return agentcmd.parse_output(ct(lab, agentcmd.observe_command(PY, {"port": 30000})).stdout.splitlines())


def install(lab, stdin: str | None = None) -> dict:
    """The agent's install command, as the controller sends it before following another version's run."""
    return agentcmd.parse_output(ct(lab, agentcmd.install_command(PY), stdin or agentcmd.install_stdin()).stdout.splitlines())


def test_start_writes_the_cache_observe_reads_it_and_works_without_it(lab):
    assert observe(lab).get("agent_missing")  # nothing installed yet
    answer = install(lab)
    assert answer.get("ok") and answer["sha256"] == agentcmd.agent_sha(), answer
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
    """observe's ``flag_table`` key is the one gpugate/engine/sglang/table_builder.py's collect gives (same
    version, same server_args.py hash), so a controller that has that table sends no command for it."""
    from gpugate.facts.sglang import flag_table_command

    install(lab)
    seen = observe(lab)["sglang"]["flag_table"]
    built = agentcmd.parse_output(ct(lab, flag_table_command(PY, (), False)).stdout.splitlines())
    assert seen["key"] and seen["key"] == built["key"], (seen, built)
    assert (seen["version"], seen["server_args_sha256"]) == (built["version"], built["server_args_sha256"])
    assert seen["cached"] is built["cached"]


def test_install_writes_only_this_agent_checked_by_hash_and_starts_nothing(lab):
    sha = agentcmd.agent_sha()
    ct(lab, f"rm -f /var/lib/gpugate/agent-{sha}.py {CACHE_DIR}/*")
    # another controller version's agent, older: install never prunes it (its run may be followed next)
    ct(lab, "for n in 1 2 3 4; do echo '# old' > /var/lib/gpugate/agent-0$n.py; touch -d '2020-01-0'$n /var/lib/gpugate/agent-0$n.py; done")
    source = agentcmd.agent_source()
    tampered = install(lab, json.dumps({"agent_source": source.replace("def observe(", "def observe_(", 1)}))
    assert tampered.get("agent_missing") and not tampered.get("ok"), tampered
    assert ct(lab, f"test -e /var/lib/gpugate/agent-{sha}.py; echo $?").stdout.strip() == "1"  # nothing written

    answer = install(lab)
    assert answer == {"ok": True, "sha256": sha, "path": agentcmd.agent_path(), "installed": True}, answer
    assert ct(lab, f"sha256sum {agentcmd.agent_path()} | cut -c1-64; stat -c %a {agentcmd.agent_path()}").stdout.split() == [sha, "600"]
    assert any(name.endswith(".code") for name in cache_files(lab)), cache_files(lab)
    # nothing else: no run, no lock held, no agent process, the older agents still there
    assert ct(lab, "ls /var/lib/gpugate/runs 2>&1; pgrep -x gpugate-agent; true").stdout.strip().endswith("No such file or directory")
    assert ct(lab, "ls /var/lib/gpugate | grep -c '^agent-0[1-4][.]py$'").stdout.strip() == "4"
    again = install(lab)
    assert again["ok"] and again["installed"] is False, again
    assert observe(lab)["agent"]["sha256"] == sha
    ct(lab, "rm -f /var/lib/gpugate/agent-0*.py")


def test_a_run_of_another_controller_version_is_followed_with_this_agent_installed_first(lab):
    """A transition begun by another controller version's agent (another sha): the deploy attaches to
    it, installs this controller's agent with ``install`` (not a start), and follows the run to its end.
    The run waits at its gate (memory held from outside the container) until the deploy follows it."""
    import hashlib

    from gpugate.remote import pack
    from gpugate.engine.sglang.flags import render_argv, validate_flags
    from tests.faults.conftest import pyinfra as streamed_pyinfra

    other = agentcmd.agent_source() + "\n# another controller version\n"
    other_sha = hashlib.sha256(other.encode()).hexdigest()
    boot = pack(agentcmd._BOOT % {"sha": other_sha, "path": agentcmd.agent_path(other_sha), "marker": "gpugate-probe"})
    env = {"SGLANG_STANDIN_LOAD_S": "0.3"}
    doc = {"run": "run-other-version", "operator": "old@controller", "rollback_to": None, "restart": False,
           "agent_source": other,
           "desired": {"argv": [PY, *render_argv("/opt/models/lab-model", 30000, validate_flags({"tp": 2}))],
                       "env": env, "port": 30000, "gpus": [0, 1], "supervisor": "process", "record": {}},
           "budgets": {"drain_timeout_s": 5, "kill_grace_s": 2, "gate_timeout_s": 60, "start_timeout_s": 30,
                       "max_used_mib": 64}}
    ct(lab, f"rm -f /var/lib/gpugate/agent-{agentcmd.agent_sha()}.py")
    lab.fault("pve1", 129, "foreign-holder")
    try:
        begun = agentcmd.parse_output(ct(lab, f"exec {PY} -S -c '{boot}' start gpugate-probe", json.dumps(doc)).stdout.splitlines())
        assert begun.get("ok"), begun
        run = streamed_pyinfra(lab, ["inventory.py", "deploy.py", "--data", 'sglang_flags={"tp": 2}',
                                     "--data", f"sglang_env={json.dumps(env)}"],
                               when=[("following run run-other-version", lambda _: lab.fault("pve1", 129, "foreign-holder", clear=True))],
                               timeout=120)
        assert run.returncode == 0, run
        assert "following it instead of starting another" in run.output and "verified" in run.output, run
        assert ct(lab, f"sha256sum {agentcmd.agent_path()} | cut -c1-64").stdout.strip() == agentcmd.agent_sha()
        assert ct(lab, "ls /var/lib/gpugate/runs").stdout.split() == ["latest", "run-other-version.jsonl"]
    finally:
        lab.fault("pve1", 129, "foreign-holder", clear=True)
        ct(lab, "pkill -9 -f '[s]glang' ; true")
