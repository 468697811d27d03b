"""Where the stand-in finds the lab's shared parts: the simulated driver, the streamed answers'
writer and what every stand-in shares (titles, memory, children, HTTP), the stdlib copies installed
beside it in a lab container (gpugate_gpusim, gpugate_sse, gpugate_standin), else the lab package
(development)."""

try:
    import gpugate_gpusim as gpusim
except ImportError:
    from gpugate_lab import gpusim  # type: ignore[no-redef]
try:
    import gpugate_sse as sse
except ImportError:
    from gpugate_lab.standin import _sse as sse  # type: ignore[no-redef]

try:
    import gpugate_standin as common
except ImportError:
    from gpugate_lab.standin import _common as common  # type: ignore[no-redef]

try:
    import gpugate_standin_real as real
except ImportError:
    from gpugate_lab.standin import _realgpu as real  # type: ignore[no-redef]

__all__ = ["common", "gpusim", "real", "sse"]
