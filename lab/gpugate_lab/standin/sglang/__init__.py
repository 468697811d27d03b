"""The gpugate lab's SGLang stand-in (stdlib only): ``python3 -m sglang.launch_server ...``.

It takes SGLang's own flags, spawns ``sglang::scheduler_TP<i>`` workers that hold simulated GPU memory,
loads with the port closed, serves /health, /health_generate, /get_server_info, /server_info,
/get_model_info, /v1/models and /generate, and drains on SIGTERM. See launch_server.py. SGLang 0.5.23's
weight cache (``python3 -m sglang.srt.weight_cache.daemon``, ``--weight-cache-mode client|daemon``) and
gated launch (``--gated-launch-port``) as SGLang's source does them: srt/weight_cache/daemon.py,
srt/weight_cache/ipc_loader.py, srt/distributed/gated_launch.py.
"""

try:  # written by the lab with the snapshot it installs (gpugate lab up --sglang-version)
    from sglang._version import __version__
except ImportError:
    __version__ = "0.0.0+standin"
STANDIN = True
