"""The container agent's pure parts (argv recognition, GPUs of a server, secrets, the gate's decision,
journal and history files) and gpugate.agentcmd's commands run through a real shell."""

from __future__ import annotations

import hashlib
import json
import os
import socket
import subprocess
import sys

import pytest

from gpugate import agentcmd
from gpugate.agent import commands, history, loader, logs, server, start, state
from gpugate.agent import journal as agent_journal
from gpugate.agent.transition import Transition
from gpugate.engine.sglang import processes as sglang
from gpugate.rules import procfs, redact

MAIN = ["/usr/bin/python3", "-m", "sglang.launch_server", "--model-path", "/m", "--port", "30001", "--tp-size", "8"]


# ------------------------------------------------------------------------------- what is a server
@pytest.mark.parametrize("argv, main, part, client", [
    (MAIN, True, True, False),
    (["sglang", "serve", "--model-path", "/m"], True, True, False),
    (["/usr/bin/python3", "-m", "sglang.bench_serving", "--port", "30001"], False, False, True),
    (["python3", "-m", "sglang.bench_one_batch_server"], False, False, True),
    (["sglang::scheduler_TP3"], False, True, False),
    (["sglang::detokenizer"], False, True, False),
    (["sh", "-c", "python3 -m sglang.launch_server --port 30001 & python3 -m http.server"], False, False, False),
    (["jupyter-lab"], False, False, False),
])
def test_server_parts_and_clients_are_told_apart(argv, main, part, client):
    assert sglang.is_main_argv(argv) is main
    assert sglang.is_server_part(argv) is part
    assert sglang.is_client_argv(argv) is client


def test_port_and_host_of_an_argv():
    assert sglang.argv_port(MAIN) == 30001
    assert sglang.argv_port(MAIN[:3]) == 30000  # SGLang's default
    assert sglang.argv_port(MAIN[:3] + ["--port=31000"]) == 31000
    assert server.connect_host(sglang.argv_host(MAIN + ["--host", "0.0.0.0"])) == "127.0.0.1"
    assert server.connect_host(sglang.argv_host(MAIN + ["--host", "10.0.0.5"])) == "10.0.0.5"


@pytest.mark.parametrize("flags, env, gpus", [
    (["--tp", "8"], {}, list(range(8))),
    (["--tp-size", "4", "--base-gpu-id", "4"], {}, [4, 5, 6, 7]),
    (["--tp", "2", "--dp", "2"], {}, [0, 1, 2, 3]),
    (["--tp", "4", "--dp", "4", "--enable-dp-attention"], {}, [0, 1, 2, 3]),
    (["--tp", "2", "--pp-size", "2", "--gpu-id-step", "2"], {}, [0, 2, 4, 6]),
    (["--tp", "2"], {"CUDA_VISIBLE_DEVICES": "6,7"}, [6, 7]),
    (["--tp", "4"], {"CUDA_VISIBLE_DEVICES": "6,7"}, None),  # cannot tell: fewer devices than ranks
    (["--tp", "1"], {"CUDA_VISIBLE_DEVICES": "GPU-b"}, [1]),
])
def test_the_gpus_of_a_server_come_from_its_flags_and_environment(flags, env, gpus):
    assert sglang.server_gpus(["python3", "-m", "sglang.launch_server", *flags], env, ["GPU-a", "GPU-b"]) == gpus


# ------------------------------------------------------------------------------- secrets
def test_secret_flag_values_are_masked_in_argv_and_text():
    argv = MAIN + ["--api-key", "sk-1234", "--admin-api-key=adm-9876"]
    assert redact.redact_argv(argv)[-3:] == ["--api-key", "***", "--admin-api-key=***"]
    assert redact.secret_flag_values(argv) == ["sk-1234", "adm-9876"]
    redactor = redact.Redactor(["hf-token-value", "abc"])  # "abc": too short to search for in text
    line = ("[2026] server_args=ServerArgs(model_path='/m', api_key='sk-live-1', admin_api_key=None, "
            "tokenizer_path='/m', hf_token=hf-token-value) abc --api-key sk-2222")
    out = redactor.text(line)
    assert "sk-live-1" not in out and "hf-token-value" not in out and "sk-2222" not in out
    assert "api_key='***'" in out and "admin_api_key=None" in out and "tokenizer_path='/m'" in out and "abc" in out
    assert redactor.deep({"a": ["x hf-token-value"], "n": 3}) == {"a": ["x ***"], "n": 3}


