"""Issue 20's pure parts, fast: the history that does not read (set aside, the copy used, said),
the stall's words, a hand-off after its claim's window (the doctests of the modules those live in
run in test_doctests.py, with every other module's)."""

from __future__ import annotations

import json
import os

import pytest

from gpugate.agent import history, state
from gpugate.agent.commands import claim_lapsed
from gpugate.plan import stall_text


@pytest.fixture
def state_dir(tmp_path, monkeypatch):
    monkeypatch.setattr(state, "STATE_DIR", str(tmp_path))
    return tmp_path


def good(key):
    return {"key": key, "spec": {"argv": [key], "port": 30000}, "record": {"key": key}}


def test_every_save_keeps_the_copy_it_replaces(state_dir):
    for keys in (["a"], ["b", "a"]):
        history.save_history(30000, dict(history.empty_history(30000), good=[good(k) for k in keys]))
    prev = json.loads((state_dir / "sglang-30000.json.prev").read_text())
    assert [entry["key"] for entry in prev["good"]] == ["a"]
    assert oct(os.stat(state_dir / "sglang-30000.json.prev").st_mode & 0o777) == "0o600"


@pytest.mark.parametrize("damage, reason", [
    (lambda text: text[: len(text) // 2], "truncated JSON"),
    (lambda _text: '{"schema": 2, "good": [1, "x"], "failed": []}', "wrong shape: good[0] is int, not an object"),
    (lambda _text: "", "empty file"),
])
def test_a_history_that_does_not_read_is_set_aside_and_the_copy_used(state_dir, damage, reason):
    for keys in (["a"], ["b", "a"], ["b", "a"]):
        history.save_history(30000, dict(history.empty_history(30000), good=[good(k) for k in keys]))
    path = state_dir / "sglang-30000.json"
    path.write_text(damage(path.read_text()))

    seen = history.load_history(30000, repair=False)  # observe: reports, moves nothing
    assert [e["key"] for e in seen["good"]] == ["b", "a"] and path.exists()
    assert history.public_history(seen, 30000)["problem"].startswith(f"the history of :30000 is unreadable ({reason})")

    doc = history.load_history(30000)  # the agent's transition: set aside, the copy written back
    kept = doc["recovered"]["kept_as"]
    assert os.path.exists(kept) and ("wrong-shape" in kept) == reason.startswith("wrong shape")
    assert [e["key"] for e in history.load_history(30000)["good"]] == ["b", "a"]
    note = history.public_history(history.load_history(30000), 30000)["problem"]
    assert note.startswith(f"the history of :30000 was unreadable ({reason}): kept as {kept}; using the copy of ")
    os.unlink(kept)  # looked at: no longer said
    assert history.public_history(history.load_history(30000), 30000)["problem"] is None


def test_no_copy_that_reads_starts_an_empty_history_and_says_so(state_dir):
    (state_dir / "sglang-30000.json").write_text("{not json")
    doc = history.load_history(30000)
    assert doc["good"] == [] and "no earlier copy reads" in history.recovery_text(30000, doc["recovered"])


def test_the_stall_is_said_only_past_the_bound():
    agent = {"pid": 7, "state": "T", "state_name": "stopped", "silent_s": 31.4}
    assert stall_text(agent, 30) == "the agent pid 7 has written nothing for 31 s (state T: stopped)"
    assert stall_text(agent, 40) is None and stall_text(None, 30) is None


def test_a_hand_off_after_its_claims_window_is_refused():
    assert claim_lapsed({"run": "r1", "claim_until": 100.0}, now=99.0).startswith("the hand-off of run r1 came after")
    assert claim_lapsed({"run": "r1", "claim_until": 100.0}, now=90.0) is None
    assert claim_lapsed({"run": "r1"}, now=1e12) is None  # no claim (a host without GPU claims)
