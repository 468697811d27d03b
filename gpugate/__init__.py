"""gpugate: gated, declarative restarts of SGLang servers in Proxmox LXC containers, on pyinfra."""

__version__ = "0.1.0"
