"""SGLang's own flags, version by version, end to end (issue 13): a lab whose stand-in is SGLang 0.5.23
(``gpugate lab up --sglang-version 0.5.23``), the real pyinfra CLI, deploy.py.

The stand-in parses with a snapshot of 0.5.23's parser, never with gpugate's validation, so a flag that
gpugate let through and 0.5.23 refuses would fail the start here as it would on a real server.
Tests run in order: one server, changed step by step.
"""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest

from gpugate.engine.sglang.weight_cache import steady_argv
from gpugate.engine.sglang.flags import FlagError, validate_flags
from tests import warm_pyinfra
from tests.conftest import REPO_ROOT, lab_unavailable_reason, pyinfra_exe, start_lab

pytestmark = [pytest.mark.lab]

FAST = {"SGLANG_STANDIN_LOAD_S": "0.2"}
BASE = {"tp": 2}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    reason = lab_unavailable_reason()
    if reason:
        pytest.skip(reason)
    from gpugate_lab import container_files, core

    lab_dir = tmp_path_factory.mktemp("lab-flags")
    container_files.set_sglang_version(lab_dir, "0.5.23")  # what `gpugate lab up --sglang-version 0.5.23` does
    cache = tmp_path_factory.mktemp("controller-cache")
    try:
        started = start_lab(lab_dir, hosts=1, gpus=2)
        started.cache = cache  # type: ignore[attr-defined]
        yield started
    finally:
        core.down(lab_dir)


def deploy(lab, flags: dict, *extra: str) -> subprocess.CompletedProcess:
    exe = pyinfra_exe()
    env = dict(lab.env(), GPUGATE_CACHE_DIR=str(lab.cache))
    yes = [] if "--dry" in extra else ["-y"]  # pyinfra -y --dry skips the plan altogether
    result = warm_pyinfra.run([exe, *yes, "inventory.py", "deploy.py", "--data", f"sglang_env={json.dumps(FAST)}",
                             "--data", f"sglang_flags={json.dumps(flags)}", *extra],
                            cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
                            stdin=subprocess.DEVNULL)
    result.stdout += result.stderr  # pyinfra logs to stderr: the checks read both
    return result


def in_container(lab, script: str) -> subprocess.CompletedProcess:
    return lab.pct("pve1", "exec", "129", "--", "sh", "-c", script)


def running_argv(lab) -> list[str]:
    """The server's argv as the kernel has it (the pid file is JSON or a bare pid)."""
    out = in_container(lab, "p=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))[\"pid\"])' "
                            "/run/gpugate/sglang-30000.pid); tr '\\0' '\\n' < /proc/$p/cmdline")
    assert out.returncode == 0, out.stderr
    return steady_argv(out.stdout.splitlines())  # without a gated launch's --gated-launch-port


def main_pid(lab) -> str:
    out = in_container(lab, "cat /run/gpugate/sglang-30000.pid")
    return str(json.loads(out.stdout)["pid"])  # the pid file also records the log pump's pid


def test_the_first_plan_builds_the_table_in_the_container_once_and_says_so(lab):
    began = time.monotonic()
    first = deploy(lab, BASE, "--dry")
    first_s = time.monotonic() - began
    assert first.returncode == 0, first.stdout + first.stderr
    assert "building SGLang's flag table in the container (first time for 0.5.23)" in first.stdout
    assert "flags checked against SGLang 0.5.23's own flag table, from the container (built there in" in first.stdout
    cached = in_container(lab, "ls /var/lib/gpugate/sglang-flags/")
    assert re.search(r"^0\.5\.23-[0-9a-f]{16}\.json$", cached.stdout, re.M), cached.stdout
    began = time.monotonic()
    second = deploy(lab, BASE, "--dry")
    second_s = time.monotonic() - began
    assert second.returncode == 0, second.stdout + second.stderr
    assert "building SGLang's flag table" not in second.stdout
    assert "flags checked against SGLang 0.5.23's own flag table, from the container (cached there)" in second.stdout
    print(f"--dry with the first build: {first_s:.2f} s; with the cached table: {second_s:.2f} s")


def test_flags_new_in_0_5_23_are_accepted_and_applied(lab):
    result = deploy(lab, {**BASE, "cuda-graph-max-bs-decode": 256, "kv-cache-dtype": "nvfp4"})
    assert result.returncode == 0, result.stdout + result.stderr
    argv = running_argv(lab)
    assert argv[argv.index("--cuda-graph-max-bs-decode") + 1] == "256"
    assert argv[argv.index("--kv-cache-dtype") + 1] == "nvfp4"


@pytest.mark.parametrize("flags, words", [
    ({"cuda-graph-max-bs": 256},
     "--cuda-graph-max-bs: not a flag of SGLang 0.5.23 (did you mean --cuda-graph-max-bs-decode"),
    ({"kv-cache-dtype": "fp4_e2m1"},
     "--kv-cache-dtype: 'fp4_e2m1' is not one of auto, fp8_e5m2, fp8_e4m3, mxfp8, bf16, bfloat16, nvfp4, "
     "fp4_mx_block16 in SGLang 0.5.23"),
    # what gpugate sets itself (issue 32 item 6): the agent's own gate port would clash, every deploy would roll back
    ({"gated-launch-port": 41000}, "--gated-launch-port: gpugate sets it: write gated_launch: true (or false) instead"),
])
def test_flags_0_5_23_does_not_take_are_refused_before_anything_stops(lab, flags, words):
    before = main_pid(lab)
    result = deploy(lab, {**BASE, **flags})
    assert result.returncode != 0
    assert words in result.stdout + result.stderr
    assert "REFUSED, nothing touched" in result.stdout + result.stderr
    assert main_pid(lab) == before  # the running server was never stopped


