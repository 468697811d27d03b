"""Where the stand-in finds the lab's shared parts: the simulated driver, the streamed answers'
writer, what every stand-in shares (titles, memory, children, HTTP) and their real-GPU mode, the stdlib
copies installed beside it in a lab container (gpugate_standin and the modules it names), else the
lab package (development)."""

try:
    import gpugate_standin as common
except ImportError:
    from gpugate_lab.standin import _common as common  # type: ignore[no-redef]

gpusim, sse, real, metrics = common.gpusim, common.sse, common.real, common.metrics

__all__ = ["common", "gpusim", "metrics", "real", "sse"]
