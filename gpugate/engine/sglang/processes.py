"""SGLang as the container sees it: which processes are a server's (main, workers by their titles),
what a server's argv says (port, host, keys, GPUs), its /dev/shm segments, and what its
environment keeps when gpugate adopts it. Stdlib only: bundled into the agent (gpugate.agentcmd).

The controller's side of SGLang (flag tables, argv rendering) is gpugate.engine.sglang.flags; this is the
container-side part of the engine seam.
"""

from __future__ import annotations

import os

from gpugate.engine import gpus as rules_gpus
from gpugate.engine.argv import adopt_env, flag_int, flag_value, python_module

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing is never imported at run time (~10 ms of every agent command)
    from typing import Dict, Mapping, Sequence

DEFAULT_PORT = 30000
SHM_PREFIXES = ("psm_", "sgl_shm_", "multi_tokenizer_args_")
TITLE_PREFIXES = ("sglang::scheduler", "sglang::detokenizer", "sglang::data_parallel_controller",
                  "sglang::tokenizer_worker")
SCHEDULER_TITLE = "sglang::scheduler"  # one per rank: a server's workers to count
# random_seed: drawn per process unless --random-seed pins it (ServerArgs), so what answers at a
# router's worker URL is told from another replica of the same flags (gpugate.router.identity_problem)
INFO_KEYS = ("model_path", "port", "host", "tp_size", "dp_size", "pp_size", "version", "max_total_num_tokens",
             "max_running_requests", "context_length", "kv_cache_dtype", "random_seed")
CAPACITY_KEYS = ("max_total_num_tokens", "max_running_requests", "context_length", "version")
# What an adopted server's (one we did not start: no pid file of ours) environment keeps for its
# history record and a rollback to it: what SGLang and its libraries read, never the login session.
ADOPT_ENV_PREFIXES = ("SGLANG_", "SGL_", "CUDA_", "NCCL_", "NVIDIA_", "HF_", "HUGGING_FACE_", "TORCH",
                      "PYTORCH_", "TRANSFORMERS_", "TOKENIZERS_", "OMP_", "MKL_", "TRITON_", "FLASHINFER_",
                      "NVSHMEM_", "UCX_", "GLOO_", "MASTER_")
ADOPT_ENV_NAMES = ("LD_LIBRARY_PATH", "LD_PRELOAD", "PYTHONPATH", "VIRTUAL_ENV")


def is_main_argv(argv: Sequence[str] | None) -> bool:
    """SGLang's server main: ``python -m sglang.launch_server ...`` or ``sglang serve ...``.

    >>> is_main_argv(["/usr/bin/python3", "-m", "sglang.launch_server", "--port", "30000"])
    True
    >>> is_main_argv(["python3", "-m", "sglang.bench_serving", "--port", "30000"])
    False
    """
    if not argv:
        return False
    if python_module(argv) == "sglang.launch_server":
        return True
    program = os.path.basename(argv[0])
    if program == "sglang" and list(argv[1:2]) == ["serve"]:
        return True
    if program.startswith("python") and len(argv) > 2 and os.path.basename(argv[1]) == "sglang" \
            and argv[2] == "serve":
        return True
    return False


def is_worker_argv(argv: Sequence[str] | None) -> bool:
    """An SGLang server child by its process title (sglang::scheduler_TP0, sglang::detokenizer...).

    >>> is_worker_argv(["sglang::scheduler_TP3"]), is_worker_argv(["python3"])
    (True, False)
    """
    return bool(argv and argv[0].startswith(TITLE_PREFIXES))


def is_scheduler_argv(argv: Sequence[str] | None) -> bool:
    """One rank's scheduler: the workers a server must keep alive."""
    return bool(argv and argv[0].startswith(SCHEDULER_TITLE))


def is_server_part(argv: Sequence[str] | None) -> bool:
    return is_main_argv(argv) or is_worker_argv(argv)


def is_client_argv(argv: Sequence[str] | None) -> bool:
    """SGLang clients (benchmarks, one-off scripts): reported, never signalled.

    >>> is_client_argv(["python3", "-m", "sglang.bench_serving"])
    True
    """
    module = python_module(argv or []) or ""
    # the weight cache's daemon is a server's own part (gpugate.agent.weight_cache), not a client
    return module.startswith("sglang.") and module != "sglang.srt.weight_cache.daemon" and not is_main_argv(argv)


def argv_port(argv: Sequence[str]) -> int:
    return flag_int(argv, DEFAULT_PORT, "--port")


def argv_token(argv: Sequence[str], admin: bool = False) -> str | None:
    """The key a request to this server needs: --admin-api-key first for admin endpoints."""
    if admin:
        return flag_value(argv, "--admin-api-key") or flag_value(argv, "--api-key")
    return flag_value(argv, "--api-key")


def argv_host(argv: Sequence[str]) -> str:
    return flag_value(argv, "--host") or "127.0.0.1"


def argv_model(argv: Sequence[str]) -> str | None:
    return flag_value(argv, "--model-path", "--model")


def server_gpus(argv: Sequence[str], env: Mapping[str, str] | None = None,
                uuids: Sequence[str | None] | None = None) -> list[int] | None:
    """The GPUs a server uses, from its flags and environment (gpugate.engine.gpus.gpu_set). None
    when they cannot be told (a UUID we cannot map).

    >>> server_gpus(["python3", "-m", "sglang.launch_server", "--tp", "4", "--base-gpu-id", "4"])
    [4, 5, 6, 7]
    """
    try:
        return rules_gpus.gpu_set(
            tp=flag_int(argv, 1, "--tp-size", "--tp", "--tensor-parallel-size"),
            pp=flag_int(argv, 1, "--pp-size", "--pp", "--pipeline-parallel-size"),
            dp=flag_int(argv, 1, "--dp-size", "--dp", "--data-parallel-size"),
            dp_attention="--enable-dp-attention" in argv, nnodes=flag_int(argv, 1, "--nnodes"),
            base_gpu_id=flag_int(argv, 0, "--base-gpu-id"), gpu_id_step=flag_int(argv, 1, "--gpu-id-step"),
            visible=(env or {}).get("CUDA_VISIBLE_DEVICES"), uuids=uuids)
    except rules_gpus.GpuSetError:
        return None


def adopted_env(environ: Mapping[str, str] | None, keep_names: Sequence[str] = (),
                argv: Sequence[str] | None = None) -> Dict[str, str]:
    """What an adopted SGLang server's environment keeps (gpugate.engine.argv.adopt_env): the names
    SGLang and its libraries read.

    >>> adopted_env({"USER": "root", "SSH_CLIENT": "10.0.0.1 5 22", "HF_TOKEN": "hf-x", "FOO": "1"}, ["FOO"])
    {'FOO': '1', 'HF_TOKEN': 'hf-x'}
    """
    return adopt_env(environ, keep_names, argv, ADOPT_ENV_PREFIXES, ADOPT_ENV_NAMES)
