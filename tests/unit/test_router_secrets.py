"""The router's API key never reaches a message and never follows a redirect (issue 32, items 1 and 4),
against real local HTTP servers (http.server on 127.0.0.1, in a thread): one answers as smg does,
another stands for whatever host a redirect names and records whether an Authorization header
arrived there."""

from __future__ import annotations

import contextlib
import http.server
import json
import threading
from collections.abc import Iterator

import pytest

from gpugate import router
from gpugate.report import status
from gpugate.router.smg import RouterError, SmgClient
from gpugate.rules import redact
from gpugate.spec import Routing

KEY = "sk-canary-7f3a9b2c41"


class Recorder(http.server.ThreadingHTTPServer):
    """A local server that records every request (method, path, Authorization) and answers with
    ``answer(handler)``: as smg does by default."""

    daemon_threads = True

    def __init__(self, answer=None):
        self.seen: list[tuple[str, str, str | None]] = []
        self.answer = answer or smg_answer
        super().__init__(("127.0.0.1", 0), _Handler)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_port}"


class _Handler(http.server.BaseHTTPRequestHandler):
    def _any(self) -> None:
        length = int(self.headers.get("content-length") or 0)
        if length:
            self.rfile.read(length)
        self.server.seen.append((self.command, self.path, self.headers.get("authorization")))  # type: ignore[attr-defined]
        self.server.answer(self)  # type: ignore[attr-defined]

    do_GET = do_POST = do_DELETE = _any

    def log_message(self, *args) -> None:  # quiet
        pass


