"""Where the stand-in finds the simulated driver: the stdlib copy installed beside it in a lab
container (gpugate_gpusim), else the gpugate package (development)."""

try:
    import gpugate_gpusim as gpusim
except ImportError:
    from gpugate_lab import gpusim  # type: ignore[no-redef]

__all__ = ["gpusim"]
