"""How many times one container's flags are validated in one deploy run: at most 3 (the fleet
load, for its error locations; the desired state, shared by deploy.py, the claims of the whole
inventory and the status; the body's launch against the container's own flag table, once even when
pyinfra runs the body twice without -y)."""

from __future__ import annotations

import pytest

from gpugate import fleet, spec
from gpugate.claims import servers_of_inventory
from gpugate.engine import get
from gpugate.engine.sglang import flags as sglang_flags

FLEET = """
hosts:
  pve1:
    containers:
      129:
        sglang:
          model_path: /m
          flags: {tp: 8, kv-cache-dtype: fp8_e4m3}
"""


@pytest.fixture
def counted(monkeypatch):
    calls: list[dict] = []
    real = sglang_flags.FLAGS.validate_flags  # every validation of SGLang's flags goes through it

    def counting(flags, *args, **kwargs):
        if flags:  # the header alone (model, host, port) renders through it with no flag
            calls.append(dict(flags))
        return real(flags, *args, **kwargs)

    monkeypatch.setattr(sglang_flags.FLAGS, "validate_flags", counting)
    spec._DESIRED.clear()
    spec._FOR_VERSION.clear()
    return calls


def test_one_container_is_validated_three_times_per_run(tmp_path, counted):
    path = tmp_path / "fleet.yaml"
    path.write_text(FLEET)
    loaded = fleet.load_fleet(str(path))                                         # 1: inventory.py
    assert len(counted) == 1
    data = fleet.container_host_data(loaded.hosts[0], loaded.hosts[0].containers[0])
    desired = spec.desired_states(data)[0]                                       # 2: deploy.py
    servers_of_inventory([("@pct/pve1:129", data)])                             # the claims: no more
    spec.desired_states(data)                                                    # the status: no more
    assert len(counted) == 2
    table, _note = get("sglang").choose_table(None, "0.5.23")
    first = spec.for_version(desired.spec, table)                                # 3: the body
    assert spec.for_version(desired.spec, table) is first                       # its second run: none
    assert len(counted) == 3


def test_another_table_is_another_validation(counted):
    desired = spec.desired_states({"sglang_model_path": "/m", "sglang_flags": {"tp": 2}})[0]
    engine = get("sglang")
    old, new = engine.choose_table(None, "0.5.10")[0], engine.choose_table(None, "0.5.23")[0]
    before = len(counted)
    spec.for_version(desired.spec, old)
    spec.for_version(desired.spec, new)
    assert len(counted) - before == 2
