"""The router's API key, where an operator sees it (issue 32, items 1 and 4), through the REAL pyinfra
CLI against the session lab: a fleet whose pve1 server sits behind a router that is a local stand-in
of smg's worker API (tests/unit/test_router_secrets.py's recording server, in this process). A key
read from a file saved with CRLF is refused naming its variable, and a router answering 307 gets no
second request; in both, the key's value is nowhere in stdout, stderr or the audit log.

Read-only (the status, ``--dry``, a deploy refused before anything is touched): the session lab is
left as it was."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests import warm_pyinfra
from tests.conftest import REPO_ROOT, pyinfra_exe
from tests.unit.test_router_secrets import KEY, Recorder, no_key_in, redirect_to, serving

pytestmark = [pytest.mark.lab]

# a flag no other test deploys: the plan is a start or a restart, never "No changes", so --dry and
# the deploy ask the router before anything stops
FLAGS = {"tp": 8, "kv-cache-dtype": "fp8_e4m3", "max-running-requests": 77}


def routed_fleet(lab, tmp_path: Path, router_url: str) -> Path:
    from gpugate_lab import core

    doc = core.fleet_document(lab.dir, [(h.name, h.port) for h in lab.hosts], {h.name: [129] for h in lab.hosts})
    doc["routers"] = {"gw": {"url": router_url, "kind": "smg"}}
    doc["hosts"]["pve1"]["containers"][129]["sglang"].update(router="gw", router_url="http://127.0.0.1:31129")
    text = core.render_fleet_yaml(doc)  # the lab writes no api_key_env: the router's line gets one here
    routed = text.replace("kind: smg}", "kind: smg, api_key_env: GW_TEST_KEY}", 1)
    assert routed != text, text
    path = tmp_path / "fleet.routed.yaml"
    path.write_text(routed)
    return path


def run(lab, fleet: Path, audit: Path, key: str, *args: str) -> subprocess.CompletedProcess:
    env = dict(lab.env(), GPUGATE_FLEET=str(fleet), GPUGATE_AUDIT_LOG=str(audit), GW_TEST_KEY=key)
    return warm_pyinfra.run([pyinfra_exe(), "-y", "inventory.py", *args, "--limit", "pve1",
                           "--data", f"sglang_flags={json.dumps(FLAGS)}"], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=180, stdin=subprocess.DEVNULL)


def seen_by_operator(result: subprocess.CompletedProcess, audit: Path) -> str:
    return result.stdout + result.stderr + (audit.read_text() if audit.exists() else "")


def test_a_key_saved_with_crlf_is_refused_naming_its_variable_and_printed_nowhere(lab, tmp_path):
    key = KEY + "\r"  # GW_TEST_KEY=$(cat key-file) keeps the CR of a file saved with CRLF
    audit = tmp_path / "audit.jsonl"
    with serving(Recorder()) as gw:
        fleet = routed_fleet(lab, tmp_path, gw.url)
        status = run(lab, fleet, audit, key, "runbooks/status.py", "--data", "format=json")
        dry = run(lab, fleet, audit, key, "deploy.py", "--dry")
        deploy = run(lab, fleet, audit, key, "deploy.py")
        assert gw.seen == []  # nothing sent with such a key
    doc = json.loads(status.stdout)
    view = doc["servers"][0]["router"]
    assert view["state"] == "unknown", view
    assert "the key in $GW_TEST_KEY holds a control character (CR; a key file saved with CRLF?)" in view["error"]
    for result in (dry, deploy):
        assert result.returncode != 0, result.stdout + result.stderr
        assert "REFUSED, nothing touched" in result.stdout + result.stderr, result.stdout + result.stderr
        assert "the key in $GW_TEST_KEY holds a control character" in result.stdout + result.stderr
    for result in (status, dry, deploy):
        assert no_key_in(seen_by_operator(result, audit), key), seen_by_operator(result, audit)


def test_a_router_that_redirects_is_not_followed_and_the_key_goes_nowhere(lab, tmp_path):
    audit = tmp_path / "audit.jsonl"
    with serving(Recorder()) as elsewhere, serving(Recorder(redirect_to(elsewhere.url, 307))) as gw:
        fleet = routed_fleet(lab, tmp_path, gw.url)
        status = run(lab, fleet, audit, KEY, "runbooks/status.py", "--data", "format=json")
        dry = run(lab, fleet, audit, KEY, "deploy.py", "--dry")
        assert elsewhere.seen == []  # no second request: the key never reached the host the 307 named
        assert gw.seen and all(auth == f"Bearer {KEY}" for _m, _p, auth in gw.seen)
    said = f"redirected GET /workers (307) to {elsewhere.url}: gpugate does not follow redirects with its key"
    assert said in json.loads(status.stdout)["servers"][0]["router"]["error"], status.stdout
    assert dry.returncode != 0 and said in dry.stdout + dry.stderr, dry.stdout + dry.stderr
    for result in (status, dry):
        assert no_key_in(seen_by_operator(result, audit)), seen_by_operator(result, audit)
