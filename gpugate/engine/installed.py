"""An engine installed in the container, read from its files without importing it: its version
(dist-info METADATA, else the source tree's version.py) and the key of its flag table (the name
its table_builder.py's ``collect`` gives it: gpugate/engine/argparse_table.py). Stdlib only:
bundled into the agent with the engines' container modules, which bind it to their package.
"""

from __future__ import annotations

import os
import re
import sys

from gpugate.rules.procfs import read_file
from gpugate.rules.redact import sha256



def _dist_info_version(directory, name, package):
    """The version a ``<package>-*.dist-info`` (or ``.egg-info``) entry of ``directory`` declares, else None."""
    lower = name.lower()
    if not (lower.startswith(package + "-") and (lower.endswith(".dist-info") or lower.endswith(".egg-info"))):
        return None
    meta = read_file(os.path.join(directory, name, "METADATA")) or read_file(os.path.join(directory, name, "PKG-INFO"))
    for line in (meta or "").splitlines():
        if line.startswith("Version:"):
            return line.split(":", 1)[1].strip()
    return None


def _path_listings():
    """(directory, its entries) for each readable directory of sys.path, once each, in order."""
    seen = set()
    for entry in sys.path:
        directory = entry or "."
        if directory in seen or not os.path.isdir(directory):
            continue
        seen.add(directory)
        try:
            yield directory, os.listdir(directory)
        except OSError:
            continue


def package_version(package):
    """The installed ``package``'s version from its dist-info/egg-info METADATA (never imports it)."""
    for directory, names in _path_listings():
        for name in names:
            version = _dist_info_version(directory, name, package)
            if version is not None:
                return version
        if package in names:  # a source tree or the lab's stand-in: version.py, without importing
            for candidate in ("version.py", "__init__.py"):
                text = read_file(os.path.join(directory, package, candidate)) or ""
                match = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.M)
                if match:
                    return match.group(1)
    return None


def torch_version():
    """The installed torch's version (dist-info METADATA; never imports torch): part of the weight
    cache's key (SGLang's CacheConfig has ``torch_version``). None where torch is not installed."""
    for directory, names in _path_listings():
        for name in names:
            version = _dist_info_version(directory, name, "torch")
            if version is not None:
                return version
    return None


def flag_table_key(package, source, table_dir):
    """The name the engine's table_builder.py's ``collect`` gives the container's flag table of
    ``package``, found the same way (sys.path order: the first ``<package>-*.dist-info`` version,
    else "unknown"; the first ``source``, e.g. ``sglang/srt/server_args.py``, hashed) without
    importing anything, so that a controller
    that already has that table needs no command of its own for it (issue 13). ->
    ``{"version", "server_args_sha256", "key", "cached"}``, or None without server_args.py.

    >>> flag_table_key("sglang", "sglang/srt/server_args.py", "/var/lib/gpugate/sglang-flags")["key"]  # doctest: +SKIP
    '0.5.23-3f2a9c0d1e7b4a55'
    """
    version, server_args = None, None
    for directory, names in _path_listings():
        for name in sorted(names) if version is None else ():
            version = _dist_info_version(directory, name, package)
            if version is not None:
                break
        if server_args is None and package in names:
            candidate = os.path.join(directory, *source.split("/"))
            if os.path.isfile(candidate):
                server_args = candidate
    if server_args is None:
        return None
    data = read_file(server_args, "rb")
    if data is None:
        return None
    digest = sha256(data).hexdigest()
    safe = "".join(c if c.isalnum() or c in ".+-_" else "_" for c in str(version or "unknown"))
    key = "%s-%s" % (safe, digest[:16])
    return {"version": version, "server_args_sha256": digest, "key": key,
            "cached": os.path.isfile(os.path.join(table_dir, key + ".json"))}
