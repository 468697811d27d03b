"""The status and the deploy agree by construction (issue 18): servers deployed from a fleet file,
then each setting of fleet.yaml changed alone; for each, the status's verdict (table and JSON, through
the real pyinfra CLI) and the deploy's plan (``--dry``) must say the same thing: "as desired" exactly
when the deploy would change nothing.

One container per case (two lab hosts of eight containers, one GPU each): the changed fleet file
changes each container's server in one way, so one ``--dry``, one status table and one status
document per lab host answer its eight cases at once, and ``--dry`` and the status touch nothing. That the verdicts
of one run are each container's own, never a neighbour's, is the invariant "one container's trouble
is that container's alone"; a case that leaked into another container would fail that one's
assertions here."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Callable

import pytest
import yaml

from tests import warm_pyinfra
from tests.conftest import REPO_ROOT, module_lab, pyinfra_exe

pytestmark = [pytest.mark.lab]

HOSTS = ("pve1", "pve2")
VMIDS = tuple(range(129, 137))
ENV = {"SGLANG_STANDIN_LOAD_S": "0.3"}
EXTRA_ARGS = ["--enable-metrics"]

Change = Callable[[dict], dict]


def flags_with(**more: object) -> Change:
    return lambda server: {**server, "flags": {**server["flags"], **more}}


def tp_spelled_tp_size(server: dict) -> dict:
    return {**server, "flags": {("tp-size" if key == "tp" else key): value for key, value in server["flags"].items()}}


def setting(**values: object) -> Change:
    return lambda server: {**server, **values}


# (what changes, how a container's server changes, True when the deploy must change nothing)
CASES: list[tuple[str, Change, bool]] = [
    ("nothing", setting(), True),
    ("a flag", flags_with(**{"kv-cache-dtype": "fp8_e4m3"}), False),
    ("a flag's spelling only", tp_spelled_tp_size, True),
    ("the model path", setting(model_path="/opt/models/other-model"), False),
    ("the listen host", setting(host="0.0.0.0"), False),
    ("the port", setting(port=30001), False),
    ("an env value", setting(env={"SGLANG_STANDIN_LOAD_S": "0.4"}), False),
    ("an env variable added", setting(env={**ENV, "HF_TOKEN": "hf_secret_canary"}), False),
    ("an env variable removed", setting(env={}), False),
    ("the interpreter", setting(python="/usr/bin/python3.11"), False),
    ("the supervisor", setting(supervisor="systemd"), False),
    ("the supervisor, named as it runs", setting(supervisor="process"), True),
    ("extra_args dropped", setting(extra_args=[]), False),
    ("present: false", setting(present=False), False),
    ("an SGLang version pin it does not have", setting(sglang_version="0.5.10"), False),
    ("the drain budget (no restart)", setting(drain_timeout_s=5), True),
]
PLACES = [(host, vmid) for host in HOSTS for vmid in VMIDS]
assert len(CASES) <= len(PLACES)
WHERE = {case[0]: place for case, place in zip(CASES, PLACES)}


@pytest.fixture(scope="module")
def lab(tmp_path_factory):
    yield from module_lab(tmp_path_factory, "lab-agreement", hosts=len(HOSTS), gpus=len(VMIDS), vmids=VMIDS)


def fleet_with(lab, path: Path, changed: bool) -> Path:
    """The lab's fleet (each container its own GPU), every server with the env and extra_args; with
    ``changed``, each case's container changed by that case."""
    fleet = yaml.safe_load(lab.fleet_path.read_text())
    for what, change, _ in CASES:
        host, vmid = WHERE[what]
        container = fleet["hosts"][host]["containers"][vmid]
        server = {**container["sglang"], "env": dict(ENV), "extra_args": list(EXTRA_ARGS)}
        container["sglang"] = change(server) if changed else server
    path.write_text(yaml.safe_dump(fleet))
    return path


