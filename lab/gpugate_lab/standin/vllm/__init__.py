"""The gpugate lab's vLLM stand-in (stdlib only): ``vllm serve`` / ``python3 -m vllm.entrypoints.cli.main
serve ...`` (and the deprecated ``python3 -m vllm.entrypoints.openai.api_server ...``).

It takes vLLM's own flags (the snapshot of one release's parser), binds its port before the model
loads, starts ``VLLM::EngineCore`` (and ``VLLM::Worker_TP<r>`` per GPU when the model spans more than
one) holding simulated GPU memory, serves the OpenAI API once the engine is up, and stops as
``--shutdown-timeout`` says. See vllm/_api_server.py for what it copies from vLLM 0.33.0 and where.
"""

try:  # written by the lab with the snapshot it installs (container_files.install_vllm)
    from vllm._version import __version__
except ImportError:
    __version__ = "0.0.0+standin"
STANDIN = True