def smg_answer(handler: http.server.BaseHTTPRequestHandler) -> None:
    body = json.dumps({"workers": [{"id": "w1", "url": "http://127.0.0.1:31129", "model_id": "m",
                                    "is_healthy": True, "status": "ready"}], "total": 1}).encode()
    code = 202 if handler.command in ("POST", "DELETE") else 200
    handler.send_response(code)
    handler.send_header("content-type", "application/json")
    handler.send_header("content-length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)


def redirect_to(target: str, code: int):
    def answer(handler: http.server.BaseHTTPRequestHandler) -> None:
        handler.send_response(code)
        handler.send_header("location", target + handler.path)
        handler.send_header("content-length", "0")
        handler.end_headers()
    return answer


@contextlib.contextmanager
def serving(server: Recorder) -> Iterator[Recorder]:
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def smg() -> Iterator[Recorder]:
    with serving(Recorder()) as server:
        yield server


@pytest.fixture
def elsewhere() -> Iterator[Recorder]:
    """The host a redirect names."""
    with serving(Recorder()) as server:
        yield server


def no_key_in(text: str, key: str = KEY) -> bool:
    """Neither the key, nor any part of it between control characters, nor its repr."""
    pieces = [p for p in key.replace("\r", "\n").replace("\t", "\n").split("\n") if len(p) >= 4]
    return all(p not in text for p in [key, repr(key)[1:-1], *pieces])


@pytest.mark.parametrize("bad, name", [("\r", "CR"), ("\n", "LF"), ("\r\n", "CR"), ("\t", "TAB"),
                                       ("\x1b", "0x1b"), ("\x7f", "DEL")])
def test_a_key_with_a_control_character_is_refused_naming_the_variable_and_nothing_is_sent(
        monkeypatch, smg, bad, name):
    key = KEY + bad if bad != "\x1b" else KEY[:6] + bad + KEY[6:]
    monkeypatch.setenv("GW_TEST_KEY", key)
    client = SmgClient(smg.url, "GW_TEST_KEY")
    for call in (client.workers, lambda: client.remove("w1"), lambda: client.add({"url": "http://a:1"})):
        with pytest.raises(RouterError) as error:
            call()
        text = str(error.value)
        assert "the key in $GW_TEST_KEY holds a control character" in text, text
        assert f"({name}" in text and "CRLF" in text, text
        assert no_key_in(text, key), text
        assert error.value.unreachable
    assert smg.seen == []  # nothing sent


def test_a_key_beyond_latin_1_is_refused_before_anything_is_sent(monkeypatch, smg):
    monkeypatch.setenv("GW_TEST_KEY", KEY + "\u2019")
    with pytest.raises(RouterError) as error:
        SmgClient(smg.url, "GW_TEST_KEY").workers()
    assert "the key in $GW_TEST_KEY holds a character an HTTP header cannot carry" in str(error.value)
    assert "\u2019" not in str(error.value) and KEY not in str(error.value)
    assert smg.seen == []


def test_a_good_key_goes_to_the_router_as_a_bearer_token(monkeypatch, smg):
    monkeypatch.setenv("GW_TEST_KEY", KEY)
    assert [w["id"] for w in SmgClient(smg.url, "GW_TEST_KEY").workers()] == ["w1"]
    assert smg.seen == [("GET", "/workers", f"Bearer {KEY}")]


def test_an_exceptions_text_from_a_request_that_held_the_key_is_masked(monkeypatch, smg):
    """Whatever the HTTP client puts in its error (Python's puts the header: ``Invalid header value
    b'Bearer <key>\\r'``), the message built from it masks the key and ``Bearer <key>``."""
    monkeypatch.setenv("GW_TEST_KEY", KEY)
    client = SmgClient(smg.url, "GW_TEST_KEY")

    def leaky_open(request, timeout=None):
        raise ValueError(f"Invalid header value {('Bearer ' + KEY + chr(13)).encode()!r} "
                         f"and {request.get_header('Authorization')}")

    monkeypatch.setattr(client, "_open", leaky_open)
    with pytest.raises(RouterError) as error:
        client.workers()
    text = str(error.value)
    assert "unreachable: GET /workers: Invalid header value" in text and no_key_in(text), text
    assert "Bearer ***" in text, text


def test_the_masking_helper_masks_every_form_of_a_secret_whatever_its_length():
    text = "b'Bearer sk-1\\r' / Bearer sk-1 / 'sk-1\\n' / x"
    assert redact.mask_values(text, ["sk-1\r"]) == "b'Bearer ***' / Bearer *** / '***\\n' / x"
    assert redact.mask_values(text, ["sk-1\n"]) == "b'Bearer ***\\r' / Bearer *** / '***' / x"
    assert redact.mask_values("abc", ["", None]) == "abc"


@pytest.mark.parametrize("code", [301, 302, 303, 307, 308])
def test_a_redirecting_router_gets_no_second_request_and_the_key_goes_nowhere(monkeypatch, elsewhere, code):
    monkeypatch.setenv("GW_TEST_KEY", KEY)
    with serving(Recorder(redirect_to(elsewhere.url, code))) as gw:
        client = SmgClient(gw.url, "GW_TEST_KEY")
        for call, method in ((client.workers, "GET"), (lambda: client.add({"url": "http://a:1"}), "POST"),
                             (lambda: client.remove("w1"), "DELETE")):
            with pytest.raises(RouterError) as error:
                call()
            text = str(error.value)
            assert f"router {gw.url} redirected {method} " in text, text
            assert f"({code}) to http://127.0.0.1:{elsewhere.server_port}" in text, text
            assert "gpugate does not follow redirects with its key" in text, text
            assert no_key_in(text)
        assert [m for m, _p, _a in gw.seen] == ["GET", "POST", "DELETE"]  # one request each, no second
    assert elsewhere.seen == []  # nothing at all arrived where the redirect pointed, the key least of all


def test_a_redirect_to_a_path_of_the_router_is_not_followed_either(monkeypatch):
    monkeypatch.setenv("GW_TEST_KEY", KEY)
    with serving(Recorder(redirect_to("", 307))) as gw:
        with pytest.raises(RouterError) as error:
            SmgClient(gw.url, "GW_TEST_KEY").workers()
        assert "redirected GET /workers (307) to a path of its own (/workers)" in str(error.value)
        assert len(gw.seen) == 1


def test_the_preflight_and_the_status_say_why_without_the_key(monkeypatch, smg, elsewhere):
    """Where the messages go: the preflight's refusal (--dry and the deploy) and the status row."""
    routing = Routing("gw", smg.url, "http://127.0.0.1:31129", api_key_env="GW_TEST_KEY")
    monkeypatch.setenv("GW_TEST_KEY", KEY + "\r")
    problem = router.preflight(routing).problem or ""
    assert "the key in $GW_TEST_KEY holds a control character" in problem and no_key_in(problem, KEY + "\r")
    monkeypatch.setattr(status, "_ROUTER_CACHE", {})
    view = status.router_view(type("D", (), {"routing": routing})())
    assert view["state"] == "unknown" and "$GW_TEST_KEY holds a control character" in view["error"], view
    assert no_key_in(json.dumps(view), KEY + "\r")
    assert smg.seen == []


@pytest.mark.parametrize("data", [
    {"sglang_flags": {"api-key": ["sk-canary-flag-1"]}},
    {"sglang_flags": {"admin-api-key": {"a": "sk-canary-flag-1"}}},
    {"sglang_flags": {"model-loader-extra-config": '{"hf_token": "sk-canary-flag-1"'}},
    {"sglang_flags": "api-key=sk-canary-flag-1"},
    {"sglang_extra_args": ["--api-key", "sk-canary-flag-1\n"]},
    {"sglang_extra_args": ["--api-key", 5, "sk-canary-flag-1"]},
])
def test_a_bad_value_holding_the_servers_own_key_is_refused_without_quoting_it(data):
    """Issue 32 item 1, the server's own secrets: a refusal of a flag or extra_args value never
    quotes the value (an --api-key given as a list, a JSON flag holding an hf_token, a line break)."""
    from gpugate.settings import SettingsError
    from gpugate.spec import desired_state

    try:
        desired = desired_state(dict(data, sglang_model_path="/m"))
        said = desired.problem or ""
    except SettingsError as error:
        said = str(error)
    assert said and "sk-canary-flag-1" not in said, said
