"""Defaults for every container in the inventory (pyinfra global data): each setting's default
from its row in the one settings table, gpugate.settings.SETTINGS (where each is documented in one
line; docs/architecture.md lists them).

Precedence (highest first): `--data key=value` > fleet.yaml (the container's `data:`, then its
`sglang:` section, then its Proxmox host's `data:`) > `group_data/<group>.py` and fleet.yaml
`groups:` data > this file. Example: `pyinfra inventory.py deploy.py --data drain_timeout_s=120`.

To change a default for the whole fleet, assign it below the update, e.g. `drain_timeout_s = 120`.
"""

from gpugate.settings import defaults as _defaults

# a setting whose default is "none given" (the model path, pct_sudo's "when ssh_user is not root") is
# left out: pyinfra type-checks connector data, and gpugate applies every default itself
_values = {key: value for key, value in {**_defaults("server"), **_defaults("data")}.items() if value is not None}
globals().update(_values)
__all__ = sorted(_values)