def pyinfra(lab, fleet: Path, *args: str) -> subprocess.CompletedProcess:
    exe = pyinfra_exe()
    return warm_pyinfra.run([exe, "inventory.py", *args], cwd=REPO_ROOT, env=dict(lab.env(), GPUGATE_FLEET=str(fleet)),
                          capture_output=True, text=True, timeout=240, stdin=subprocess.DEVNULL)


def table_line(table: str, host: str, vmid: int) -> str:
    return next(line for line in table.splitlines() if re.match(rf"{host}\s+{vmid}\s", line))


def answers_of(lab, tmp_path_factory, host: str):
    """Deploy one host's containers unchanged (the status says "serving as desired" of each, and
    exits 0), then what the deploy's --dry, the status table and the status document say of them
    in the changed fleet. One lab host at a time: half the servers start at once, which keeps each
    host's first test within the suite's 20 s on a busy machine."""
    limit = ("--limit", f"pve_{host}")
    fleet = fleet_with(lab, tmp_path_factory.mktemp("agreement") / "fleet.yaml", changed=False)
    result = pyinfra(lab, fleet, "-y", "deploy.py", *limit)
    assert result.returncode == 0, result.stdout + result.stderr
    table = pyinfra(lab, fleet, "-y", "runbooks/status.py", *limit)
    assert table.returncode == 0, table.stdout + table.stderr
    for where in WHERE.values():
        if where[0] == host:
            assert "serving as desired" in table_line(table.stdout, *where)

    fleet = fleet_with(lab, tmp_path_factory.mktemp("agreement-changed") / "fleet.yaml", changed=True)
    dry = pyinfra(lab, fleet, "deploy.py", "--dry", *limit)
    table = pyinfra(lab, fleet, "-y", "runbooks/status.py", *limit)
    document = pyinfra(lab, fleet, "-y", "runbooks/status.py", "--data", "format=json", *limit)
    rows = {(row["host"], int(row["vmid"])): row for row in json.loads(document.stdout)["servers"]}
    assert {where for where in rows} == {where for where in WHERE.values() if where[0] == host}
    return dry.stdout + dry.stderr, table, document, rows


@pytest.fixture(scope="module")
def answers(lab, tmp_path_factory):
    """host -> answers_of(host), each worked out once, by the first test of that host."""
    known: dict[str, tuple] = {}

    def of(host: str) -> tuple:
        if host not in known:
            known[host] = answers_of(lab, tmp_path_factory, host)
        return known[host]
    return of


def plan_action(output: str, host: str, vmid: int) -> str:
    """What the deploy's --dry says it would do in one container: start, restart, stop, attach,
    REFUSED, or noop."""
    found = re.search(rf"\[@pct/{host}:{vmid}\] sglang :\d+ (?:will (\w+)|(REFUSED))", output)
    return (found.group(1) or found.group(2)) if found else "noop"


@pytest.mark.parametrize(("what", "change", "unchanged"), CASES, ids=[case[0] for case in CASES])
def test_status_and_deploy_agree_on_every_setting_changed_alone(answers, what, change, unchanged):
    host, vmid = WHERE[what]
    dry, table, document, rows = answers(host)
    action = plan_action(dry, host, vmid)
    row = rows[(host, vmid)]

    assert (action == "noop") is unchanged, f"{what}: the deploy would {action}\n{dry}"
    assert row["ok"] is unchanged, f"{what}: {row['verdict']}"
    assert row["verdict"] in table_line(table.stdout, host, vmid)  # the table says what the JSON says
    if unchanged:
        assert row["verdict"] == "serving as desired"
    elif action == "stop":
        assert row["verdict"] == "drifted: runs but should not"
    elif action == "start":  # nothing of the desired server runs (another port)
        assert row["verdict"].startswith("down but desired")
    else:  # restart, or a restart the checks refuse: the server that runs is not the desired one
        assert row["verdict"].startswith("drifted: "), row["verdict"]
    assert table.returncode != 0 and json.loads(document.stdout)["ok"] is False  # some case is not as desired
    assert "hf_secret_canary" not in dry + table.stdout + document.stdout
