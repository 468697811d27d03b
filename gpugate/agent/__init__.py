"""gpugate's container-side agent, split by concern (docs/agent-protocol.md is the contract).

Shipped into a container as ONE content-addressed file (gpugate.agentcmd, gpugate.bundle): the loader
(``loader``) with the sources of these modules and of gpugate.rules and the engine's container side.

- ``main``: the commands and their dispatch; ``commands``: start (lock, detach) and install
- ``observe``: the read-only picture; ``server``: the server on a port, its endpoints, listeners
- ``transition`` with ``stop`` and ``start``: the state machine; ``supervise``: systemd, /dev/shm
- ``journal``, ``history``: what a run wrote and the good specs; ``logs``: tails, the log pump
- ``state``: directories, private writes, per-port files; ``gpu_probe``: the GPUs and their holders
"""