def test_a_record_holds_no_secret_but_fingerprints():
    spec = {"argv": MAIN + ["--api-key", "sk-rec-1"], "env": {"HF_TOKEN": "hf-rec-2"}, "port": 30001,
            "gpus": [0], "record": {"note": "made with sk-rec-1"}}
    record = history.make_record(spec, by="alice")
    text = json.dumps(record)
    assert "sk-rec-1" not in text and "hf-rec-2" not in text
    assert record["argv_hash"] == redact.argv_hash(spec["argv"]) == agentcmd.argv_hash(spec["argv"])
    assert record["env_hashes"] == {"HF_TOKEN": agentcmd.env_hash("hf-rec-2")}
    assert record["key"] == history.spec_key(spec) != history.spec_key(dict(spec, env={"HF_TOKEN": "other"}))


def test_short_and_common_values_are_never_masked_as_secrets():
    # a hand-started server's login env once reached the Redactor: "root" masked "root@vm" everywhere
    redactor = redact.Redactor(["root", "true", "0,1,2,3", "30000", "/root", "hf-canary-c0ffee"])
    line = "verified by root@vm on GPUs 0,1,2,3 port 30000 HOME=/root debug=true token hf-canary-c0ffee"
    assert redactor.text(line) == line.replace("hf-canary-c0ffee", "***")
    redactor.add(["python3", "ubuntu"])
    assert redactor.text("ubuntu python3") == "ubuntu python3"


def test_an_adopted_servers_env_keeps_what_sglang_reads_not_the_login_session():
    environ = {"USER": "root", "HOME": "/root", "LOGNAME": "root", "SHELL": "/bin/bash", "TERM": "xterm",
               "PWD": "/root", "OLDPWD": "/", "SHLVL": "1", "MAIL": "/var/mail/root", "LANG": "C.UTF-8",
               "SSH_CLIENT": "10.0.0.9 51000 22", "SSH_CONNECTION": "10.0.0.9 51000 10.0.0.2 22",
               "SSH_TTY": "/dev/pts/0", "XDG_SESSION_ID": "4", "GPUGATE_LAB_HOST": "pve2", "_": "/usr/bin/python3",
               "PATH": "/opt/venv/bin:/usr/bin:/bin", "HF_TOKEN": "hf-abcdef", "SGLANG_X": "1",
               "CUDA_VISIBLE_DEVICES": "0,1", "NCCL_P2P_DISABLE": "1", "LD_LIBRARY_PATH": "/opt/lib",
               "OMP_NUM_THREADS": "8", "TORCH_CUDA_ARCH_LIST": "9.0", "MY_FLAG": "on"}
    kept = sglang.adopted_env(environ, keep_names=["MY_FLAG"], argv=["/opt/venv/bin/python3", "-m", "sglang.launch_server"])
    assert kept == {"HF_TOKEN": "hf-abcdef", "SGLANG_X": "1", "CUDA_VISIBLE_DEVICES": "0,1", "NCCL_P2P_DISABLE": "1",
                    "LD_LIBRARY_PATH": "/opt/lib", "OMP_NUM_THREADS": "8", "TORCH_CUDA_ARCH_LIST": "9.0", "MY_FLAG": "on"}
    # a relative argv[0] is found through PATH (a venv's python): that PATH is kept, nothing else of the session
    relative = sglang.adopted_env(environ, argv=["python3", "-m", "sglang.launch_server"])
    assert relative["PATH"] == "/opt/venv/bin:/usr/bin:/bin" and "USER" not in relative and "MY_FLAG" not in relative
    record = history.make_record({"argv": MAIN, "env": kept, "port": 30001}, by="root@vm")
    assert record["by"] == "root@vm" and "USER" not in record["env_names"]


# ------------------------------------------------------------------------------- the gate's decision
def reading(gpus, holders=(), api="v2"):
    return {"source": "nvml", "memory_api": api, "errors": [],
            "gpus": [{"index": i, "used_mib": used, "error": None} for i, used in enumerate(gpus)],
            "holders": list(holders)}


def test_the_gate_looks_at_this_servers_gpus_only():
    other = {"pid": 7, "cmdline": "python3 other.py", "state": "S", "gpus": [5], "used_mib": 40000}
    doc = reading([0, 0, 0, 0, 0, 40000, 0, 0], [other])
    assert start.gate_decision(doc, [0, 1, 2, 3], 64)[0] is True
    passed, problems, _, permanent = start.gate_decision(doc, [4, 5], 64)
    assert not passed and not permanent and any("GPU 5: 40000 MiB" in p for p in problems)
    assert any("pid 7" in p for p in problems)


def test_a_monitor_holding_only_the_device_files_never_blocks_the_gate():
    monitor = {"pid": 9, "cmdline": "nvitop", "state": "S", "gpus": [], "used_mib": None}
    assert start.gate_decision(reading([0, 0], [monitor]), None, 64)[0] is True


