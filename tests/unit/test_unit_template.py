"""The systemd unit gpugate writes for `sglang_supervisor: systemd` (gpugate/templates/sglang.service.j2)."""

from __future__ import annotations

import shutil
import subprocess

import pytest

from gpugate.resources import render_template

ARGV = '"/usr/bin/python3" "-m" "sglang.launch_server" "--port" "30000" "--api-key" "a%%b$$c"'


def unit(**values) -> str:
    return render_template("sglang.service.j2", port=30000, exec_start=ARGV, env_file="/etc/gpugate/sglang-30000.env",
                           stop_timeout_s=70, argv_comment="python3 -m sglang.launch_server --api-key '***'",
                           **{"label": "SGLang", "restart": "on-failure", "restart_why": "it exits non-zero when it dies",
                              **values})


def settings(text: str) -> dict[str, str]:
    return dict(line.split("=", 1) for line in text.splitlines() if "=" in line and not line.startswith("#"))


def test_crash_restart_is_bounded_and_the_stop_fits_sglangs_drain():
    s = settings(unit())
    assert (s["Restart"], s["RestartSec"]) == ("on-failure", "5")
    assert (s["StartLimitBurst"], s["StartLimitIntervalSec"]) == ("3", "600")  # no restart loop
    assert (s["KillMode"], s["KillSignal"], s["TimeoutStopSec"]) == ("mixed", "SIGTERM", "70")
    assert (s["StandardOutput"], s["SyslogIdentifier"]) == ("journal", "sglang-30000")
    assert s["ExecStart"] == ARGV
    assert settings(unit(restart_burst=5))["StartLimitBurst"] == "5"


@pytest.mark.skipif(not shutil.which("systemd-analyze"), reason="systemd-analyze not installed")
def test_systemd_accepts_the_unit(tmp_path):
    path = tmp_path / "sglang-30000.service"
    path.write_text(unit())
    result = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and result.stderr.strip() == "", result.stderr
