"""``vllm.version`` (vllm/version.py): the release, as the server logs and ``/version`` report it."""

from vllm import __version__

__all__ = ["__version__"]