def test_a_reading_that_waiting_will_not_cure_is_permanent():
    v1 = reading([None, None], api="v1")
    assert start.gate_decision(v1, [0], 64)[3] is True
    assert start.gate_decision(reading([0, 0]), [0, 5], 64)[3] is True  # GPU 5 not visible
    none = {"source": "none", "errors": [{"source": "nvml", "kind": "DriverNotLoaded", "message": "x"}]}
    assert start.gate_decision(none, [0], 64)[3] is True


# ------------------------------------------------------------------------------- files
@pytest.fixture
def state_dirs(tmp_path, monkeypatch):
    monkeypatch.setattr(state, "STATE_DIR", str(tmp_path / "lib"))
    monkeypatch.setattr(state, "RUNS_DIR", str(tmp_path / "lib" / "runs"))
    monkeypatch.setattr(state, "RUN_DIR", str(tmp_path / "run"))
    monkeypatch.setattr(state, "LOCK_PATH", str(tmp_path / "run" / "transition.lock"))
    return tmp_path


def test_the_journal_reads_whole_lines_and_reports_an_interrupted_run(state_dirs):
    journal = agent_journal.Journal("r1")
    journal.write({"step": "run", "phase": "begin", "ports": [30000]})
    journal.write({"step": "drain", "phase": "progress"})
    with open(journal.path, "ab") as handle:
        handle.write(b'{"step": "gate", "pha')  # a line torn by a crash: never read
    events, offset = agent_journal.read_journal("r1")
    assert [e["step"] for e in events] == ["run", "drain"] and offset < os.path.getsize(journal.path)
    assert oct(os.stat(journal.path).st_mode & 0o777) == "0o600"
    summary = agent_journal.transition_summary("r1", lock={"held": False})
    assert summary["outcome"] == "interrupted" and summary["step"] == "drain" and summary["active"] is False
    journal.write({"step": "outcome", "phase": "end", "outcome": "verified"})
    assert agent_journal.transition_summary("r1", lock={"held": False})["outcome"] == "verified"


def test_history_keeps_five_good_specs_and_a_same_spec_adds_nothing(state_dirs):
    def spec(n):
        return {"argv": MAIN + ["--max-running-requests", str(n)], "env": {}, "port": 30001, "gpus": None}

    transition = Transition({"run": "h", "operator": "bob", "desired": spec(0)}, agent_journal.Journal("h"))
    for n in range(7):
        transition.records.add_good(spec(n), None, by="bob")
    assert transition.records.add_good(spec(6), {"max_total_num_tokens": 5}, by="bob") is False
    doc = history.load_history(30001)
    assert [e["spec"]["argv"][-1] for e in doc["good"]] == ["6", "5", "4", "3", "2"]
    assert doc["good"][0]["record"]["capacity"] == {"max_total_num_tokens": 5}
    assert transition.records.add_good(spec(3), None, by="bob") is False  # known: moved to the front, not added
    assert [e["spec"]["argv"][-1] for e in history.load_history(30001)["good"]][:2] == ["3", "6"]
    transition.records.failed("the server exited during loading with code 1")
    public = history.public_history(history.load_history(30001))
    assert public["failed"][0]["reason"].startswith("the server exited") and len(public["good"]) == 5
    assert "spec" not in json.dumps(public["good"])
    assert oct(os.stat(state.paths(30001)["history"]).st_mode & 0o777) == "0o600"


def test_a_start_document_is_validated_before_anything_is_touched():
    good = {"argv": MAIN, "env": {}, "port": 30001}
    assert commands.validate_start({"run": "r1", "desired": good, "rollback_to": "auto"}) is None
    assert "run must match" in commands.validate_start({"run": "../x", "desired": good})
    assert "differs from port" in commands.validate_start({"run": "r", "desired": dict(good, port=30000)})
    assert "not an SGLang server" in commands.validate_start({"run": "r", "desired": dict(good, argv=["sleep", "9"])})
    assert "rollback_to" in commands.validate_start({"run": "r", "desired": good, "rollback_to": "yes"})
    assert "unit_text" in commands.validate_start({"run": "r", "desired": dict(good, supervisor="systemd")})


# ------------------------------------------------------------------------------- agentcmd
def test_the_agent_is_one_content_addressed_file_with_the_gpu_probe_in_it():
    source = agentcmd.agent_source()
    assert agentcmd.agent_sha() == hashlib.sha256(source.encode()).hexdigest()
    assert agentcmd.agent_path() == f"/var/lib/gpugate/agent-{agentcmd.agent_sha()}.py"
    namespace: dict = {}
    exec(compile(source, "<agent>", "exec"), namespace)
    assert "def collect(" in namespace["_BUNDLE"]["gpugate.agent.gpu_probe"]
    assert len(agentcmd.observe_command("/usr/bin/python3", {"port": 30000})) < 2000
    assert "agent_source" not in agentcmd.start_stdin({"run": "r"}, include_source=False)
    assert json.loads(agentcmd.start_stdin({"run": "r"}, include_source=True))["agent_source"] == source


