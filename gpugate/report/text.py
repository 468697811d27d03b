"""Small text helpers the reports share: tables, per-GPU MiB folded, flag differences in short
form, GPU index ranges, times. Pure functions, no pyinfra.

Example::

    >>> compact_mib([86000] * 6 + [0, 0]), index_ranges([0, 1, 2, 5])
    ('86000 x6, 0 0', '0-2,5')
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any, Optional

from gpugate.spec import redact_flags
from gpugate.engine import get as engine
from gpugate.rules.redact import SECRET_MASK

# ---------------------------------------------------------------- tables


def format_table(columns: Sequence[tuple[str, str]], rows: Iterable[Mapping[str, Any]]) -> str:
    """A plain-text table: one header line, one line per row, columns padded to the widest cell.

    ``columns`` are ``(key, header)`` pairs; a missing or None cell prints as ``-``. The last
    column is not padded (no trailing blanks).

    >>> print(format_table([("a", "A"), ("b", "LONG")], [{"a": "xyz", "b": 1}]))
    A    LONG
    xyz  1
    """
    header = [title for _key, title in columns]
    body = [[_cell(row.get(key)) for key, _title in columns] for row in rows]
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(columns))]
    lines = []
    for line in [header, *body]:
        padded = [text.ljust(widths[i]) if i < len(line) - 1 else text for i, text in enumerate(line)]
        lines.append("  ".join(padded).rstrip())
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None or value == "" or value == []:
        return "-"
    if isinstance(value, (list, tuple)):
        return ", ".join(str(item) for item in value)
    return str(value)


def natural_key(text: str) -> list[Any]:
    """Sort key that puts pve2 before pve10."""
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", text)]


def compact_mib(values: Sequence[Optional[int]]) -> str:
    """Per-GPU MiB in GPU order, runs of one value folded: ``[0]*8`` -> ``0 x8``;
    ``[0, 0, 512]`` -> ``0 0 512``; unknown readings print as ``?``.

    >>> compact_mib([0] * 8), compact_mib([86658] * 7 + [0]), compact_mib([None, 3])
    ('0 x8', '86658 x7, 0', '? 3')
    """
    if not values:
        return "no GPU"
    texts = ["?" if value is None else str(value) for value in values]
    if len(set(texts)) == 1 and len(texts) > 2:
        return f"{texts[0]} x{len(texts)}"
    runs: list[tuple[str, int]] = []
    for text in texts:
        if runs and runs[-1][0] == text:
            runs[-1] = (text, runs[-1][1] + 1)
        else:
            runs.append((text, 1))
    if all(count < 3 for _text, count in runs):
        return " ".join(texts)
    return ", ".join(f"{text} x{count}" if count >= 3 else " ".join([text] * count) for text, count in runs)



def flag_differences(running: Mapping[str, Any], desired: Mapping[str, Any]) -> list[str]:
    """The running flags against the desired ones, one short item per flag, secrets masked:
    ``--kv-cache-dtype auto->fp8_e4m3`` (changed), ``+--disable-radix-cache`` (desired, not
    running), ``-cuda-graph-max-bs 8`` as ``---cuda-graph-max-bs 8`` (running, not desired).

    Secret values are compared as the plan compares them (gpugate.plan.diff_lines): masked on both
    sides, so the agent's ``***`` for a running --api-key is not a difference (the argv's hash
    tells a changed secret: status_row).

    >>> flag_differences({"tp-size": 8}, {"tp-size": 8, "disable-radix-cache": True})
    ['+--disable-radix-cache']
    >>> flag_differences({"tp-size": 4, "api-key": "***"}, {"tp-size": 4, "api-key": "sk-1"})
    []
    """
    diff = engine().diff_flags(redact_flags(running), redact_flags(desired))
    items = []
    for name in sorted(set(diff.added) | set(diff.removed) | set(diff.changed)):
        if name in diff.changed:
            before, after = diff.changed[name]
            items.append(f"--{name} {_value(name, before)}->{_value(name, after)}")
        elif name in diff.added:
            items.append("+" + _flag_item(name, diff.added[name]))
        else:
            items.append("-" + _flag_item(name, diff.removed[name]))
    return items


def _value(name: str, value: Any) -> str:
    if value == SECRET_MASK or (value not in (None, False, True) and engine().is_secret_value(name, value)):
        return SECRET_MASK
    if value is True:
        return "on"
    if value is False or value is None:
        return "off"
    if isinstance(value, (list, tuple)):
        return " ".join(shlex.quote(str(item)) for item in value)
    return shlex.quote(str(value))


def _flag_item(name: str, value: Any) -> str:
    return f"--{name}" if value is True else f"--{name} {_value(name, value)}"



def age_text(seconds: Any) -> str:
    if not isinstance(seconds, (int, float)):
        return ""
    seconds = int(seconds)
    if seconds < 120:
        return f"{seconds}s"
    if seconds < 7200:
        return f"{seconds // 60}m"
    if seconds < 172800:
        return f"{seconds // 3600}h"
    return f"{seconds // 86400}d"



def index_ranges(indices: Sequence[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5'."""
    parts: list[str] = []
    runs: list[list[int]] = []
    for index in indices:
        if runs and index == runs[-1][-1] + 1:
            runs[-1].append(index)
        else:
            runs.append([index])
    for run in runs:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts)


def epoch_of(value: Any) -> float | None:
    """An epoch from a number or an ISO 8601 text (the journal has both)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, str) and value:
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
        except ValueError:
            return None
    return None


def when_text(value: Any) -> str:
    """``2026-11-30 21:58Z`` from an epoch or ISO text; ``?`` when unreadable."""
    seconds = epoch_of(value)
    if seconds is None:
        return "?"
    return datetime.fromtimestamp(seconds, tz=timezone.utc).strftime("%Y-%m-%d %H:%MZ")


