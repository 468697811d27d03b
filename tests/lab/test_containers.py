"""Lab containers are real namespaces: own PID 1, hostname, filesystem, network, cgroup named lxc/<vmid>."""

from __future__ import annotations

import shlex
import uuid

import pytest

from gpugate_lab.core import add_container

pytestmark = pytest.mark.lab


def detached(command: str) -> str:
    """A shell line that leaves `command` running after the SSH session ends."""
    return f"setsid bash -c {shlex.quote(command)} </dev/null >/dev/null 2>&1 &"


@pytest.fixture(scope="module")
def second_ct(lab):
    add_container(lab.dir, "pve1", 131, start=True)
    return 131


def test_container_has_its_own_init_and_hostname(lab):
    out = lab.pct_over_ssh("pve1", "exec", "129", "--", "sh", "-c",
                  "tr '\\0' ' ' </proc/1/cmdline; echo; hostname; ps -e -o pid= | wc -l").stdout.splitlines()
    assert out[0].startswith("/sbin/init")
    assert out[1] == "ct129"
    assert int(out[2]) <= 4  # init, sh, ps, wc: nothing of the host


def test_pkill_inside_a_container_does_not_reach_the_host_but_the_hosts_does(lab):
    marker = f"gpugate-marker-{uuid.uuid4().hex[:8]}"
    sleeper = f"exec -a {marker} sleep 300"
    lab.ssh("pve1", detached(sleeper))
    lab.pct_over_ssh("pve1", "exec", "129", "--", "bash", "-c", detached(sleeper))
    host_sees = lab.ssh("pve1", f"pgrep -c -f {marker}").stdout.strip()
    other_host_sees = lab.ssh("pve2", f"pgrep -c -f {marker}").stdout.strip()
    lab.pct_over_ssh("pve1", "exec", "129", "--", "pkill", "-f", marker)
    after_inside = lab.ssh("pve1", f"pgrep -c -f {marker}").stdout.strip()
    lab.ssh("pve1", f"pkill -f {marker}")
    after_host = lab.ssh("pve1", f"pgrep -c -f {marker}").stdout.strip()
    assert (host_sees, other_host_sees, after_inside, after_host) == ("2", "0", "1", "0")


def test_container_processes_are_in_the_lxc_cgroup(lab):
    marker = f"gpugate-cg-{uuid.uuid4().hex[:8]}"
    lab.pct_over_ssh("pve1", "exec", "129", "--", "bash", "-c", detached(f"exec -a {marker} sleep 60"))
    inside = lab.pct_over_ssh("pve1", "exec", "129", "--", "grep", "^0::", "/proc/self/cgroup").stdout
    host = lab.ssh("pve1", f"grep '^0::' /proc/$(pgrep -f ^{marker})/cgroup; pkill -f {marker}").stdout
    assert inside == "0::/\n"          # inside: the container's cgroup is its root
    assert host == "0::/lxc/129\n"     # on the host: named as Proxmox names it


def test_a_pushed_file_is_only_in_the_container_and_the_hosts_tmp_is_not_seen(lab):
    name = f"/tmp/only-here-{uuid.uuid4().hex[:8]}"
    lab.ssh("pve1", f"echo host > {name}")
    lab.pct_over_ssh("pve1", "push", "129", "/etc/hostname", name + ".ct")
    inside = lab.pct_over_ssh("pve1", "exec", "129", "--", "sh", "-c", f"cat {name} 2>/dev/null || echo none; ls {name}.ct")
    host = lab.ssh("pve1", f"ls {name}.ct 2>/dev/null || echo none")
    assert inside.stdout == f"none\n{name}.ct\n"
    assert host.stdout == "none\n"


def test_the_rest_of_the_machine_is_read_only_inside(lab):
    result = lab.pct_over_ssh("pve1", "exec", "129", "--", "sh", "-c", "touch /gpugate-should-fail")
    assert result.returncode != 0 and "Read-only file system" in result.stderr


def test_port_30000_serves_in_two_containers_at_once(lab, second_ct):
    hold = "python3 -c 'import socket,time; s=socket.socket(); s.bind((\"127.0.0.1\",30000)); s.listen(); time.sleep(20)'"
    for vmid in (129, second_ct):
        lab.pct_over_ssh("pve1", "exec", str(vmid), "--", "sh", "-c", detached(hold))
    probe = ("python3 -c 'import socket,time\nfor _ in range(200):\n    try:\n        socket.create_connection((\"127.0.0.1\",30000)).close(); print(\"open\"); break\n"
             "    except OSError: time.sleep(0.01)\nelse: print(\"closed\")'")
    both = [lab.pct_over_ssh("pve1", "exec", str(v), "--", "sh", "-c", probe).stdout for v in (129, second_ct)]
    rebind = lab.pct_over_ssh("pve1", "exec", "129", "--", "python3", "-c",
                     "import socket; socket.socket().bind(('127.0.0.1', 30000))")
    for vmid in (129, second_ct):
        lab.pct_over_ssh("pve1", "exec", str(vmid), "--", "pkill", "-f", "s.bind")
    assert both == ["open\n", "open\n"]
    assert "Address already in use" in rebind.stderr


def test_container_layout_for_gpus_and_the_lab(lab):
    out = lab.pct_over_ssh("pve1", "exec", "129", "--", "sh", "-c",
                  "ls /dev | grep -c '^nvidia[0-9]'; ls /dev/nvidiactl /dev/nvidia-uvm; test -f /opt/models/lab-model/config.json && echo model;"
                  " test -d /run/gpugate-sim/alloc && echo sim; touch /run/gpugate-lab/x 2>/dev/null || echo labctl-ro").stdout
    assert out == "8\n/dev/nvidia-uvm\n/dev/nvidiactl\nmodel\nsim\nlabctl-ro\n"


def test_persistent_dirs_survive_a_restart_and_tmp_does_not(lab, second_ct):
    ct = str(second_ct)
    lab.pct_over_ssh("pve1", "exec", ct, "--", "sh", "-c", "echo kept > /etc/gpugate-kept; echo gone > /tmp/gone; echo opt > /opt/kept")
    stop = lab.pct_over_ssh("pve1", "stop", ct)
    status = lab.pct_over_ssh("pve1", "status", ct).stdout
    start = lab.pct_over_ssh("pve1", "start", ct)
    out = lab.pct_over_ssh("pve1", "exec", ct, "--", "sh", "-c", "cat /etc/gpugate-kept /opt/kept; cat /tmp/gone 2>/dev/null || echo no-tmp")
    assert (stop.returncode, status, start.returncode) == (0, "status: stopped\n", 0)
    assert out.stdout == "kept\nopt\nno-tmp\n"


def test_shutdown_terminates_processes_gracefully(lab, second_ct):
    ct = str(second_ct)
    trap = "trap 'echo graceful > /opt/shutdown-note; exit 0' TERM; while :; do sleep 0.05; done"
    lab.pct_over_ssh("pve1", "exec", ct, "--", "bash", "-c", detached(trap))
    lab.pct_over_ssh("pve1", "exec", ct, "--", "rm", "-f", "/opt/shutdown-note")
    lab.pct_over_ssh("pve1", "exec", ct, "--", "bash", "-c", detached(trap))
    shut = lab.pct_over_ssh("pve1", "shutdown", ct, "--timeout", "10")
    note = lab.ssh("pve1", f"cat {lab.dir}/hosts/pve1/ct/{ct}/opt/shutdown-note").stdout
    restart = lab.pct_over_ssh("pve1", "start", ct)
    assert (shut.returncode, shut.stderr) == (0, "")
    assert note == "graceful\n"
    assert restart.returncode == 0
