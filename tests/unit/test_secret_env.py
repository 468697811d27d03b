"""Which env values are secrets (issue 32 item 10): the values of names that name a secret (the
pattern list of gpugate.rules.redact.names_a_secret, and the names the operator lists in
``secret_env``) are masked everywhere, always; the others are shown, so that an operator can check
the value about to be applied and a crash quotes what it could not read. The rule's cases are data;
then each place a value travels: the plan's diff (--dry), the status, the agent's log masking and
records, the audit log."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpugate import audit, bundle
from gpugate.agent import history
from gpugate.agent.context import Context
from gpugate.match import compare
from gpugate.plan import plan_lines
from gpugate.report.status import drift_items
from gpugate.rules import redact
from gpugate.settings import SettingsError, validated_settings
from gpugate.spec import build_spec, desired_state
from tests.unit.plans import plan_of

# (env name, the operator's secret_env, secret?)
NAMES = [
    ("HF_TOKEN", (), True),
    ("HUGGING_FACE_HUB_TOKEN", (), True),
    ("OPENAI_API_KEY", (), True),
    ("AWS_SECRET_ACCESS_KEY", (), True),
    ("DB_PASSWORD", (), True),
    ("DB_Passwd", (), True),
    ("SMTP_PASS", (), True),
    ("GOOGLE_APPLICATION_CREDENTIALS", (), True),
    ("REGISTRY_CREDS", (), True),
    ("PROXY_AUTH", (), True),
    ("OAUTH_CLIENT", (), True),           # a part that ends with a word: oauth
    ("HFTOKEN", (), True),                # written as one word
    ("wandbApiKey", (), True),            # camel case: wandb/api/key
    ("SESSION_COOKIE", (), True),
    ("hf_token", (), True),               # any case
    ("TOKENIZERS_PARALLELISM", (), False),  # a part that only begins with a word
    ("SGLANG_STANDIN_LOAD_S", (), False),
    ("CUDA_VISIBLE_DEVICES", (), False),
    ("HF_HUB_OFFLINE", (), False),
    ("NCCL_IB_GID_INDEX", (), False),
    ("SSL_KEYFILE", (), False),           # the file's path, not the key
    ("DB_URL", (), False),
    ("DB_URL", ("DB_URL",), True),        # listed by the operator
    ("db_url", ("DB_URL",), True),        # in any case
    ("DB_HOST", ("DB_URL",), False),
]


@pytest.mark.parametrize("name, declared, secret", NAMES, ids=[f"{n}{'+declared' if d else ''}" for n, d, _ in NAMES])
def test_an_env_value_is_secret_when_its_name_names_one(name, declared, secret):
    assert redact.names_a_secret(name, declared) is secret
    shown = redact.shown_env({name: "value-1234"}, declared)[name]
    assert shown == ("***" if secret else "value-1234")


ENV = {"HF_TOKEN": "hf_s3cr3t_value", "SGLANG_STANDIN_LOAD_S": "not-a-number", "DB_URL": "pg://u:pw@db/x"}


def test_the_diff_shows_the_value_about_to_be_applied_and_masks_the_secret_ones():
    running = build_spec("/m", 30000, {"tp": 8}, {"SGLANG_STANDIN_LOAD_S": "0.5"})
    desired = build_spec("/m", 30000, {"tp": 8}, ENV, secret_env=["DB_URL"])
    observation = {"sglang": {"running": True, "port": 30000, "main": {"argv": list(running.argv), "argv_hash": "x"},
                              "env_hashes": {"SGLANG_STANDIN_LOAD_S": redact.env_hash("0.5")}, "strays": []},
                   "gpu": {"gpus": []}, "container": {"free_mib": {}}}
    plan = plan_of(observation, desired, port=30000)
    assert plan.lines == ("+ env DB_URL=***", "+ env HF_TOKEN=***", "~ env SGLANG_STANDIN_LOAD_S=not-a-number (value changed)")
    text = "\n".join(plan_lines(plan, 30000))
    assert "hf_s3cr3t_value" not in text and "pg://" not in text
    # the status says the same (drifted: the environment, with the values that are no secret)
    match = compare(observation, desired, 30000)
    items = drift_items(match, observation["sglang"], desired_state({"sglang_model_path": "/m"}))
    assert items == ["environment differs: DB_URL=***, HF_TOKEN=***, SGLANG_STANDIN_LOAD_S=not-a-number (value changed)"]


def test_the_agent_masks_the_secret_values_only_and_keeps_the_crash_readable():
    doc = build_spec("/m", 30000, {"tp": 8, "api-key": "sk-live-4321"}, ENV, secret_env=["DB_URL"]).doc()
    assert doc["secret_env"] == ["DB_URL"]
    assert sorted(redact.spec_secrets(doc)) == ["hf_s3cr3t_value", "pg://u:pw@db/x", "sk-live-4321"]
    crash = ("ValueError: could not convert string to float: 'not-a-number' (HF_TOKEN=hf_s3cr3t_value, "
             "--api-key sk-live-4321, url pg://u:pw@db/x)")
    shown = redact.Redactor(redact.spec_secrets(doc)).text(crash)
    assert shown.startswith("ValueError: could not convert string to float: 'not-a-number' (HF_TOKEN=***, --api-key ***")
    assert not any(secret in shown for secret in ("hf_s3cr3t_value", "sk-live-4321", "pg://u:pw@db/x")), shown
    # a run's context (its journal, its log pumps): the operator's names hold for every spec of the run,
    # the server it replaces (captured from the container, with no names of its own) too
    replaced = {"argv": ["python3"], "env": {"DB_URL": "pg://old:pw@db/x", "SGLANG_X": "old-value"}, "port": 30000}
    ctx = Context({"run": "r1", "desired": doc, "replaces": replaced}, journal=None)  # type: ignore[arg-type]
    assert ctx.secret_env == ["DB_URL"]
    assert "pg://old:pw@db/x" in ctx.redactor.values and "old-value" not in ctx.redactor.values
    assert "not-a-number" not in ctx.redactor.values


def test_a_record_shows_the_env_values_that_are_no_secret():
    doc = build_spec("/m", 30000, {"tp": 8}, ENV, secret_env=["DB_URL"]).doc()
    record = history.make_record(doc, by="alice")
    assert record["env"] == {"DB_URL": "***", "HF_TOKEN": "***", "SGLANG_STANDIN_LOAD_S": "not-a-number"}
    assert "hf_s3cr3t_value" not in json.dumps(record) and "pg://" not in json.dumps(record)


def test_the_audit_log_keeps_a_records_shown_values(tmp_path):
    log = tmp_path / "audit.jsonl"
    record = history.make_record(build_spec("/m", 30000, {"tp": 8}, ENV, secret_env=["DB_URL"]).doc())
    audit.emit("plan", path=log, rollback=record, env={"API_TOKEN": "tok-9876543", "SGLANG_X": "on"})
    text = log.read_text()
    assert "tok-9876543" not in text and "hf_s3cr3t_value" not in text and "pg://" not in text
    event = audit.read_events(log)[0]
    assert event["rollback"]["env"]["SGLANG_STANDIN_LOAD_S"] == "not-a-number"
    assert event["env"] == {"API_TOKEN": "***", "SGLANG_X": "on"}


def test_secret_env_is_a_setting_of_names():
    assert validated_settings({"sglang_secret_env": ["DB_URL"]}) == {"sglang_secret_env": ["DB_URL"]}
    with pytest.raises(SettingsError, match="environment variable names"):
        validated_settings({"sglang_secret_env": ["1BAD"]})
    desired = desired_state({"sglang_model_path": "/m", "sglang_env": {"DB_URL": "x"}, "sglang_secret_env": ["DB_URL"]})
    assert desired.observe_args()["secret_env"] == ["DB_URL"]  # observe masks them too


def test_the_agent_takes_the_rule_from_the_bundle_never_a_copy():
    agent_modules = bundle.with_imports(bundle.AGENT_MODULES)
    assert "gpugate.rules.redact" in agent_modules
    agent_dir = Path(history.__file__).parent
    for path in agent_dir.glob("*.py"):
        text = path.read_text()
        assert "SECRET_NAME_WORDS" not in text and "def names_a_secret" not in text, path
