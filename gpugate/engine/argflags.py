"""An engine's server flags from its own argparse parser, release by release: validation, argv
render and parse, diffs, secrets. Engine-neutral: what an engine's parser does not say is its
:class:`Overlay` (fields gpugate sets itself, short spellings, JSON held in strings, known
conflicts, the entry of its command line), and each engine binds one :class:`ArgparseFlags`
(gpugate/engine/sglang/flags.py, gpugate/engine/vllm/flags.py).

Tables come from the engine's own parser, never written by hand (docs/flags.md): an engine's
``table_builder.py`` describes it (gpugate/engine/argparse_table.py), in the container for the
release installed there, or from a release's wheel (scripts/flags_snapshot.py -> the snapshots in
``gpugate/engine/<engine>/flagtables/``). ``table=None`` everywhere means the union of the
snapshots: "a flag of some release gpugate has a snapshot of".

Vocabulary
----------
- *canonical name*: an option string without dashes: the one spelled like the parser's dest
  (``tp-size``, ``kv-cache-dtype``), else the action's first. Other spellings (aliases, snake
  case, the overlay's short names) map onto it.
- *normalised flags*: ``dict[canonical name, typed value]``; a store_true switch that is set is
  ``True``, one that is not set is absent; an ``--x/--no-x`` switch keeps ``False`` (``--no-x``).

Example::

    >>> import argparse, tempfile
    >>> parser = argparse.ArgumentParser()
    >>> _ = parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    >>> _ = parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto")
    >>> from gpugate.engine import argparse_table
    >>> doc = argparse_table.table_from_parser(parser, "1.0", "ab" * 32, version_key="demo_version")
    >>> demo = ArgparseFlags(Overlay(package="demo", label="Demo", version_key="demo_version",
    ...                              snapshot_dir=Path(tempfile.mkdtemp()), short_names={"tp": "tensor-parallel-size"}))
    >>> table = demo.table_from_doc(doc)
    >>> demo.validate_flags({"tp": "2", "kv-cache-dtype": "fp8"}, table)
    {'kv-cache-dtype': 'fp8', 'tensor-parallel-size': 2}
    >>> demo.validate_flags({"kv-cache-dtype": "fp9"}, table)
    Traceback (most recent call last):
    ...
    gpugate.engine.FlagError: --kv-cache-dtype: 'fp9' is not one of auto, fp8 in Demo 1.0; did you mean fp8?
    >>> demo.redact_flags({"api-key": "sk-1", "tensor-parallel-size": 2})
    {'api-key': '***', 'tensor-parallel-size': 2}
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import functools
import json
import math
import os
import re
import shlex
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import gpugate.engine as engine_seam
from gpugate.engine import Engine
from gpugate.rules import redact
from gpugate.rules.redact import SECRET_MASK

FlagError = engine_seam.FlagError  # the seam's: what every engine's validation raises


@dataclasses.dataclass(frozen=True)
class Overlay:
    """What an engine's parser does not say, for :class:`ArgparseFlags`.

    ``package``: the engine's package (snapshot files ``<package>-<version>.json``, the cache
    ``<package>-flags``, the observe section); ``label``: how messages name it; ``version_key``:
    the table document's key of the release; ``separate_fields``: options gpugate sets itself ->
    why they are refused as flags; ``field_dests``: their argparse dests (left out of the table);
    ``model_options``: the options that name the model; ``short_names``: the short spellings
    accepted; ``field_names``: canonical names kept across releases; ``json_text_flags``: options
    declared as strings and read as JSON, and ``json_text_help``: the words in a string option's help
    that say the engine reads it as JSON (a release's new ones found without a list); ``check_conflicts``: the engine's known conflicts
    (FlagError); ``args_start``: where a full command's server arguments begin."""

    package: str
    label: str
    version_key: str
    snapshot_dir: Path
    separate_fields: Mapping[str, str] = dataclasses.field(default_factory=dict)
    field_dests: tuple[str, ...] = ("model_path", "model", "host", "port", "config")
    model_options: tuple[str, ...] = ("model-path", "model")
    short_names: Mapping[str, str] = dataclasses.field(default_factory=dict)
    field_names: frozenset[str] = frozenset()
    json_text_flags: frozenset[str] = frozenset()
    json_text_help: str = ""
    check_conflicts: Callable[[Mapping[str, Any]], None] = lambda flags: None
    args_start: Callable[[Sequence[str]], int] = lambda argv: 0
    default_host: str = "127.0.0.1"
    default_port: int = 8000
    builder_file: str = ""  # the engine's table_builder.py, sent into containers
    cache_dir: str = ""     # where the container keeps the tables it built


@dataclasses.dataclass(frozen=True)
class FlagSpec:
    """One server argument, as the engine's parser declares it.

    kind: ``bool`` (a switch: store_true, store_const, a deprecated switch), ``switch``
    (``--x/--no-x``: True, False or absent), ``int``, ``float``, ``str``, ``choice`` (one of
    ``choices``, each of type ``item``), ``list`` (``nargs`` +, * or N of ``item``), ``json`` (a
    JSON document as one string; YAML mappings/lists are serialised canonically).
    ``type_name``: the engine's converter when it is not int/float/str/json (e.g.
    ``sglang.srt.utils.common.human_readable_int``): values are passed as text.
    ``deprecated``: the engine's own words when it is used (``message``), or None.
    """

    name: str
    kind: str
    default: Any = None
    help: str = ""
    aliases: tuple[str, ...] = ()
    dest: str = ""
    choices: tuple[Any, ...] = ()
    item: str = "str"
    secret: bool = False
    nargs: Any = None
    type_name: str | None = None
    deprecated: Mapping[str, Any] | None = None
    # declared a plain string and read as JSON later (the overlay's json_text_flags): the engine's
    # resolved arguments, and so its info endpoint, hold the exact text of the argv, not a parsed document
    text_json: bool = False
    # a switch's spelling that stores False: ``no-x`` for argparse's BooleanOptionalAction,
    # ``disable-x`` for vLLM's EnableDisableAction (read from the parser: table_builder's "negatives")
    negative: str = ""

    @property
    def option_strings(self) -> list[str]:
        """The option strings the parser declares, canonical first."""
        return [f"--{self.name}"] + [f"--{a}" for a in self.aliases]


_ITEM_OF_TYPE = {"int": "int", "float": "float", "str": "str", None: "str"}


@dataclasses.dataclass(frozen=True)
class FlagTable:
    """The flags of one release of an engine (or of the union of its snapshots).

    ``version``: the release (None for the union); ``label``: how messages name it
    ("SGLang 0.5.23"); ``source``: ``snapshot``, ``container`` or ``union``; ``specs``: canonical
    name -> FlagSpec; ``key``: ``<version>-<sha256[:16] of the parser's source>`` (the cache key).
    """

    version: str | None
    label: str
    source: str
    specs: Mapping[str, FlagSpec]
    key: str | None = None
    server_args_sha256: str | None = None
    option_count: int = 0
    short_names: Mapping[str, str] = dataclasses.field(default_factory=dict)  # the overlay's (``tp``)
    engine_label: str = "the engine"  # "SGLang": whose default a message names

    @functools.cached_property
    def names(self) -> dict[str, str]:
        """Every accepted spelling (no dashes, hyphens for underscores) -> canonical name."""
        names: dict[str, str] = {}
        for spec in self.specs.values():
            for option in (spec.name, *spec.aliases):
                names.setdefault(option, spec.name)
            if spec.kind == "switch":
                names.setdefault(spec.negative or "no-" + spec.name, spec.name)
        for spec in self.specs.values():
            names.setdefault(spec.dest.replace("_", "-"), spec.name)
        for short, target in self.short_names.items():
            if target in self.specs:
                names.setdefault(short, target)
        return names

    @functools.cached_property
    def declared(self) -> dict[str, str]:
        """The option strings the parser declares (no dashes) -> canonical name: what
        argparse matches abbreviations against."""
        declared = {o: spec.name for spec in self.specs.values() for o in (spec.name, *spec.aliases)}
        declared.update({(s.negative or "no-" + s.name): s.name for s in self.specs.values() if s.kind == "switch"})
        return declared

    def __repr__(self) -> str:
        return f"FlagTable({self.label}, {len(self.specs)} flags, {self.source})"


def _version_key(version: str) -> tuple:
    parts = re.findall(r"\d+|[A-Za-z]+", version)
    return tuple((0, int(p)) if p.isdigit() else (-1, p) for p in parts)


def _strip_name(name: str) -> str:
    bare = name.strip()
    if bare.startswith("--"):
        bare = bare[2:]
    elif bare.startswith("-"):
        bare = bare[1:]
    return bare.replace("_", "-")


_HUMAN_INT = re.compile(r"^\d+(\.\d+)?(k|M|G|T)$|^\d+(Ki|Mi|Gi|Ti)$")


def _check_token(flag: str, text: str) -> str:
    """A string must survive the trip into argv unchanged: no NUL, encodable."""
    if "\x00" in text:
        raise FlagError(flag, "a value cannot contain a NUL character (argv items end at NUL)")
    try:
        text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        raise FlagError(flag, f"{text!r} cannot be encoded as a command-line argument") from None
    return text


def _type_label(value: object) -> str:
    return type(value).__name__


def _coerce_scalar(flag: str, item: str, value: object, human: bool = False) -> Any:
    if item == "int":
        if isinstance(value, bool):
            raise FlagError(flag, f"expects an integer, got {value!r} ({_type_label(value)})")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(value.strip())
            except ValueError:
                if human and _HUMAN_INT.match(value.strip()):
                    return _check_token(flag, value.strip())  # the engine reads 25.6k, 1Mi: passed as written
        suffix = " or a size like 64k, 1Mi" if human else ""
        raise FlagError(flag, f"expects an integer{suffix}, got {value!r} ({_type_label(value)})")
    if item == "float":
        if isinstance(value, bool):
            raise FlagError(flag, f"expects a number, got {value!r} ({_type_label(value)})")
        number: float | None = None
        if isinstance(value, (int, float)):
            number = float(value)
        elif isinstance(value, str):
            try:
                number = float(value.strip())
            except ValueError:
                number = None
        if number is None:
            raise FlagError(flag, f"expects a number, got {value!r} ({_type_label(value)})")
        if not math.isfinite(number):
            raise FlagError(flag, f"expects a finite number, got {value!r}")
        return number
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise FlagError(flag, f"expects a string, got {value!r} ({_type_label(value)})")
    if isinstance(value, float) and not math.isfinite(value):
        raise FlagError(flag, f"expects a string, got {value!r}")
    return _check_token(flag, value if isinstance(value, str) else repr(value) if isinstance(value, float) else str(value))


def _normalise_value(spec: FlagSpec, value: object, label: str = "the engine", engine: str = "the engine") -> Any:
    """The typed value of ``spec`` for ``value``; ``None`` means "not set" (dropped)."""
    flag = spec.name
    if spec.kind in ("bool", "switch"):
        if isinstance(value, str) and value.strip().lower() in ("true", "false"):
            value = value.strip().lower() == "true"
        if isinstance(value, bool):
            if spec.kind == "switch":
                return value
            return True if value else None
        if spec.kind == "switch" and value is None:
            return None
        raise FlagError(flag, f"is a switch: write true or false, got {value!r} ({_type_label(value)})")
    if value is None:
        raise FlagError(flag, "has no value; remove the flag to use " + engine + "'s default")
    human = bool(spec.type_name and spec.type_name.endswith("human_readable_int"))
    if spec.kind in ("int", "float", "str"):
        return _coerce_scalar(flag, spec.kind, value, human)
    if spec.kind == "choice":
        typed = _coerce_scalar(flag, spec.item, value)
        if typed not in spec.choices:
            close = difflib.get_close_matches(str(typed), [str(c) for c in spec.choices], n=1, cutoff=0.6)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise FlagError(flag, f"{value!r} is not one of {', '.join(str(c) for c in spec.choices)} "
                                  f"in {label}{hint}")
        return typed
    if spec.kind == "list":
        items = value if isinstance(value, (list, tuple)) else [value]
        if not items and spec.nargs != "*":
            raise FlagError(flag, "needs at least one item; remove the flag to use " + engine + "'s default")
        if isinstance(spec.nargs, int) and len(items) != spec.nargs:
            raise FlagError(flag, f"takes exactly {spec.nargs} items in {label}, got {len(items)}")
        typed_items = [_coerce_scalar(flag, spec.item, v) for v in items]
        for item in typed_items:
            if spec.item == "str" and item.startswith("-"):
                raise FlagError(flag, f"list item {item!r} starts with '-' and would be read as a flag")
        return typed_items
    if spec.kind == "json":
        if isinstance(value, str):
            try:
                document = json.loads(value)
            except ValueError as error:
                raise FlagError(flag, f"expects JSON text, got {value!r} ({error})") from None
        elif isinstance(value, (dict, list)):
            document = value
        else:
            raise FlagError(flag, f"expects a JSON document (a mapping, a list or JSON text), got {value!r}")
        try:
            text = json.dumps(document, sort_keys=True, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as error:
            raise FlagError(flag, f"cannot be written as JSON: {error}") from None
        return _check_token(flag, text)
    raise AssertionError(f"unknown kind {spec.kind!r}")


def _value_text(value: Any) -> str:
    if isinstance(value, float):
        return repr(value)
    return str(value)


def _option(flag: str, value: str) -> list[str]:
    # argparse reads a separate token that starts with '-' as another option; `--flag=value`
    # is always read as one value, whatever it holds.
    if value.startswith("-"):
        return [f"--{flag}={value}"]
    return [f"--{flag}", value]


@dataclasses.dataclass
class ParsedCommand:
    """What a running server's command line says.

    ``flags`` is normalised like validate_flags; flags the table does not know are kept under
    their name as written (value: a string, a list of strings, or True), so that diffs show
    them. ``problems`` lists values that did not parse (kept raw in ``flags``).
    """

    model_path: str | None
    host: str = "127.0.0.1"
    port: int = 0
    flags: dict[str, Any] = dataclasses.field(default_factory=dict)
    unknown: list[str] = dataclasses.field(default_factory=list)
    positionals: list[str] = dataclasses.field(default_factory=list)
    problems: list[str] = dataclasses.field(default_factory=list)


def _is_option_token(token: str) -> bool:
    if not token.startswith("-") or token == "-":
        return False
    try:
        float(token)
        return False  # a negative number is a value, as argparse reads it
    except ValueError:
        return True


@dataclasses.dataclass
class FlagDiff:
    """Differences between running and desired flags (both normalised, canonical names).

    ``added``: only desired has them; ``removed``: only running has them; ``changed``:
    ``name -> (running value, desired value)``.
    """

    added: dict[str, Any] = dataclasses.field(default_factory=dict)
    removed: dict[str, Any] = dataclasses.field(default_factory=dict)
    changed: dict[str, tuple[Any, Any]] = dataclasses.field(default_factory=dict)
    display: Callable[[str, Any, bool], str] | None = None  # the engine's rendering of one flag

    @property
    def is_empty(self) -> bool:
        return not (self.added or self.removed or self.changed)

    def __bool__(self) -> bool:
        return not self.is_empty

    def _display(self, name: str, value: Any, redact: bool) -> str:
        if self.display is not None:
            return self.display(name, value, redact)
        return f"--{name}" if value is True else f"--{name} {SECRET_MASK}" if redact else f"--{name} {value}"

    def lines(self, redact: bool = True) -> list[str]:
        """One line per argv change, sorted by flag name; a change is a '-' then a '+' line.

        Example: ``['- --kv-cache-dtype auto', '+ --kv-cache-dtype fp8_e4m3', '+ --disable-radix-cache']``
        (sorted, so ``--disable-radix-cache`` comes first). Secrets read ``***`` unless redact=False.
        """
        out: list[str] = []
        for name in sorted(set(self.added) | set(self.removed) | set(self.changed)):
            if name in self.changed:
                before, after = self.changed[name]
                out.append("- " + self._display(name, before, redact))
                out.append("+ " + self._display(name, after, redact))
            elif name in self.removed:
                out.append("- " + self._display(name, self.removed[name], redact))
            else:
                out.append("+ " + self._display(name, self.added[name], redact))
        return out


_ITEM_TYPES = {"int": int, "float": float, "str": str}


def _json_document(value: Any) -> Any:
    """JSON text parsed (a document as it is; text that is not JSON as it is)."""
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value



class ArgparseFlags:
    """One engine's flags (see the module's docstring): every function takes ``table``, a
    FlagTable, a version with a snapshot, or None for the union of the snapshots."""

    def __init__(self, overlay: Overlay):
        self.overlay = overlay
        self.package, self.label, self.version_key = overlay.package, overlay.label, overlay.version_key
        self.snapshot_dir = overlay.snapshot_dir
        self.separate_fields, self.field_dests = overlay.separate_fields, overlay.field_dests
        self.model_options, self.short_names = overlay.model_options, overlay.short_names
        self.field_names = overlay.field_names | frozenset(overlay.short_names.values())
        self.json_text_flags = overlay.json_text_flags
        self.json_text_help = overlay.json_text_help
        self.server_args_start = overlay.args_start
        self.default_host, self.default_port = overlay.default_host, overlay.default_port
        self.builder_file, self.cache_dir = overlay.builder_file, overlay.cache_dir
        # container tables by key (version + hash of the parser's source: the same key is the same
        # table): a fleet run validates every container against the same few tables
        self._container_tables: dict[str, FlagTable] = {}

    def check_conflicts(self, flags: Mapping[str, Any]) -> None:
        self.overlay.check_conflicts(flags)

    @property
    def specs(self) -> Mapping[str, FlagSpec]:
        """The union's specs: the lookups that need no version (is this flag a secret?)."""
        return self.union_table().specs

    def _spec_from_row(self, row: Mapping[str, Any], prefer: frozenset[str] = frozenset()) -> FlagSpec | None:
        """A FlagSpec for one row of a flag table (an engine's table_builder.py), or None for a row
        that is not a server flag."""
        options = [o[2:] for o in row.get("options") or [] if o.startswith("--")]
        if not options:
            return None
        dest = row.get("dest") or options[0].replace("-", "_")
        spelled = dest.replace("_", "-")
        kind_in_table = row.get("kind")
        negations: list[str] = []
        if kind_in_table == "boolean_optional":
            negatives = [o[2:] for o in row.get("negatives") or []]
            negations = [o for o in options if o in negatives] if negatives else [o for o in options if o.startswith("no-")]
            positives = [o for o in options if o not in negations]
            options = positives or options
        # The canonical name: the name newer releases give the same flag (``prefer``: 0.5.10 declares
        # "--tensor-parallel-size", "--tp-size" with the dest tensor_parallel_size and copies it into
        # ServerArgs.tp_size, which /get_server_info reports; 0.5.23 declares "--tp-size" first), so that
        # one flag has one name across versions; else the option spelled like the argparse dest; else
        # the first option.
        preferred = [o for o in options if o in prefer or o in self.field_names]
        if preferred and spelled not in prefer:
            name = preferred[0]
            dest = name.replace("-", "_")
        else:
            name = spelled if spelled in options else options[0]
        aliases = tuple(o for o in options if o != name)
        type_name = row.get("type")
        nargs = row.get("nargs")
        choices = tuple(row.get("choices") or ())
        item = _ITEM_OF_TYPE.get(type_name, "str")
        custom = type_name if type_name not in (None, "int", "float", "str", "json") else None
        if kind_in_table == "boolean_optional":
            kind = "switch"
        elif kind_in_table in ("store_true", "store_false", "store_const", "count", "append_const") or nargs == 0:
            kind = "bool"
        elif nargs in ("+", "*") or (isinstance(nargs, int) and nargs > 1) or kind_in_table in ("append", "extend"):
            kind = "list"
        elif choices:
            kind = "choice"
            if all(isinstance(c, bool) or not isinstance(c, (int, float)) for c in choices):
                item = "str" if item not in ("int", "float") else item
            elif all(isinstance(c, int) and not isinstance(c, bool) for c in choices):
                item = "int"
        elif type_name == "json" or (custom and custom.endswith(("json_list_type", "parse_cuda_graph_config_arg"))):
            kind = "json"
        elif custom and custom.endswith("human_readable_int"):
            kind = "int"
        elif type_name in ("int", "float"):
            kind = type_name
        else:
            kind = "str"
        negative = negations[0] if kind == "switch" and negations else ""
        text_json = kind == "str" and (name in self.json_text_flags or bool(
            self.json_text_help and self.json_text_help in str(row.get("help") or "")))
        if text_json:
            kind = "json"
        default = row.get("default")
        if isinstance(default, dict) and set(default) == {"repr"}:
            default = default["repr"]
        return FlagSpec(name=name, kind=kind, default=default, help=str(row.get("help") or ""), aliases=aliases,
                        dest=dest, choices=choices, item=item, secret=redact.is_secret_name(name) or any(
                            redact.is_secret_name(a) for a in aliases), nargs=nargs, type_name=custom,
                        deprecated=row.get("deprecated") or None, text_json=text_json,
                        negative=negative)

    @functools.lru_cache(maxsize=None)  # noqa: B019 -- one instance per engine, for the process
    def _newest_names(self) -> frozenset[str]:
        """The canonical names of the newest snapshot (how older tables name the same flags)."""
        versions = self.snapshot_versions()
        if not versions:
            return frozenset()
        doc = json.loads((self.snapshot_dir / f"{self.package}-{versions[-1]}.json").read_text())
        return frozenset(self.table_from_doc(doc, prefer=frozenset()).specs)

    def table_from_doc(self, doc: Mapping[str, Any], source: str = "snapshot",
                       prefer: frozenset[str] | None = None) -> FlagTable:
        """A FlagTable from a table document (a snapshot file, or the fact's ``table``). ``prefer``:
        canonical names to keep across versions (default: the newest snapshot's)."""
        prefer = self._newest_names() if prefer is None else prefer
        specs: dict[str, FlagSpec] = {}
        for row in doc.get("actions") or []:
            spec = self._spec_from_row(row, prefer)
            if spec is None or spec.name in self.separate_fields or spec.dest in self.field_dests:
                continue
            specs.setdefault(spec.name, spec)
        version = doc.get(self.version_key)
        sha = doc.get("server_args_sha256")
        key = f"{version}-{sha[:16]}" if version and sha else None
        return FlagTable(version=version, label=f"{self.label} {version}", source=source, specs=specs, key=key,
                         server_args_sha256=sha, option_count=int(doc.get("option_count") or 0),
                         short_names=self.short_names, engine_label=self.label)

    def snapshot_versions(self, directory: Path | None = None) -> list[str]:
        """The releases gpugate ships a snapshot of, oldest first."""
        folder = Path(directory) if directory else self.snapshot_dir
        found = [p.name[len(self.package) + 1:-len(".json")] for p in folder.glob(f"{self.package}-*.json")]
        return sorted(found, key=_version_key)

    @functools.lru_cache(maxsize=32)  # noqa: B019
    def load_snapshot(self, version: str) -> FlagTable:
        """The shipped snapshot of release ``version``; KeyError naming the ones there are."""
        path = self.snapshot_dir / f"{self.package}-{version}.json"
        if not path.is_file():
            raise KeyError(f"gpugate has no snapshot of {self.label} {version} (it has {', '.join(self.snapshot_versions())})")
        return self.table_from_doc(json.loads(path.read_text()), source="snapshot")

    def newest_snapshot(self) -> FlagTable:
        return self.load_snapshot(self.snapshot_versions()[-1])

    @functools.lru_cache(maxsize=None)  # noqa: B019 -- one instance per engine, for the process
    def union_table(self) -> FlagTable:
        """Every flag of every snapshot (the newest release's definition; choices of all of them):
        what ``table=None`` checks against when the release that will run is not known yet."""
        versions = self.snapshot_versions()
        specs: dict[str, FlagSpec] = {}
        for version in reversed(versions):  # newest first: its definition wins
            for name, spec in self.load_snapshot(version).specs.items():
                have = specs.get(name)
                if have is None:
                    specs[name] = spec
                elif spec.choices and have.kind == "choice":
                    extra = tuple(c for c in spec.choices if c not in have.choices)
                    aliases = have.aliases + tuple(a for a in spec.aliases if a not in have.aliases)
                    specs[name] = dataclasses.replace(have, choices=have.choices + extra, aliases=aliases)
        label = f"any {self.label} release gpugate has a snapshot of (" + ", ".join(versions) + ")"
        return FlagTable(version=None, label=label, source="union", specs=specs, short_names=self.short_names,
                         engine_label=self.label)

    def resolve_table(self, table: FlagTable | str | None) -> FlagTable:
        """``table`` itself, the snapshot of a version string, or the union for None."""
        if table is None:
            return self.union_table()
        if isinstance(table, str):
            return self.load_snapshot(table)
        return table

    def _cache_dir(self) -> Path:
        base = os.environ.get("GPUGATE_CACHE_DIR") or os.path.join(
            os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "gpugate")
        return Path(base) / f"{self.package}-flags"

    def remember_table(self, doc: Mapping[str, Any]) -> None:
        """Keep a container's table on the controller (``~/.cache/gpugate/<engine>-flags/<key>.json``), so
        that the next plan tells the container not to send it (``known_table_keys``). Best effort."""
        version, sha = doc.get(self.version_key), doc.get("server_args_sha256")
        if not version or not sha:
            return
        try:
            folder = self._cache_dir()
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{version}-{sha[:16]}.json"
            if not path.exists():
                tmp = path.with_suffix(f".tmp.{os.getpid()}")
                tmp.write_text(json.dumps(doc, sort_keys=True))
                os.replace(tmp, path)
        except OSError:
            pass

    def cached_table_doc(self, key: str) -> dict[str, Any] | None:
        """A table this controller received before (``remember_table``), by key, or None."""
        path = self._cache_dir() / f"{key}.json"
        try:
            return json.loads(path.read_text()) if "/" not in key and path.is_file() else None
        except (OSError, ValueError):
            return None

    def known_table_keys(self) -> list[str]:
        """The keys of the tables the controller has (shipped snapshots, its cache): a container whose
        table has one of them need not send it (``SglangFlagTable(known=...)``)."""
        keys = [k for k in (self.load_snapshot(v).key for v in self.snapshot_versions()) if k]
        try:
            keys += sorted(p.name[:-len(".json")] for p in self._cache_dir().glob("*.json"))
        except OSError:
            pass
        return sorted(set(keys))

    def _container_table(self, container: Mapping[str, Any]) -> FlagTable:
        key = container.get("key") or container["table"].get("key")
        table = self._container_tables.get(key) if isinstance(key, str) else None
        if table is None:
            table = self.table_from_doc(container["table"], source="container")
            if isinstance(key, str) and len(self._container_tables) < 64:
                self._container_tables[key] = table
        return table

    def choose_table(self, container: Mapping[str, Any] | None = None, pinned: str | None = None) -> tuple[FlagTable, str]:
        """The table to validate a plan against, and a line saying which one it is.

        1. the container's own (``container``: the SglangFlagTable fact's document), when it answered;
        2. else the snapshot of the pinned release;
        3. else the newest snapshot.
        """
        why = "the container's own table is not known"
        if container:
            version = container.get("version")
            if container.get("table"):
                table = self._container_table(container)
                how = (" (cached there)" if container.get("cached")
                       else f" (built there in {container['build_s']:.2f} s)" if container.get("build_s") is not None
                       else "")  # neither: no "(from the container)" after "from the container"
                return table, f"{self.label} {table.version}'s own flag table, from the container{how}"
            key = container.get("key")
            for snap in self.snapshot_versions():
                if key and self.load_snapshot(snap).key == key:
                    return self.load_snapshot(snap), (f"{self.label} {snap}'s flag table (the container's parser source "
                                                 f"is the snapshot's)")
            if container.get("error"):
                why = f"the container's table: {container['error']}"
            elif version:
                why = f"the container has {self.label} {version} but sent no table"
        versions = self.snapshot_versions()
        if pinned and pinned in versions:
            return self.load_snapshot(pinned), f"the snapshot of {self.label} {pinned} (pinned; {why})"
        newest = versions[-1]
        pin = f"no snapshot of the pinned {pinned}; " if pinned else ""
        return self.load_snapshot(newest), f"the newest snapshot, {self.label} {newest} ({pin}{why})"

    def _suggestions(self, bare: str, table: FlagTable) -> list[str]:
        """Names to offer for an unknown ``bare``: flags that begin with it (what a removed flag was
        split into), then the closest spellings."""
        canonical = list(table.specs)
        starts = [n for n in canonical if n.startswith(bare + "-")]
        close = difflib.get_close_matches(bare, list(table.names), n=3, cutoff=0.6)
        if starts:  # what a removed flag was split into is the answer; spelling neighbours are noise
            return starts[:3]
        return [table.names[close[0]]] if close else []  # the nearest spelling only

    def canonical_name(self, name: str, table: FlagTable | str | None = None) -> str:
        """The canonical flag name for ``name`` (with or without dashes, snake or kebab case, alias).

        Raises FlagError for a name the table does not have, naming the version and the nearest names.
        """
        t = self.resolve_table(table)
        if not isinstance(name, str):
            raise FlagError(str(name), f"flag names are strings, got {type(name).__name__}")
        bare = _strip_name(name)
        if bare in t.names:
            return t.names[bare]
        if bare in self.separate_fields:
            return bare
        hints = self._suggestions(bare, t)
        hint = f" (did you mean {' or '.join('--' + h for h in hints)}?)" if hints else ""
        raise FlagError(bare or name, f"not a flag of {t.label}{hint}")

    def validate_flags(self, flags: Mapping[str, object] | None, table: FlagTable | str | None = None) -> dict[str, Any]:
        """Validate flags as written in fleet.yaml against ``table`` and return them normalised.

        ``table``: a FlagTable (the container's, ``choose_table``), a version with a snapshot
        (``"0.5.23"``), or None for the union of the snapshots. Keys: any spelling ``canonical_name``
        accepts. Values: YAML scalars/lists (or strings that parse as the declared type). ``True`` sets
        a switch, ``False`` leaves it out. Raises FlagError naming the flag for unknown flags (with the
        version and the nearest names), fields given as flags (model-path, port, host, config), wrong
        types, bad choices, values that cannot be one argv item, the same flag given twice under two
        spellings, and the engine's known conflicts. Deprecated flags pass: ``flag_warnings`` says so.
        """
        t = self.resolve_table(table)
        if flags is None:
            return {}
        if not isinstance(flags, Mapping):
            raise FlagError("", f"flags must be a mapping of flag name to value, got {_type_label(flags)}")
        normalised: dict[str, Any] = {}
        spelled: dict[str, str] = {}
        for raw_name, value in flags.items():
            name = self.canonical_name(raw_name, t)
            if name in self.separate_fields:
                raise FlagError(name, self.separate_fields[name])
            if name in spelled:
                raise FlagError(name, f"given twice (as {spelled[name]!r} and {raw_name!r})")
            spelled[name] = str(raw_name)
            spec = t.specs[name]
            if spec.kind == "switch" and _strip_name(str(raw_name)) == (spec.negative or "no-" + name) \
                    and isinstance(value, bool):
                value = not value  # `no-x: true` is --no-x (`disable-x: true`: --disable-x)
            try:
                typed = _normalise_value(spec, value, t.label, t.engine_label)
            except FlagError as error:
                if self._is_secret(name, t) or name in self.json_text_flags:  # a key, or a JSON document that may hold one
                    raise FlagError(name, redact.mask_values(error.message, redact.leaf_strings(value))) from None
                raise
            if typed is not None:
                normalised[name] = typed
        self.check_conflicts(normalised)
        return dict(sorted(normalised.items()))

    def flag_warnings(self, flags: Mapping[str, Any], table: FlagTable | str | None = None) -> list[str]:
        """Warnings for normalised ``flags`` on ``table``: deprecated flags, with the engine's own words.
        """
        t = self.resolve_table(table)
        out = []
        for name in sorted(flags):
            spec = t.specs.get(name)
            if spec is None or not spec.deprecated or flags[name] is None or flags[name] is False:
                continue
            words = spec.deprecated.get("message") or spec.deprecated.get("error_message") or spec.help or ""
            out.append(f"--{name} is deprecated in {t.label}: {words}".rstrip(": "))
        return out

    def render_flag_args(self, flags: Mapping[str, Any], table: FlagTable | str | None = None) -> list[str]:
        """argv items for normalised flags, sorted by canonical name (stable, diff-friendly).

        ``False`` renders ``--no-<name>`` for an ``--x/--no-x`` switch and nothing otherwise. Names the
        table does not know (kept by parse_argv) are rendered as given.
        """
        t = self.resolve_table(table) if table is not None else None
        argv: list[str] = []
        for name in sorted(flags):
            value = flags[name]
            spec = (t.specs if t is not None else self.specs).get(name)
            if value is True:
                argv.append(f"--{name}")
            elif value is False:
                if spec is not None and spec.kind == "switch":
                    argv.append(f"--{spec.negative or 'no-' + name}")
            elif value is None:
                continue
            elif isinstance(value, (list, tuple)):
                argv.append(f"--{name}")
                argv.extend(_value_text(v) for v in value)
            else:
                argv.extend(_option(name, _value_text(value)))
        return argv

    def _resolve_option(self, bare: str, t: FlagTable) -> str | None:
        """argparse's rules for a token of a running command line: exact match, else a unique
        prefix of a declared option string (the server accepted it, so it meant that flag)."""
        if bare in t.names:
            return t.names[bare]
        if bare in self.separate_fields:
            return bare
        declared = dict(t.declared)
        declared.update({f: f for f in self.separate_fields})
        matches = {canonical for option, canonical in declared.items() if option.startswith(bare)}
        if len(matches) == 1 and bare:
            return matches.pop()
        return None

    def parse_argv(self, argv: Sequence[str], table: FlagTable | str | None = None) -> ParsedCommand:
        """Parse a server's command line (e.g. /proc/PID/cmdline split at NUL). Never raises.

        Accepts the full command (``python3 -m sglang.launch_server ...``, ``sglang serve ...``)
        or only the arguments, aliases and argparse abbreviations (``--tp 8``), and ``--flag=value``.
        """
        t = self.resolve_table(table)
        tokens = list(argv)[self.server_args_start(argv):]
        result = ParsedCommand(model_path=None, host=self.default_host, port=self.default_port)
        raw: dict[str, Any] = {}
        index = 0
        while index < len(tokens):
            token = tokens[index]
            index += 1
            if token == "--":
                result.positionals.extend(tokens[index:])
                break
            if not _is_option_token(token):
                result.positionals.append(token)
                continue
            bare, has_inline, inline = token.lstrip("-").partition("=")
            name = self._resolve_option(bare, t)
            spec = t.specs.get(name) if name else None
            if name in self.separate_fields or spec is not None and spec.kind not in ("bool", "switch", "list"):
                if has_inline:
                    value: Any = inline
                elif index < len(tokens):
                    value = tokens[index]
                    index += 1
                else:
                    result.problems.append(f"--{name}: no value at the end of the command line")
                    continue
            elif spec is not None and spec.kind == "bool":
                value = True
            elif spec is not None and spec.kind == "switch":
                value = bare != (spec.negative or "no-" + spec.name) and not (
                    bare.startswith("no-") and not spec.negative and bare not in (spec.name, *spec.aliases))
            else:  # a list flag, or an unknown flag: take every following non-option token
                values = [inline] if has_inline else []
                while index < len(tokens) and not _is_option_token(tokens[index]):
                    values.append(tokens[index])
                    index += 1
                if spec is None:
                    name = bare
                    if name not in result.unknown:
                        result.unknown.append(name)
                    value = True if not values else values[0] if len(values) == 1 else values
                else:
                    value = values
            raw[name or bare] = value  # the last occurrence wins, as with argparse

        for field in self.model_options:
            if field in raw:
                result.model_path = raw.pop(field)
        if "host" in raw:
            result.host = raw.pop("host")
        if "port" in raw:
            port = raw.pop("port")
            try:
                result.port = int(port)
            except ValueError:
                result.problems.append(f"--port: {port!r} is not an integer")
        flags: dict[str, Any] = {}
        for name, value in raw.items():
            spec = t.specs.get(name)
            if spec is None:
                flags[name] = value
                continue
            try:
                typed = _normalise_value(spec, value, t.label, t.engine_label)
            except FlagError as error:
                result.problems.append(str(error))
                typed = value
            if typed is not None:
                flags[name] = typed
        result.flags = dict(sorted(flags.items()))
        return result

    def _is_secret(self, name: str, t: FlagTable | None = None) -> bool:
        spec = (t.specs if t is not None else self.specs).get(name)
        return bool(spec and spec.secret) or redact.is_secret_name(name)

    def is_secret_value(self, name: str, value: Any, table: FlagTable | str | None = None) -> bool:
        """Whether the value of flag ``name`` must never be shown: a secret flag (--api-key...), or a
        JSON-valued flag whose document has a key naming a secret (:func:`json_holds_secret`).
        """
        t = table if isinstance(table, FlagTable) else self.resolve_table(table)
        spec = t.specs.get(name)
        return redact.is_secret_value(name, value, declared_secret=bool(spec and spec.secret),
                                      json_valued=bool((spec is not None and spec.kind == "json") or name in self.json_text_flags))

    def secret_flag_options(self, flags: Mapping[str, Any], table: FlagTable | str | None = None) -> list[str]:
        """The option strings (``--model-loader-extra-config``) of the normalised ``flags`` whose
        values are secret beyond the agent's own list (--api-key, --admin-api-key): the SpecDoc's and
        observe's ``secret_flags``, so the agent masks those values in argv, logs and tails.
        """
        t = self.resolve_table(table)
        out = []
        for name, value in flags.items():
            if name in redact.ALWAYS_MASKED_FLAGS or value in (None, False, True):
                continue
            if self.is_secret_value(name, value, t):
                spec = t.specs.get(name)
                out += spec.option_strings if spec is not None else [f"--{name}"]
        return sorted(set(out))

    def redact_flags(self, flags: Mapping[str, Any]) -> dict[str, Any]:
        """Flags with the values of secret flags (``--api-key``...) replaced by ``***``, and the whole
        value of a JSON-valued flag whose document has a key naming a secret (``{"hf_token": ...}``)."""
        return {name: SECRET_MASK if value not in (None, False) and self.is_secret_value(name, value) else value
                for name, value in flags.items()}

    def _flag_display(self, name: str, value: Any, redact: bool, t: FlagTable | None = None) -> str:
        if value is True:
            return f"--{name}"
        if value is False:
            spec = (t.specs if t is not None else self.specs).get(name)
            return f"--{spec.negative if spec is not None and spec.negative else 'no-' + name}"
        if value == SECRET_MASK or (redact and self.is_secret_value(name, value, t)):  # masked already: never quoted
            return f"--{name} {SECRET_MASK}"
        if isinstance(value, (list, tuple)):
            return f"--{name} " + " ".join(shlex.quote(_value_text(v)) for v in value)
        return f"--{name} {shlex.quote(_value_text(value))}"

    def _canonical_keys(self, flags: Mapping[str, Any], t: FlagTable) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, value in flags.items():
            try:
                key = self.canonical_name(name, t)
            except FlagError:
                key = _strip_name(name)
            spec = t.specs.get(key)
            if value is None or (value is False and (spec is None or spec.kind != "switch")):
                continue
            if spec is not None:
                # Compare typed values (8 == "8", a YAML mapping == its JSON text); a value that
                # does not validate is compared as it is, so it still shows in the diff.
                try:
                    value = _normalise_value(spec, value, t.label, t.engine_label)
                except FlagError:
                    pass
                if value is None:
                    continue
            out[key] = list(value) if isinstance(value, tuple) else value
        return out

    def diff_flags(self, running: Mapping[str, Any], desired: Mapping[str, Any],
                   table: FlagTable | str | None = None) -> FlagDiff:
        """What changes from the running flags to the desired flags.

        Explicit comparison, by decision: a flag written on one side and absent on the other is a
        difference even when the value is the engine's default (``--kv-cache-dtype auto`` vs nothing),
        because an engine's defaults change between releases. Switches set to false and absent switches
        are the same (identical argv). Numbers compare by value (``8`` == ``8.0``).
        """
        t = self.resolve_table(table)
        before = self._canonical_keys(running, t)
        after = self._canonical_keys(desired, t)
        diff = FlagDiff(display=lambda name, value, redact: self._flag_display(name, value, redact, t))
        for name in sorted(set(before) | set(after)):
            if name not in after:
                diff.removed[name] = before[name]
            elif name not in before:
                diff.added[name] = after[name]
            elif before[name] != after[name]:
                diff.changed[name] = (before[name], after[name])
        return diff

    def redact_argv(self, argv: Sequence[str], table: FlagTable | str | None = None) -> list[str]:
        """argv with the values of secret flags replaced by ``***`` (for logs and messages).

        Secret names are gpugate's overlay (``SECRET_FLAGS`` and names ending in api-key, password,
        secret), so a secret is hidden even in ``extra_args`` and under a version gpugate has no table of.
        """
        t = self.resolve_table(table)
        out: list[str] = []
        hide_next = False
        for index, token in enumerate(argv):
            if hide_next:
                out.append(SECRET_MASK)
                hide_next = False
                continue
            if token.startswith("--"):
                bare, has_inline, inline = token[2:].partition("=")
                name = self._resolve_option(bare, t) or bare
                value = inline if has_inline else (argv[index + 1] if index + 1 < len(argv) else None)
                if self._is_secret(name, t) or (value is not None and self.is_secret_value(name, value, t)):
                    if has_inline:
                        out.append(f"--{bare}={SECRET_MASK}")
                    else:
                        out.append(token)
                        hide_next = True
                    continue
            out.append(token)
        return out

    def build_parser(self, prog: str = "launch_server.py", table: FlagTable | str | None = None) -> argparse.ArgumentParser:
        """An argparse parser with a table's option strings, types, choices and switches (for tools
        and tests; the lab's stand-in builds its own from a snapshot, never from this module)."""
        t = self.resolve_table(table)
        parser = argparse.ArgumentParser(prog=prog)
        parser.add_argument(*("--" + o for o in self.model_options), dest="model_path", type=str, required=True)
        parser.add_argument("--host", type=str, default=self.default_host)
        parser.add_argument("--port", type=int, default=self.default_port)
        parser.add_argument("--config", type=str, default=None)
        for spec in t.specs.values():
            options = spec.option_strings
            if spec.kind == "bool":
                parser.add_argument(*options, dest=spec.dest, action="store_true", default=bool(spec.default))
            elif spec.kind == "switch":
                parser.add_argument(*options, dest=spec.dest, action=argparse.BooleanOptionalAction)
            elif spec.kind == "list":
                parser.add_argument(*options, dest=spec.dest, type=_ITEM_TYPES[spec.item], nargs=spec.nargs or "+")
            elif spec.kind == "choice":
                parser.add_argument(*options, dest=spec.dest, type=_ITEM_TYPES[spec.item], choices=list(spec.choices),
                                    default=spec.default)
            else:
                kind = {"int": int, "float": float}.get(spec.kind, str) if not spec.type_name else str
                parser.add_argument(*options, dest=spec.dest, type=kind, default=spec.default)
        return parser

    def server_info_view(self, flags: Mapping[str, Any], table: FlagTable | str | None = None) -> dict[str, Any]:
        """The /get_server_info (``/server_info``) keys and values that these flags should produce.
        """
        t = self.resolve_table(table)
        view: dict[str, Any] = {}
        for name, value in self._canonical_keys(flags, t).items():
            spec = t.specs.get(name)
            if spec is None or spec.deprecated or spec.type_name:
                continue  # the engine converts these (a deprecated switch sets another field): not comparable
            if spec.kind == "json" and isinstance(value, str) and not spec.text_json:
                value = json.loads(value)  # argparse's type=json.loads: ServerArgs holds the document
            view[spec.dest] = value  # a JSON-text flag: the exact (canonical) text of the argv, as the engine keeps it
        return dict(sorted(view.items()))

    def server_info_mismatches(self, flags: Mapping[str, Any], server_info: Mapping[str, Any],
                               table: FlagTable | str | None = None) -> dict[str, tuple[Any, Any]]:
        """``{canonical name: (desired, reported)}`` for the flags the server reports differently.

        Only keys present in ``server_info`` are compared (the engine resolves and adds many others);
        secret flags are never compared by value (newer releases hide them).
        """
        t = self.resolve_table(table)
        mismatches: dict[str, tuple[Any, Any]] = {}
        for name, value in self._canonical_keys(flags, t).items():
            spec = t.specs.get(name)
            if spec is None or spec.secret or spec.dest not in server_info or self.is_secret_value(name, value, t):
                continue
            view = self.server_info_view({name: value}, t)
            if spec.dest not in view:
                continue
            desired = view[spec.dest]
            reported = server_info[spec.dest]
            if spec.kind == "json":
                # by the parsed document on both sides: the text the engine keeps may be spaced otherwise
                desired, reported = _json_document(desired), _json_document(reported)
            if desired != reported and not (isinstance(desired, list) and list(reported or []) == desired):
                mismatches[name] = (desired, reported)
        return mismatches

    def check_report(self, flags: Mapping[str, Any], pinned: str | None = None,
                     extra_args: Sequence[str] | None = None) -> tuple[bool, list[str]]:
        """Offline check of one server's flags (``gpugate check``): against the pinned version's
        snapshot, else the newest. -> (ok, lines): the verdict naming the table, then warnings.
        """
        versions = self.snapshot_versions()
        if pinned and pinned in versions:
            table, how = self.load_snapshot(pinned), "snapshot, pinned"
        else:
            table = self.newest_snapshot()
            how = f"the newest snapshot; gpugate has none of the pinned {pinned}" if pinned else "the newest snapshot"
        try:
            normal = self.validate_flags(flags, table)
        except FlagError as error:
            return False, [f"REFUSED by {table.label} ({how}): {error}"]
        lines = [f"ok for {table.label} ({how}), {len(normal)} flag(s)"] + self.flag_warnings(normal, table)
        if extra_args:
            lines.append("extra_args passed verbatim, unchecked: " + " ".join(self.redact_argv(list(extra_args), table)))
        return True, lines

    def supports(self, option: str, table: FlagTable | str | None = None) -> bool:
        """Whether this release has the flag (``gated-launch-port``: 0.5.23 and later).
        """
        try:
            self.canonical_name(option, table)
        except FlagError:
            return False
        return True

    # ------------------------------------------------------------------------------------------
    # The container's own table (table_builder.py sent inline; issue 13)
    # ------------------------------------------------------------------------------------------
    def table_command(self, python: str, known: Sequence[str] = (), build: bool = True, cache_dir: str | None = None) -> str:
        """One command: table_builder.py sent inline, ``collect(...)`` printed as JSON."""
        import json  # noqa: PLC0415

        from gpugate.engine import argparse_table  # noqa: PLC0415
        from gpugate.remote import inline_program, python_command  # noqa: PLC0415

        args = {"cache_dir": cache_dir or self.cache_dir, "known": sorted(known), "build_if_missing": bool(build)}
        body = (f"ARGS = json.loads({json.dumps(json.dumps(args))})\n"
                "try:\n"
                "    out = sys.modules['gpugate_flag_table'].collect(**ARGS)\n"
                "except BaseException as exc:\n"
                "    out = _failure(exc)\n"
                "_emit(out)\n")
        script = inline_program({"gpugate_argparse_table": Path(argparse_table.__file__).read_text(),
                                 "gpugate_flag_table": Path(self.builder_file).read_text()}, body)
        return python_command(script, {"schema": 1, "version": None, "error": "python not found in the container"},
                              python)

    def fetch_table(self, run: Callable[[str], Mapping[str, Any]], python: str, observation: Mapping[str, Any] | None = None,
                    say: Callable[[str], Any] | None = None) -> dict[str, Any]:
        """The container's flag table document, in the fewest commands: a read first; when no table is
        cached for the installed version, ``say`` is told "building <engine>'s flag table in the
        container (first time for <version>)" and the build runs. A table received is kept in the
        controller's cache (remember_table), so that later runs tell the container not to send it
        again. ``run``: runs a command in the container and returns its JSON answer. ``observation``:
        the agent's observe document; when its ``<engine>.flag_table`` names a table this controller
        has, no command is sent at all (the converged re-run stays at one command per container)."""
        known = self.known_table_keys()
        seen = ((observation or {}).get(self.package) or {}).get("flag_table") or {}
        if isinstance(seen, dict) and seen.get("key") and seen["key"] in known:
            # observe named it (the same key the table builder gives): what read(False) would answer
            doc = {"schema": 1, "version": seen.get("version"), "server_args_sha256": seen.get("server_args_sha256"),
                   "key": seen["key"], "cached": bool(seen.get("cached")), "built": False, "build_s": None}
            cached = self.cached_table_doc(seen["key"])
            return dict(doc, table=cached) if cached is not None else doc

        def read(build: bool) -> dict[str, Any]:
            return dict(run(self.table_command(python, known, build)))

        doc = read(False)
        if doc.get("key") in known and not doc.get("table"):  # the controller has it: no build, no transfer
            doc = {key: value for key, value in doc.items() if key != "error"}
            cached = self.cached_table_doc(doc["key"])
            return dict(doc, table=cached) if cached is not None else doc
        if not doc.get("cached") and doc.get("key") and "no cached table" in str(doc.get("error") or ""):
            if say is not None:
                say(f"building {self.label}'s flag table in the container (first time for {doc.get('version')})")
            doc = read(True)
        if doc.get("table"):
            self.remember_table(doc["table"])
        elif doc.get("key") and not doc.get("error"):
            cached = self.cached_table_doc(doc["key"])
            if cached is not None:
                doc = dict(doc, table=cached)
        return doc



class LazySpecs(Mapping[str, FlagSpec]):
    """The union's specs of an engine, read when first used (loading the snapshots at import
    would cost every command that never checks a flag)."""

    def __init__(self, flags: ArgparseFlags):
        self._flags = flags

    def __getitem__(self, key: str) -> FlagSpec:
        return self._flags.specs[key]

    def __iter__(self):
        return iter(self._flags.specs)

    def __len__(self) -> int:
        return len(self._flags.specs)


class ArgparseEngine(Engine):
    """An engine whose flags are its argparse parser's (:class:`ArgparseFlags`, ``flags``): what the
    seam asks of its flags, answered once for every such engine. An engine adds its launch, how a
    running command reads back and its capacity figures."""

    flags: ArgparseFlags

    @property
    def default_port(self) -> int:  # type: ignore[override]  # the parser's own --port default
        return self.flags.default_port

    def choose_table(self, container: Mapping[str, Any] | None, pinned: str | None) -> tuple[Any, str]:
        return self.flags.choose_table(container, pinned)

    def fetch_table(self, run: Callable[[str], Mapping[str, Any]], python: str,
                    observation: Mapping[str, Any] | None, say: Callable[[str], Any] | None = None
                    ) -> Mapping[str, Any] | None:
        return self.flags.fetch_table(run, python, observation, say)

    def table_command(self, python: str, known: Sequence[str] = (), build: bool = True) -> str | None:
        return self.flags.table_command(python, known, build)

    def flag_warnings(self, flags: Mapping[str, Any], table: Any = None) -> list[str]:
        return self.flags.flag_warnings(flags, table)

    def validate_flags(self, flags: Mapping[str, object] | None, table: Any = None) -> dict[str, Any]:
        return self.flags.validate_flags(flags, table)

    def canonical_name(self, name: str, table: Any = None) -> str:
        return self.flags.canonical_name(name, table)

    def flag_lines(self, running: Mapping[str, Any], desired: Mapping[str, Any], table: Any = None) -> list[str]:
        return self.flags.diff_flags(self.redact_flags(running), self.redact_flags(desired), table).lines(redact=True)

    def redact_argv(self, argv: Sequence[str], table: Any = None) -> list[str]:
        return self.flags.redact_argv(argv, table)

    def redact_flags(self, flags: Mapping[str, Any], table: Any = None) -> dict[str, Any]:
        return self.flags.redact_flags(flags)

    def check_report(self, flags: Mapping[str, Any], pinned: str | None, extra_args: Sequence[str] | None
                     ) -> tuple[bool, list[str]]:
        return self.flags.check_report(flags, pinned, extra_args)
