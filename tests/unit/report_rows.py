"""What the report tests share (test_status.py, test_runbooks.py): a status row from host data as
deploy.py would read them, the argv sglang.server renders (what the agent then sees running), and
the report's modules under one name."""

from __future__ import annotations

import types

from gpugate.report import fleet, holders, prometheus, status, text
from gpugate.spec import build_spec, desired_state


def status_row_for(host, vmid, observation, flags, model, present=True, port=30000, max_used_mib=64,
                   desired_env=None):
    """The status row of a container whose host data say these flags, model, env and present."""
    data = {"sglang_flags": dict(flags or {}), "sglang_model_path": model, "sglang_present": present,
            "sglang_port": port, "gpu_max_used_mib": max_used_mib, "sglang_env": dict(desired_env or {})}
    return status.status_row(host, vmid, observation, desired_state(data))


def argv_for(model, flags):
    """The argv sglang.server renders for a model and flags (tp 8 when None)."""
    return list(build_spec(model, 30000, {"tp": 8} if flags is None else flags).argv)


# the report's modules as one namespace, status_row taking host data as above
rb = types.SimpleNamespace(**{name: getattr(module, name) for module in (text, fleet, holders, prometheus, status)
                              for name in dir(module) if not name.startswith("__")})
rb.status_row = status_row_for
