"""The local lab: simulated Proxmox GPU hosts made of real parts (see docs/lab.md).

Submodules that run on lab hosts or in containers are stdlib only.
"""
