"""One rank's weights in the stand-in: how much memory they take, and (real mode) the bytes themselves.

Simulated lab: a rank's weights are ``$SGLANG_STANDIN_WEIGHT_MIB`` MiB when set, else this rank's share
of the model's parameters as the capacity model counts them from config.json (sglang/_capacity.py:
parameters x dtype bytes / tp), at most half of the rank's static pool (``mem_fraction_static`` x the
GPU's memory) so that a lab GPU of any size keeps room for a KV pool. The scheduler's static pool is
weights + KV, as before: a cold engine holds context + weights + KV; a weight-cache client holds context
+ KV only (its weights are the daemon's), the daemon context + weights.

Real mode (``gpugate lab up --gpus real``): ``$SGLANG_STANDIN_WEIGHTS_FILE`` names a file on local disk;
rank r of tp reads its slice (bytes ``r*size//tp`` to ``(r+1)*size//tp``, the TP shard) in
``$SGLANG_STANDIN_WEIGHTS_CHUNK_MIB`` (default 64) MiB chunks into one CUDA ``uint8`` tensor (what the
daemon child and a cold engine do; a client maps the daemon's instead). ``$SGLANG_STANDIN_WEIGHTS_DROP_CACHE=1``
first asks the kernel to drop the file's cached pages (posix_fadvise DONTNEED) so the read comes from the
disk. Without a file: ``$SGLANG_STANDIN_WEIGHT_MIB`` MiB of zeros (default 0: no weight set, the real
mode as before). The figures (bytes, read seconds, GB/s) go to the log.
"""

import os
import time

from sglang import _capacity

MIB = 1 << 20


def weight_mib(server_args, total_mib):
    """MiB of one rank's weights in the simulated lab.

    >>> weight_mib({"tp_size": 2, "mem_fraction_static": 0.5, "model_path": "/nonexistent"}, 10000) <= 2500
    True
    """
    forced = os.environ.get("SGLANG_STANDIN_WEIGHT_MIB")
    if forced:
        return max(0, int(float(forced)))
    shape = _capacity._shape(_capacity.model_config(server_args.get("model_path")))
    tp = max(1, int(server_args.get("tp_size") or 1))
    counted = int(_capacity.parameter_count(shape) * shape["dtype_bytes"] / tp / MIB)
    pool = int(int(total_mib) * float(server_args.get("mem_fraction_static") or 0.88))
    return max(0, min(counted, pool // 2))


def real_weight_spec(tp_rank, tp_size):
    """(path or None, offset, length in bytes) of this rank's weights in real mode."""
    path = os.environ.get("SGLANG_STANDIN_WEIGHTS_FILE") or None
    if path:
        size = os.path.getsize(path)
        start, stop = size * tp_rank // tp_size, size * (tp_rank + 1) // tp_size
        return path, start, stop - start
    return None, 0, int(float(os.environ.get("SGLANG_STANDIN_WEIGHT_MIB") or 0) * MIB)


def load_real(torch, device, tp_rank, tp_size, log):
    """This rank's weights as one ``uint8`` tensor on ``device`` (None when there are none), and the
    figures: ``{"bytes", "read_s", "gbps", "file", "dropped_cache"}``."""
    path, offset, length = real_weight_spec(tp_rank, tp_size)
    figures = {"bytes": length, "file": path, "read_s": 0.0, "gbps": 0.0, "dropped_cache": False}
    if length <= 0:
        return None, figures
    tic = time.perf_counter()
    tensor = torch.empty(length, dtype=torch.uint8, device=device)
    if path is None:
        tensor.zero_()
    else:
        chunk = max(1, int(float(os.environ.get("SGLANG_STANDIN_WEIGHTS_CHUNK_MIB") or 64))) * MIB
        buf = bytearray(min(chunk, length))
        view = memoryview(buf)
        host = torch.frombuffer(buf, dtype=torch.uint8)
        with open(path, "rb", buffering=0) as handle:
            if os.environ.get("SGLANG_STANDIN_WEIGHTS_DROP_CACHE") == "1" and hasattr(os, "posix_fadvise"):
                os.posix_fadvise(handle.fileno(), offset, length, os.POSIX_FADV_DONTNEED)
                figures["dropped_cache"] = True
            handle.seek(offset)
            done = 0
            while done < length:
                n = handle.readinto(view[:min(len(buf), length - done)])
                if not n:
                    raise RuntimeError("%s: short read at byte %d of %d" % (path, offset + done, offset + length))
                tensor[done:done + n].copy_(host[:n])  # from pageable memory: synchronous
                done += n
    if str(device).startswith("cuda"):
        torch.cuda.synchronize(device)
    figures["read_s"] = round(time.perf_counter() - tic, 3)
    figures["gbps"] = round(length / max(figures["read_s"], 1e-9) / 1e9, 3)
    log("Weights read: %d bytes from %s in %.3f s (%.3f GB/s%s)" % (
        length, path or "zeros", figures["read_s"], figures["gbps"],
        ", page cache dropped first" if figures["dropped_cache"] else ""))
    return tensor, figures


def checksum(torch, tensor, limit=16 * MIB):
    """A cheap fingerprint of a weight tensor (sum of its first ``limit`` bytes), to show that a client
    reads the daemon's bytes."""
    if tensor is None:
        return 0
    return int(tensor[:limit].to(torch.int64).sum().item())
