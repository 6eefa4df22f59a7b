"""Memory that a router and an expert group on one host both map: the buffers of
the shared-memory dispatch path (``router.transport_local``, ``expert_group.local_server``).

- *memfd* buffers: an anonymous memory file (``memfd_create``) handed to the group
  as a file descriptor over the unix socket (SCM_RIGHTS). It has no name, so
  nothing is left in /dev/shm when either side dies; it is not bounded by a
  container's small /dev/shm; its memory is freed when the last side lets go.
- *CUDA IPC* buffers: GPU memory shared with a CUDA IPC handle, for a router
  whose tensors are on a GPU of this host; the group maps it on its side.

``host_id`` and ``gpu_uuid`` are the queries that decide whether these paths
are worth trying; ``gpu_uuid`` is the only device query (tests fake it).
"""

from __future__ import annotations

import os
import socket
import stat
from functools import cache

import torch

from expertmesh.contracts.errors import InvalidRequest
from expertmesh.v1 import experts_pb2 as pb

#: Largest buffer a group maps for one connection: a call plus its answer, at gRPC's message limit each.
MAX_BUFFER_BYTES = 1 << 30
_MEMFD_NAME = "expertmesh-dispatch"


@cache
def host_id() -> str:
    """The boot id of this kernel: equal in every process (and container) of one host, different on any other."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def gpu_uuid(device: torch.device) -> str | None:
    """The UUID of the GPU ``device`` names (process-independent, unlike its index); None for a CPU."""
    if device.type != "cuda":
        return None
    return str(torch.cuda.get_device_properties(device).uuid)


# -- memfd ----------------------------------------------------------------------------------


def create_memfd(nbytes: int) -> tuple[torch.Tensor, int]:
    """A new [nbytes] uint8 buffer and its file descriptor (to pass, then close)."""
    fd = os.memfd_create(_MEMFD_NAME, os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, nbytes)
        return _map(fd, nbytes), fd
    except BaseException:
        os.close(fd)
        raise


def open_memfd(fd: int, nbytes: int) -> torch.Tensor:
    """Map ``nbytes`` of a memfd another process passed; closes ``fd``. Raises InvalidRequest for
    anything else (a file, a pipe: the group must not write where the sender could not) or too small."""
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or not os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:"):
            raise InvalidRequest("the descriptor passed with a dispatch frame is not a memfd")
        if not 0 < nbytes <= min(info.st_size, MAX_BUFFER_BYTES):
            raise InvalidRequest(
                f"a shared buffer of {nbytes} bytes does not fit the {info.st_size}-byte memfd "
                f"(or the {MAX_BUFFER_BYTES}-byte limit)"
            )
        return _map(fd, nbytes)
    finally:
        os.close(fd)


def _map(fd: int, nbytes: int) -> torch.Tensor:
    """[nbytes] uint8 over a shared mapping of ``fd``; unmapped when the tensor's storage is freed."""
    return torch.from_file(f"/proc/self/fd/{fd}", shared=True, size=nbytes, dtype=torch.uint8)


# -- CUDA IPC -------------------------------------------------------------------------------


def create_cuda(nbytes: int, device: torch.device) -> tuple[torch.Tensor, pb.CudaIpcHandle]:
    """A new [nbytes] uint8 buffer on ``device`` and the handle a group opens it with."""
    buffer = torch.empty(nbytes, dtype=torch.uint8, device=device)
    (_, handle, size, offset, ref_handle, ref_offset, event, sync) = buffer.untyped_storage()._share_cuda_()
    return buffer, pb.CudaIpcHandle(
        gpu_uuid=gpu_uuid(device) or "",
        handle=handle,
        size_bytes=size,
        offset_bytes=offset,
        ref_counter_handle=ref_handle,
        ref_counter_offset=ref_offset,
        event_handle=event or b"",
        event_sync_required=sync,
    )


def open_cuda(handle: pb.CudaIpcHandle, nbytes: int) -> torch.Tensor:
    """Map a router's GPU buffer in this process: [nbytes] uint8 on the GPU with ``handle.gpu_uuid``."""
    if not 0 < nbytes <= min(handle.size_bytes, MAX_BUFFER_BYTES):
        raise InvalidRequest(
            f"a shared GPU buffer of {nbytes} bytes does not fit its {handle.size_bytes}-byte allocation"
        )
    index = next(
        (i for i in range(torch.cuda.device_count()) if gpu_uuid(torch.device("cuda", i)) == handle.gpu_uuid), None
    )
    if index is None:
        raise InvalidRequest(f"GPU {handle.gpu_uuid} of a CUDA IPC buffer is not visible to this group")
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        index,
        handle.handle,
        handle.size_bytes,
        handle.offset_bytes,
        handle.ref_counter_handle,
        handle.ref_counter_offset,
        handle.event_handle or None,
        handle.event_sync_required,
    )
    return torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", index)).set_(storage)[:nbytes]
