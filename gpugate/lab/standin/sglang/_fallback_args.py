"""A tiny copy of SGLang's parser, used only when ``sglang/_server_args.py`` (gpugate/sglang_args.py,
copied in by install_container_extras) is missing. Same names, types and choices for the flags it has."""

import argparse


def build_parser(prog: str = "launch_server.py") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--model-path", "--model", dest="model_path", type=str, required=True)
    p.add_argument("--tokenizer-path", type=str, default=None)
    p.add_argument("--host", type=str, default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tensor-parallel-size", "--tp-size", dest="tp_size", type=int, default=1)
    p.add_argument("--data-parallel-size", "--dp-size", dest="dp_size", type=int, default=1)
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--kv-cache-dtype", type=str, default="auto",
                   choices=["auto", "fp8_e5m2", "fp8_e4m3", "bf16", "bfloat16", "fp4_e2m1"])
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--served-model-name", type=str, default=None)
    p.add_argument("--base-gpu-id", type=int, default=0)
    p.add_argument("--gpu-id-step", type=int, default=1)
    p.add_argument("--disable-radix-cache", action="store_true")
    p.add_argument("--disable-cuda-graph", action="store_true")
    p.add_argument("--enable-hierarchical-cache", action="store_true")
    p.add_argument("--hicache-ratio", type=float, default=2.0)
    p.add_argument("--hicache-size", type=int, default=0)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--log-level", type=str, default="info")
    return p
