"""The lab tests' pyinfra runs fork from a warm interpreter (tests/warm_pyinfra.py): a run there must
be what a fresh ``pyinfra`` process gives, or every lab test would prove something else. Compared on
what a test reads: the exit status, stdout and stderr, the working directory and environment the CLI
sees, and a signal's effect."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from tests import warm_pyinfra
from tests.conftest import REPO_ROOT, pyinfra_exe

CASES = {
    "version": ["--version"],
    "a usage error": ["--no-such-option"],
    "a missing inventory": ["-y", "no-such-inventory.py", "exec", "--", "true"],
}


@pytest.mark.parametrize("args", list(CASES.values()), ids=list(CASES))
def test_a_warm_run_gives_what_a_fresh_one_gives(args, tmp_path):
    env = dict(os.environ, GPUGATE_FLEET=str(tmp_path / "none.yaml"))
    fresh = subprocess.run([pyinfra_exe(), *args], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=60, stdin=subprocess.DEVNULL)
    warm = warm_pyinfra.run([pyinfra_exe(), *args], cwd=tmp_path, env=env, timeout=60)
    assert (warm.returncode, warm.stdout, warm.stderr) == (fresh.returncode, fresh.stdout, fresh.stderr)
    assert_warm()


def assert_warm() -> None:
    """The run went through the warm interpreter (a fallback to a fresh exec would prove nothing here)."""
    server = warm_pyinfra._SERVER.process
    assert os.environ.get(warm_pyinfra.FRESH_ENV) == "1" or (server is not None and server.poll() is None)


def test_the_run_sees_the_tests_cwd_env_and_pythonpath(tmp_path):
    """A deploy file that prints what it sees: the cwd, an environment variable and that the
    repository on PYTHONPATH is importable (the controller under test is this checkout)."""
    (tmp_path / "inventory.py").write_text("hosts = ['@local']\n")
    (tmp_path / "deploy.py").write_text(
        "import os, gpugate\n"
        "print('SEEN', os.getcwd(), os.environ.get('WARM_TEST_VALUE'), os.path.dirname(gpugate.__file__))\n")
    env = dict(os.environ, WARM_TEST_VALUE="v1", PYTHONPATH=str(REPO_ROOT))
    warm = warm_pyinfra.run([pyinfra_exe(), "-y", "inventory.py", "deploy.py"], cwd=tmp_path, env=env, timeout=60)
    seen = next(line for line in warm.stdout.splitlines() if line.startswith("SEEN"))
    assert seen.split()[1:] == [str(tmp_path), "v1", str(REPO_ROOT / "gpugate")], warm.stdout + warm.stderr
    assert_warm()


def test_a_signal_reaches_the_run_and_its_status_says_so(tmp_path):
    (tmp_path / "inventory.py").write_text("hosts = ['@local']\n")
    (tmp_path / "deploy.py").write_text("import time\nprint('WAITING', flush=True)\ntime.sleep(60)\n")
    process = warm_pyinfra.popen([pyinfra_exe(), "-y", "inventory.py", "deploy.py"], cwd=tmp_path,
                                 env=dict(os.environ), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    assert os.environ.get(warm_pyinfra.FRESH_ENV) == "1" or isinstance(process, warm_pyinfra.WarmProcess)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and "WAITING" not in process.stdout.readline():
        pass
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=30) == -signal.SIGTERM
