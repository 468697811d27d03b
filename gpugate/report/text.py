"""Small text helpers the reports share: tables, per-GPU MiB folded, THE flag difference (one
format everywhere: ``+ --flag value`` / ``- --flag value``), driver overhead, GPU index ranges,
times. Pure functions, no pyinfra.

Example::

    >>> compact_mib([86000] * 6 + [0, 0]), index_ranges([0, 1, 2, 5])
    ('86000 x6, 0 0', '0-2,5')
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime, timezone
from typing import Any, Optional

from gpugate.match import flag_differences  # noqa: F401 -- THE flag-difference format, for the reports

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



def driver_overhead_text(overhead: Mapping[Any, int], max_used_mib: Any) -> str:
    """Memory no process accounts for, at or under the gate's threshold (gpugate.rules.gate.
    outside_memory): the driver's own, never "held from outside". Empty when there is none.

    >>> driver_overhead_text({3: 12}, 64)
    "GPU 3: 12 MiB, driver overhead (under the gate's 64 MiB)"
    >>> driver_overhead_text({0: 8, 1: 8, 2: 16}, 64)
    "GPU 0-1: 8 MiB each, GPU 2: 16 MiB, driver overhead (under the gate's 64 MiB)"
    """
    if not overhead:
        return ""
    by_mib: dict[int, list[int]] = {}
    for index, mib in sorted(overhead.items(), key=lambda item: int(item[0])):
        by_mib.setdefault(int(mib), []).append(int(index))
    parts = [f"GPU {index_ranges(indexes)}: {mib} MiB" + (" each" if len(indexes) > 1 else "")
             for mib, indexes in sorted(by_mib.items(), key=lambda item: item[1][0])]
    return f"{', '.join(parts)}, driver overhead (under the gate's {max_used_mib} MiB)"


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