def test_what_gpugate_sets_is_refused_in_extra_args_too(lab):
    before = main_pid(lab)
    result = deploy(lab, BASE, "--data", 'sglang_extra_args=["--gated-launch-port", "41000"]')
    assert result.returncode != 0 and "REFUSED, nothing touched" in result.stdout
    assert "--gated-launch-port: gpugate sets it: write gated_launch: true (or false) instead" in result.stdout
    assert main_pid(lab) == before


def test_a_deprecated_flag_applies_with_sglangs_own_warning(lab):
    result = deploy(lab, {**BASE, "disable-cuda-graph": True})
    assert result.returncode == 0, result.stdout + result.stderr
    assert ("--disable-cuda-graph is deprecated in SGLang 0.5.23: '--disable-cuda-graph' is deprecated and will be "
            "removed in a future release. Use '--cuda-graph-backend-{decode,prefill}=disabled' instead."
            in result.stdout)
    assert "--disable-cuda-graph" in running_argv(lab)
    log = in_container(lab, "cat /var/log/gpugate/sglang-30000.log")
    assert "'--disable-cuda-graph' is deprecated" in log.stdout  # the stand-in said it too, as SGLang does


def test_the_seeds_flags_keep_working_on_0_5_23(lab):
    seeds = {**BASE, "kv-cache-dtype": "fp8_e4m3", "disable-custom-all-reduce": True,
             "enable-hierarchical-cache": True, "hicache-size": 1}
    result = deploy(lab, seeds)
    assert result.returncode == 0, result.stdout + result.stderr
    argv = running_argv(lab)
    assert {"--disable-custom-all-reduce", "--enable-hierarchical-cache"} <= set(argv)
    assert argv[argv.index("--hicache-size") + 1] == "1"


def test_the_stand_in_refuses_a_flag_that_gpugates_overlay_lets_through(lab):
    # Without a version (the union of the snapshots, what a fleet file is checked against), gpugate
    # takes fp4_e2m1: 0.5.10 has it. The stand-in, built from 0.5.23's parser, refuses it as SGLang does.
    assert validate_flags({"kv-cache-dtype": "fp4_e2m1"}) == {"kv-cache-dtype": "fp4_e2m1"}
    out = in_container(lab, "cd /tmp && python3 -m sglang.launch_server --model-path /opt/models/lab-model "
                            "--port 30999 --kv-cache-dtype fp4_e2m1")
    assert out.returncode == 2
    assert "error: argument --kv-cache-dtype: invalid choice: 'fp4_e2m1'" in out.stderr


def test_extra_args_pass_verbatim_with_a_warning_and_drift_is_seen(lab):
    exe = pyinfra_exe()
    env = dict(lab.env(), GPUGATE_CACHE_DIR=str(lab.cache))
    args = [exe, "-y", "inventory.py", "deploy.py", "--data", f"sglang_env={json.dumps(FAST)}",
            "--data", f"sglang_flags={json.dumps(BASE)}", "--data", 'sglang_extra_args=["--enable-metrics"]']
    result = warm_pyinfra.run(args, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300,
                            stdin=subprocess.DEVNULL)
    result.stdout += result.stderr
    assert result.returncode == 0, result.stdout + result.stderr
    assert "extra_args passed verbatim, unchecked: --enable-metrics" in result.stdout
    assert running_argv(lab)[-1] == "--enable-metrics"
    again = deploy(lab, BASE, "--dry")  # without the extra argument: the running argv differs
    assert "will restart" in again.stdout or "--enable-metrics" in again.stdout, again.stdout


def test_with_the_older_snapshot_fp4_e2m1_is_accepted(lab):
    with pytest.raises(FlagError, match="not one of .* in SGLang 0.5.23"):
        validate_flags({"kv-cache-dtype": "fp4_e2m1"}, "0.5.23")
    assert validate_flags({"kv-cache-dtype": "fp4_e2m1"}, "0.5.10") == {"kv-cache-dtype": "fp4_e2m1"}
    from gpugate_lab import container_files

    container_files.set_sglang_version(lab.dir, "0.5.10")  # the lab's containers become SGLang 0.5.10
    result = deploy(lab, {**BASE, "kv-cache-dtype": "fp4_e2m1", "cuda-graph-max-bs": 256})
    assert result.returncode == 0, result.stdout + result.stderr
    assert "building SGLang's flag table in the container (first time for 0.5.10)" in result.stdout
    argv = running_argv(lab)
    assert argv[argv.index("--kv-cache-dtype") + 1] == "fp4_e2m1"
    assert argv[argv.index("--cuda-graph-max-bs") + 1] == "256"
