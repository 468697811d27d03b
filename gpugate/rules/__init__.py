"""Rules that the controller and the container agent share: stdlib only, Python >= 3.8.

The controller imports these modules as usual; the agent's one-file artifact (gpugate.agentcmd)
and the inline probe commands (gpugate.remote) carry their sources and import them through a
meta-path finder (gpugate/agent/loader.py), so both sides run the same code, never a copy.

- ``gpus``: the GPU set a server uses (tp x pp x dp from --base-gpu-id, through CUDA_VISIBLE_DEVICES)
- ``redact``: what is secret and how it is masked; the argv and env fingerprints
- ``gate``: the one gate decision and the one foreign-memory rule
- ``procfs``: /proc readers and ending processes; PROBE_MARKER
"""