def test_parse_output_never_raises():
    assert agentcmd.parse_output(["login banner", '{"ok": true}\r']) == {"ok": True}
    assert "error" in agentcmd.parse_output(["Traceback (most recent call last):", "{broken"])
    assert "error" in agentcmd.parse_output(None) and "error" in agentcmd.parse_output("")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_commands_run_through_a_real_shell():
    port = free_port()
    inline = subprocess.run(["sh", "-c", agentcmd.inline_observe_command(sys.executable, {"port": port})],
                            capture_output=True, text=True, timeout=60)
    doc = agentcmd.parse_output(inline.stdout.splitlines())
    assert doc["sglang"]["running"] is False and doc["sglang"]["listening"] is False, inline.stderr
    assert doc["agent"]["sha256"] == agentcmd.agent_sha() and doc["container"]["pid1"]
    with socket.socket() as sock:  # a listener that is not a server: reported as a port holder
        sock.bind(("127.0.0.1", port))
        sock.listen()
        inline = subprocess.run(["sh", "-c", agentcmd.inline_observe_command(sys.executable, {"port": port})],
                                capture_output=True, text=True, timeout=60)
        holders = agentcmd.parse_output(inline.stdout.splitlines())["container"]["port_holders"]
        assert [h["pid"] for h in holders] == [os.getpid()]
    if not os.path.exists(agentcmd.agent_path()):  # the bootstrap checks the installed file by hash
        missing = subprocess.run(["sh", "-c", agentcmd.follow_command(sys.executable, "r1", 0, 0)],
                                 capture_output=True, text=True, timeout=60)
        assert agentcmd.parse_output(missing.stdout.splitlines())["agent_missing"] is True
    no_python = subprocess.run(["sh", "-c", agentcmd.observe_command("/nonexistent/python3", {"port": port})],
                               capture_output=True, text=True, timeout=60)
    assert agentcmd.parse_output(no_python.stdout.splitlines())["no_python"] is True


def test_the_log_pump_masks_secrets_and_rotates_by_size(tmp_path):
    log = tmp_path / "sglang-30000.log"
    lines = "".join(f"line {n} server_args=ServerArgs(api_key='sk-pump-1', hf=hf-pump-secret)\n" for n in range(60))
    # as the agent starts it: the arguments (the log path names sglang) in the environment, not the argv
    env = dict(os.environ, GPUGATE_LOG_SECRETS=json.dumps(["hf-pump-secret"]),
               GPUGATE_LOGPUMP=json.dumps({"path": str(log), "max_bytes": 1000, "keep": 2}))
    done = subprocess.run([sys.executable, loader.__file__, "logpump", "gpugate-probe"],
                          input=lines, capture_output=True, text=True, env=env, timeout=60)
    assert json.loads(done.stdout)["ok"], done.stderr
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["sglang-30000.log", "sglang-30000.log.1", "sglang-30000.log.2"]
    for path in tmp_path.iterdir():
        text = path.read_text()
        assert 0 < len(text) <= 1000 and "sk-pump-1" not in text and "hf-pump-secret" not in text
        assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert "line 59 server_args=ServerArgs(api_key='***', hf=***)" in log.read_text()


def test_a_tail_leaves_out_gpugates_own_polls_and_keeps_the_servers_last_words(tmp_path):
    log = tmp_path / "sglang-30000.log"
    own = ['INFO:     127.0.0.1:%d - "GET %s HTTP/1.1" %d' % (40000 + i, path, status)
           for i, (path, status) in enumerate([("/health", 503), ("/health_generate", 200),
                                               ("/get_server_info", 200), ("/v1/models", 200)] * 3000)]
    words = ["[2026-01-01 10:00:00] Load weight begin", "[2026-01-01 10:00:01] Capture cuda graph: 37%",
             'INFO:     10.0.0.7:5000 - "GET /health HTTP/1.1" 200']  # a client's poll is the server's business
    log.write_text("=== gpugate start\n" + "\n".join(words[:2] + own + words[2:] + own[:50]) + "\n")
    assert logs.log_tail(str(log), 4) == ["=== gpugate start"] + words
    assert logs.log_tail(str(log), 2) == words[1:]
    after = len(log.read_bytes().split(words[2].encode())[0]) + len(words[2]) + 1
    assert logs.log_tail(str(log), 30, offset=after) == []  # only polls after this start's offset
    assert logs.log_tail(str(tmp_path / "none.log"), 3) == []
