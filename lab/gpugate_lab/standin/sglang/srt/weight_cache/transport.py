"""The stand-in's ``sglang.srt.weight_cache.transport``: SGLang 0.5.23's default ``torch_ipc`` backend.

SGLang's ``TorchIpcTransportBackend`` exports each tensor as
``MultiprocessingSerializer.serialize(tensor.data, output_str=True)``: torch's ``ForkingPickler`` dump of
the tensor (a CUDA tensor reduces through ``torch.multiprocessing.reductions.reduce_tensor`` to a CUDA
IPC handle of its storage, rebuilt on the other side by ``rebuild_cuda_tensor``, which opens the handle:
the client's tensor is the daemon's memory, no copy), base64-encoded. An entry is
``{"handle", "shape", "dtype", "is_param"}``; the ``fetch_state`` reply is
``{"status": "ok", "config", "entries", "pid", "transport_backend": "torch_ipc", "preloaded_weights_bytes"}``.
(SGLang's ``vmm_fd`` backend is a placeholder that is never chosen in 0.5.23.)

Real mode does exactly that with torch (imported only there). In a simulated lab there is no memory to
share: an entry's handle is ``sim:<allocation id>`` of the daemon's allocation in the simulated driver,
and importing it checks that the allocation still exists (a dangling handle raises), holding nothing.
"""

import base64
import io
import pickle

from sglang.srt.weight_cache.protocol import send_msg

TORCH_IPC_BACKEND = "torch_ipc"
VMM_FD_BACKEND = "vmm_fd"
SIM_HANDLE = "sim:"


def serialize_tensor(tensor):
    """``MultiprocessingSerializer.serialize(tensor, output_str=True)``: a CUDA IPC handle, base64."""
    import torch.multiprocessing  # noqa: F401,PLC0415 -- registers torch's reductions in ForkingPickler
    from multiprocessing.reduction import ForkingPickler  # noqa: PLC0415

    buf = io.BytesIO()
    ForkingPickler(buf).dump(tensor)
    return base64.b64encode(buf.getvalue()).decode("utf-8")


def deserialize_tensor(handle):
    """The tensor behind a handle (``rebuild_cuda_tensor`` opens the IPC handle: zero copy)."""
    import torch.multiprocessing  # noqa: F401,PLC0415

    return pickle.loads(base64.b64decode(handle, validate=True))


class TorchIpcTransportBackend:
    name = TORCH_IPC_BACKEND

    def prepare_export(self, state_tensors):
        """``{name: (tensor, is_param)}`` -> entries. A tensor may be a sim record
        ``{"sim_alloc": id, "gpu": physical, "bytes": n}`` in a simulated lab."""
        entries = {}
        for name, (tensor, is_param) in state_tensors.items():
            if isinstance(tensor, dict):
                entries[name] = {"handle": SIM_HANDLE + str(tensor["sim_alloc"]), "shape": [int(tensor["bytes"])],
                                 "dtype": "uint8", "is_param": is_param, "gpu": tensor["gpu"]}
            else:
                entries[name] = {"handle": serialize_tensor(tensor.data), "shape": list(tensor.shape),
                                 "dtype": str(tensor.dtype).replace("torch.", ""), "is_param": is_param}
        return entries

    def send_fetch_state_response(self, conn, config, entries, pid, preloaded_weights_bytes=0):
        send_msg(conn, {"status": "ok", "config": config, "entries": entries, "pid": pid,
                        "transport_backend": self.name, "preloaded_weights_bytes": preloaded_weights_bytes})

    def recv_fetch_state_response(self, sock, result):
        return result

    def import_tensor(self, entry):
        handle = entry["handle"]
        if isinstance(handle, str) and handle.startswith(SIM_HANDLE):
            return _import_sim(handle[len(SIM_HANDLE):], entry)
        return deserialize_tensor(handle)


def _import_sim(alloc_id, entry):
    from sglang._sim import gpusim  # noqa: PLC0415

    for record in gpusim.list_allocations():
        if record.get("id") == alloc_id:
            return {"sim_alloc": alloc_id, "gpu": record.get("gpu"), "bytes": entry["shape"][0]}
    raise RuntimeError("CUDA error: invalid resource handle (the daemon's allocation %s is gone)" % alloc_id)


def choose_daemon_transport_backend(state_tensors):
    return TorchIpcTransportBackend()


def get_client_transport_backend(name):
    if name in (None, "", TORCH_IPC_BACKEND):
        return TorchIpcTransportBackend()
    if name == VMM_FD_BACKEND:
        raise NotImplementedError("weight cache transport backend %r is not implemented in this build" % VMM_FD_BACKEND)
    raise RuntimeError("Unknown weight cache transport backend %r" % (name,))
