"""The GPU set rule: which GPUs (as the container numbers them) a server's ranks use: rank i on
device ``base + i*step`` of the devices CUDA_VISIBLE_DEVICES shows (SGLang's --base-gpu-id and
--gpu-id-step; vLLM places ranks from device 0 of what CUDA_VISIBLE_DEVICES shows).

One function for both sides of each engine: the controller (the engine's launch, from flags) and the
agent (the engine's container module's ``server_gpus``, from a running argv) read their numbers and
call it. Stdlib only: bundled into the agent.
"""

from __future__ import annotations

# typing is never imported at run time (~10 ms of every agent command); mypy sees the names.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Sequence


class GpuSetError(ValueError):
    """The set cannot be told: CUDA_VISIBLE_DEVICES too short for the ranks, or an entry that is
    neither an index nor a known UUID. The message is the operator's; ``uuid``: the set could be
    told once the container is asked (an entry is a UUID), so it is no error of the flags."""

    def __init__(self, message: str, uuid: bool = False):
        super().__init__(message)
        self.uuid = uuid


def gpu_set(tp: int = 1, pp: int = 1, dp: int = 1, dp_attention: bool = False, nnodes: int = 1,
            base_gpu_id: int = 0, gpu_id_step: int = 1, visible: str | None = None,
            uuids: Sequence[str | None] | None = None) -> list[int]:
    """GPU indexes as the engines assign them: ``tp x pp x dp`` ranks (dp counts only without
    dp-attention: with it the DP ranks share the TP GPUs), divided over ``nnodes``, from
    ``base_gpu_id`` every ``gpu_id_step``, then mapped through ``visible``
    (CUDA_VISIBLE_DEVICES): an index entry is taken as is, a UUID through ``uuids`` (the GPUs'
    UUIDs in index order, when the caller knows them). Raises GpuSetError when it cannot be told.

    >>> gpu_set(tp=4, base_gpu_id=4)
    [4, 5, 6, 7]
    >>> gpu_set(tp=2, dp=2), gpu_set(tp=2, dp=2, dp_attention=True)
    ([0, 1, 2, 3], [0, 1])
    >>> gpu_set(tp=2, gpu_id_step=2, visible="3,4,5,6"), gpu_set(tp=1, visible="GPU-b", uuids=["GPU-a", "GPU-b"])
    ([3, 5], [1])
    """
    if dp_attention:
        dp = 1
    nnodes = max(1, nnodes)
    step = max(1, gpu_id_step)
    count = max(1, tp * pp * dp // nnodes)
    ids = [base_gpu_id + rank * step for rank in range(count)]
    visible = str(visible or "").strip()
    if not visible:
        return ids
    entries = [item.strip() for item in visible.split(",") if item.strip()]
    out = []
    for index in ids:
        if index >= len(entries):
            raise GpuSetError("CUDA_VISIBLE_DEVICES=%s lists %d GPU(s); the server's ranks need device %d "
                              "(tp %d x pp %d x dp %d%s)"
                              % (visible, len(entries), index, tp, pp, dp,
                                 ", from --base-gpu-id %d, step %d" % (base_gpu_id, step) if base_gpu_id or step != 1 else ""))
        entry = entries[index]
        if entry.isdigit():
            out.append(int(entry))
        elif uuids and entry in uuids:
            out.append(list(uuids).index(entry))
        else:
            raise GpuSetError("CUDA_VISIBLE_DEVICES=%s: %r is not a GPU index "
                              "(UUIDs cannot be mapped before the container is asked)" % (visible, entry), uuid=True)
    return out
