"""What is secret, how it is masked, and the fingerprints recorded instead of values.

Both sides use this module: the controller (gpugate.engine.sglang.flags, gpugate.spec, the plan) to keep
secrets out of diffs and messages, the agent to mask argv, logs, journal events and history
records, and to fingerprint what it must compare without showing (argv_hash, env_hash).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping  # loaded with re already: free

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is never imported at run time (~10 ms of every agent command)
    from typing import Any, Iterable, Sequence

SECRET_MASK = "***"
MASK = SECRET_MASK  # the agent's name for it

# Flags (canonical names) whose values are secrets: never shown in a diff, a log, an error, a record.
# (hf-token: vLLM's token for the Hub, whose own startup log prints it as ***)
SECRET_FLAGS = frozenset({"api-key", "admin-api-key", "ssl-keyfile-password", "hf-token"})
_SECRET_NAME = re.compile(r"(^|-)(api-key|password|secret)$")
# The options the agent always masks in an argv (the controller sends any others as secret_flags).
ALWAYS_MASKED_FLAGS = ("api-key", "admin-api-key", "hf-token")
ALWAYS_MASKED_OPTIONS = tuple("--" + name for name in ALWAYS_MASKED_FLAGS)

# What names a secret (an env variable's name, a key of a JSON-valued flag such as ``{"hf_token": ...}``
# in --model-loader-extra-config, a key of a document): a part of the name, split at ``_ - .`` and at
# case changes (HF_TOKEN, hfToken, x-api-key: its parts are hf/token, hf/token, x/api/key), that is or
# ends with one of these words, plural or not, in any case (HFTOKEN, APIKEYS, OAUTH count;
# TOKENIZERS_PARALLELISM does not). The operator names more with the setting ``secret_env``. The list
# is documented in docs/transition.md ("Secrets"); tests/unit/test_secret_env.py holds its cases.
SECRET_NAME_WORDS = ("token", "key", "secret", "password", "passwd", "pass", "passphrase", "credential", "cred",
                     "auth", "authorization", "bearer", "cookie")
_NAME_PART = re.compile(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|[0-9]+")
# ``name=value`` shapes in free text (SGLang prints its ServerArgs) whose value is masked.
SECRET_WORDS = ("api_key", "admin_api_key", "token", "password", "secret")
MIN_SECRET_TEXT = 6  # shorter values are never masked as secrets: "root", "1", "true" would mangle every line
# Values that are words of everyday text, never masked as secrets even when long enough (a "secret"
# "ubuntu" would mask every path and hostname that holds it).
COMMON_VALUES = frozenset(("true", "false", "enabled", "disabled", "default", "ubuntu", "debian",
                           "python", "python3", "localhost", "127.0.0.1", "0.0.0.0", "C.UTF-8", "en_US.UTF-8",
                           "/root", "/bin/bash", "/bin/sh", "xterm-256color", "info", "debug", "warning"))
_PLAIN_VALUE = re.compile(r"^[\d\s.,:;_/+-]*$")
_SECRET_ASSIGN = re.compile(r"((?:%s)\s*[=:]\s*)('[^']*'|\"[^\"]*\"|[^\s,)]+)" % "|".join(
    re.escape(word) for word in SECRET_WORDS), re.IGNORECASE)
_SECRET_FLAG_TEXT = re.compile(r"(--(?:admin-)?api-key(?:=|\s+))(\S+)")


def sha256(data: bytes) -> Any:
    """hashlib.sha256 without hashlib: its OpenSSL import costs ~8 ms of every agent command."""
    try:
        from _sha256 import sha256 as implementation  # CPython <= 3.11
    except ImportError:
        try:
            from _sha2 import sha256 as implementation  # CPython >= 3.12
        except ImportError:
            from hashlib import sha256 as implementation
    return implementation(data)


def env_hash(value: str) -> str:
    """A value's fingerprint: the controller compares env values it never sees.

    >>> env_hash("x")[:4]
    'c365'
    """
    return sha256(("gpugate-env:" + value).encode("utf-8")).hexdigest()[:16]


def argv_hash(argv: Sequence[str]) -> str:
    """An argv's fingerprint (secret values included), recorded instead of the values.

    >>> argv_hash(["python3", "-m", "sglang.launch_server"]) == argv_hash(["python3", "-m", "sglang.launch_server"])
    True
    """
    return sha256(("gpugate-argv:" + "\0".join(argv)).encode("utf-8")).hexdigest()[:16]


def is_secret_name(name: str) -> bool:
    """A flag name (canonical, no dashes in front) whose value is always secret.

    >>> is_secret_name("api-key"), is_secret_name("ssl-keyfile-password"), is_secret_name("tp-size")
    (True, True, False)
    """
    return name in SECRET_FLAGS or bool(_SECRET_NAME.search(name))


def names_a_secret(name: Any, declared: Iterable[str] = ()) -> bool:
    """Whether ``name`` (an env variable's, a document's key) names a secret: a part of it is or ends
    with one of SECRET_NAME_WORDS (plural or not, any case), or it is one of ``declared`` (the
    operator's ``secret_env``, any case). The one rule of both sides: the controller's diffs and
    messages, the agent's logs, journal and records.

    >>> names_a_secret("HF_TOKEN"), names_a_secret("DB_Passwd"), names_a_secret("openaiApiKey")
    (True, True, True)
    >>> names_a_secret("TOKENIZERS_PARALLELISM"), names_a_secret("model_path"), names_a_secret("DB_URL", ["db_url"])
    (False, False, True)
    """
    text = str(name)
    if any(text.lower() == str(other).lower() for other in declared):
        return True
    for part in _NAME_PART.findall(text):
        part = part.lower()
        if any(part.endswith(word) or part.endswith(word + "s") for word in SECRET_NAME_WORDS):
            return True
    return False


def secret_env_names(env: Mapping[str, Any] | None, declared: Iterable[str] = ()) -> list[str]:
    """The names of ``env`` whose values are secrets (:func:`names_a_secret`).

    >>> secret_env_names({"HF_TOKEN": "hf_1", "SGLANG_LOAD_S": "0.5"})
    ['HF_TOKEN']
    """
    declared = tuple(declared)
    return sorted(name for name in (env or {}) if names_a_secret(name, declared))


def shown_env_value(name: str, value: Any, declared: Iterable[str] = ()) -> Any:
    """An env value as it may be shown anywhere: itself, or ``***`` when its name names a secret.

    >>> shown_env_value("HF_TOKEN", "hf_1"), shown_env_value("SGLANG_LOAD_S", "0.5")
    ('***', '0.5')
    """
    return MASK if names_a_secret(name, declared) else value


def shown_env(env: Mapping[str, Any] | None, declared: Iterable[str] = ()) -> dict[str, Any]:
    """``env`` as it may be shown anywhere (:func:`shown_env_value` of each).

    >>> shown_env({"HF_TOKEN": "hf_1", "CUDA_VISIBLE_DEVICES": "0,1"})
    {'HF_TOKEN': '***', 'CUDA_VISIBLE_DEVICES': '0,1'}
    """
    declared = tuple(declared)
    return dict((name, shown_env_value(name, value, declared)) for name, value in (env or {}).items())


def json_holds_secret(value: Any) -> bool:
    """Whether a JSON document (or its text) has a key, at any depth, naming a secret
    (:func:`names_a_secret`: token, key, secret, password, credential, auth, ...).

    >>> json_holds_secret('{"hf_token": "hf_x"}'), json_holds_secret({"rope_theta": 1e6})
    (True, False)
    >>> json_holds_secret([{"load": {"AuthHeader": "x"}}])
    True
    """
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError:
            return False
    if isinstance(value, Mapping):
        return any(names_a_secret(key) or json_holds_secret(item) for key, item in value.items())
    if isinstance(value, (list, tuple)):
        return any(json_holds_secret(item) for item in value)
    return False


def is_secret_value(name: str, value: Any, declared_secret: bool = False, json_valued: bool = False) -> bool:
    """Whether the value of flag ``name`` must never be shown: a secret flag (by name, or
    ``declared_secret`` by the flag table), or a JSON-valued flag whose document has a key
    naming a secret.

    >>> is_secret_value("api-key", "sk-1"), is_secret_value("x-config", '{"hf_token": "x"}', json_valued=True)
    (True, True)
    """
    if declared_secret or is_secret_name(name):
        return True
    return json_valued and json_holds_secret(value)


def redact_argv(argv: Sequence[str] | None, secret_flags: Sequence[str] = ALWAYS_MASKED_OPTIONS) -> list[str]:
    """argv with the values of the ``secret_flags`` options as ***.

    >>> redact_argv(["x", "--api-key", "sk-1", "--admin-api-key=a"])
    ['x', '--api-key', '***', '--admin-api-key=***']
    """
    out, hide = [], False
    for arg in argv or []:
        if hide:
            out.append(MASK)
            hide = False
        elif arg in secret_flags:
            out.append(arg)
            hide = True
        elif "=" in arg and arg.split("=", 1)[0] in secret_flags:
            out.append(arg.split("=", 1)[0] + "=" + MASK)
        else:
            out.append(arg)
    return out


def secret_flag_values(argv: Sequence[str] | None, secret_flags: Sequence[str] = ALWAYS_MASKED_OPTIONS) -> list[str]:
    """The values of the ``secret_flags`` options in ``argv`` (what a Redactor must mask).

    >>> secret_flag_values(["x", "--api-key", "sk-1", "--admin-api-key=a"])
    ['sk-1', 'a']
    """
    values = []
    argv = list(argv or [])
    for index, arg in enumerate(argv):
        if arg in secret_flags and index + 1 < len(argv):
            values.append(argv[index + 1])
        elif "=" in arg and arg.split("=", 1)[0] in secret_flags:
            values.append(arg.split("=", 1)[1])
    return values


def maskable(value: Any) -> bool:
    """Whether ``value`` may be masked as a secret wherever it appears in text: at least
    MIN_SECRET_TEXT characters, not a common word, not only digits and separators (a port, GPU
    ids, a version). A secret "root" would mask every "root" (an operator's ``root@vm``).

    >>> [maskable(v) for v in ("root", "true", "0,1,2,3", "sk-canary-7f3a9b")]
    [False, False, False, True]
    """
    return (isinstance(value, str) and len(value.strip()) >= MIN_SECRET_TEXT and value not in COMMON_VALUES
            and value.lower() not in COMMON_VALUES and not _PLAIN_VALUE.match(value))


class Redactor:
    """Masks known secret values (env values, secret flag values) and SGLang's own
    ``api_key='...'`` shapes wherever they appear in text.

    >>> Redactor(["sk-secret-1"]).text("server_args=ServerArgs(api_key='sk-secret-1', port=1)")
    "server_args=ServerArgs(api_key='***', port=1)"
    """

    def __init__(self, values: Iterable[Any] = ()) -> None:
        self.values = sorted(set(v for v in values if maskable(v)), key=len, reverse=True)

    def add(self, values: Iterable[Any]) -> None:
        self.values = sorted(set(self.values) | set(v for v in values if maskable(v)), key=len, reverse=True)

    def text(self, text: Any) -> Any:
        if not isinstance(text, str):
            return text
        for value in self.values:
            if value in text:
                text = text.replace(value, MASK)

        def assign(match: Any) -> str:
            value = match.group(2)
            if value in ("None", "null", "''", '""'):
                return match.group(0)
            quote = value[0] if value[:1] in ("'", '"') else ""
            return match.group(1) + quote + MASK + quote

        text = _SECRET_ASSIGN.sub(assign, text)
        return _SECRET_FLAG_TEXT.sub(lambda m: m.group(1) + (m.group(2) if m.group(2) == MASK else MASK), text)

    def deep(self, value: Any) -> Any:
        """The same over a JSON-able document (strings anywhere in it)."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, list):
            return [self.deep(item) for item in value]
        if isinstance(value, dict):
            return dict((key, self.deep(item)) for key, item in value.items())
        return value


_CONTROL = re.compile(r"[\x00-\x1f\x7f]+")


def leaf_strings(value: Any) -> list:
    """Every string inside ``value`` (itself, list items, mapping keys' values, at any depth), and
    the whole as its repr: what an error about it may quote.

    >>> leaf_strings({"api-key": ["sk-1"], "tp": 2})
    ['sk-1', "{'api-key': ['sk-1'], 'tp': 2}"]
    """
    out = []
    todo = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            out.append(item)
        elif isinstance(item, dict):
            todo.extend(item.values())
        elif isinstance(item, (list, tuple, set)):
            todo.extend(item)
    if not isinstance(value, str):
        out.append(repr(value))
    return out


def mask_values(text: Any, secrets: Iterable[Any]) -> Any:
    """``text`` with each of ``secrets`` masked, whatever its length (unlike :class:`Redactor`, for the
    few values known to be secrets, such as a key a request carried): as it is, as ``repr`` shows it
    (an exception's text quotes a header as bytes: ``b'Bearer sk-1\\r'``), and each part of it between
    control characters. Masking ``<key>`` masks ``Bearer <key>`` too (``Bearer ***``).

    >>> mask_values("Invalid header value b'Bearer sk-1\\\\r'", ["sk-1\\r"])
    "Invalid header value b'Bearer ***'"
    >>> mask_values("no secret here", [None, ""])
    'no secret here'
    """
    if not isinstance(text, str):
        return text
    forms: set[str] = set()
    for value in secrets:
        if not isinstance(value, str) or not value:
            continue
        forms.update((value, repr(value)[1:-1], repr(value.encode("utf-8", "backslashreplace"))[2:-1]))
        forms.update(part for part in _CONTROL.split(value) if len(part) >= 4 or part == value.strip())
    for form in sorted((f for f in forms if f), key=len, reverse=True):
        text = text.replace(form, MASK)
    return text


def spec_secrets(spec: dict | None, declared: Iterable[str] = ()) -> list[str]:
    """The secret values of a SpecDoc: the values of its env names that name a secret (its own
    ``secret_env`` and ``declared`` count: the operator's names) and the values of its secret options.
    Its other env values are shown as they are (a crash's ``could not convert string to float: 'x'``).

    >>> spec_secrets({"argv": ["x", "--api-key", "sk-1"], "env": {"HF_TOKEN": "hf-1", "SGLANG_LOAD_S": "0.5x"}})
    ['hf-1', 'sk-1']
    >>> spec_secrets({"argv": ["x"], "env": {"DB_URL": "pg://u:p@h"}, "secret_env": ["DB_URL"]})
    ['pg://u:p@h']
    """
    if not spec:
        return []
    flags = tuple(ALWAYS_MASKED_OPTIONS) + tuple(spec.get("secret_flags") or ())
    env = spec.get("env") or {}
    names = secret_env_names(env, tuple(spec.get("secret_env") or ()) + tuple(declared))
    return [env[name] for name in names] + secret_flag_values(spec.get("argv") or [], flags)
