"""Same-host Dispatch: frames over a unix socket, tensors in a shared buffer.

A router on this host (``router.transport_local``) connects to the group's
SOCK_SEQPACKET socket, where one packet is one ``DispatchFrame``. It writes a
call's tensors into a buffer both processes map (``shared_buffer``: a memfd that
rides along with the frame that first uses it, or a CUDA IPC handle) and sends a
frame of a few hundred bytes; the group computes from the buffer in place,
writes the partial sums where the frame says and answers with a frame. Only
headers go through the socket.

Trust: the socket file is its owner's only (0600 in a 0700 directory), and a
connection's first frame must carry the token that the Transports RPC hands out
(over TLS when TLS is on), so only callers that passed the gRPC server's checks
get in. Frames are checked like stream frames; buffer bounds before any byte is
read or written; expert ids and weights are copied out of the buffer before they
are checked, so the router cannot change them afterwards. A bad frame gets an
error frame and the connection goes on; a broken connection ends only itself.
At most ``max_connections`` are open; one more is refused with RESOURCE_EXHAUSTED.
"""

from __future__ import annotations

import hmac
import logging
import os
import secrets
import socket
import stat
import tempfile
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import grpc
import torch

from expertmesh.contracts import frames as wire_frames
from expertmesh.contracts import shared_buffer
from expertmesh.contracts.errors import InvalidRequest
from expertmesh.v1 import experts_pb2 as pb

if TYPE_CHECKING:
    from expertmesh.expert_group.service import ExpertGroupServicer

log = logging.getLogger(__name__)

#: Connections a group serves at once (each holds a thread); routers keep one per call in flight.
MAX_CONNECTIONS = 128
#: A connection that does not present the token within this long is closed.
HELLO_TIMEOUT_S = 5.0


def runtime_dir() -> Path:
    """This user's directory for the groups' same-host sockets: private (0700), never another user's."""
    path = Path(tempfile.gettempdir()) / f"expertmesh-{os.getuid()}"
    path.mkdir(mode=0o700, exist_ok=True)
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise OSError(f"{path} is not a private directory of this user")
    return path


def remove_stale_sockets(directory: Path) -> None:
    """Remove the socket files in ``directory`` that nobody listens on any more (groups that died
    without stopping). A socket is stale when connecting to it is refused, never on its name alone."""
    for path in directory.glob("*.sock"):
        kind = socket.SOCK_SEQPACKET if path.name.endswith("-shm.sock") else socket.SOCK_STREAM
        with socket.socket(socket.AF_UNIX, kind) as probe:
            probe.settimeout(1.0)
            try:
                probe.connect(str(path))
            except ConnectionRefusedError:
                path.unlink(missing_ok=True)
            except OSError:
                pass


def remove_files(paths: list[Path]) -> None:
    """Remove a group's socket files (those still there)."""
    for path in paths:
        path.unlink(missing_ok=True)


def _error(call_id: int, code: grpc.StatusCode, message: str) -> pb.DispatchFrame:
    return pb.DispatchFrame(call_id=call_id, code=code.value[0], message=message)


class _Connection:
    """One router connection's shared buffer ([bytes] uint8, CPU or GPU) and the transport it makes."""

    def __init__(self) -> None:
        self.shared: wire_frames.BufferViews | None = None
        self.transport = "shm"

    def adopt(self, frame: pb.DispatchFrame, fds: list[int]) -> None:
        """Map the buffer that came with ``frame``, if one did; closes every descriptor received."""
        try:
            if frame.HasField("cuda_buffer"):
                self.shared, self.transport = (
                    self._opened(shared_buffer.open_cuda, frame.cuda_buffer, frame),
                    "cuda-ipc",
                )
            elif fds:
                self.shared, self.transport = self._opened(shared_buffer.open_memfd, fds.pop(), frame), "shm"
            elif self.shared is None:
                raise InvalidRequest("no shared buffer: the first call on a connection must bring one")
            elif frame.buffer_bytes != self.shared.buffer.numel():
                raise InvalidRequest(
                    f"the frame names a {frame.buffer_bytes}-byte buffer; this connection's is "
                    f"{self.shared.buffer.numel()} bytes"
                )
        finally:
            for fd in fds:
                os.close(fd)

    @staticmethod
    def _opened(open_buffer, source, frame: pb.DispatchFrame) -> wire_frames.BufferViews:
        try:
            return wire_frames.BufferViews(open_buffer(source, frame.buffer_bytes))
        except InvalidRequest:
            raise
        except Exception as err:  # no CUDA here, a handle that does not open, ...
            raise InvalidRequest(f"cannot map the shared buffer: {type(err).__name__}: {err}") from None

    def request(self, frame: pb.DispatchFrame) -> list[torch.Tensor]:
        hidden, ids, weights = self.shared.views(frame.tensors, wire_frames.REQUEST_TENSORS)
        return [hidden, ids.clone(), weights.clone()]

    def put_answer(self, frame: pb.DispatchFrame, partial: torch.Tensor, reply: pb.DispatchFrame) -> None:
        meta = wire_frames.meta(partial)
        (out,) = self.shared.views([meta], wire_frames.ANSWER_TENSORS, start=frame.answer_offset)
        out.copy_(partial)
        if out.is_cuda:
            torch.cuda.synchronize(out.device)
        reply.tensors.append(meta)


class LocalServer:
    def __init__(self, servicer: "ExpertGroupServicer", directory: Path, max_connections: int = MAX_CONNECTIONS):
        self._servicer = servicer
        self.token = secrets.token_bytes(32)
        self.path = directory / f"{os.getpid()}-{secrets.token_hex(4)}-shm.sock"
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._listener.bind(str(self.path))
            os.chmod(self.path, 0o600)
            self._listener.listen(64)
        except OSError:
            self._listener.close()
            raise
        self._slots = threading.BoundedSemaphore(max_connections)
        self._lock = threading.Lock()
        self._connections: set[socket.socket] = set()
        self._stopped = False
        self._acceptor = threading.Thread(target=self._accept, name=f"expertmesh-shm-{servicer.group}", daemon=True)

    def start(self) -> "LocalServer":
        self._acceptor.start()
        return self

    def stop(self) -> None:
        """Stop accepting, end every connection, remove the socket file."""
        try:
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes accept()
        except OSError:
            pass
        self._listener.close()
        with self._lock:
            self._stopped = True
            for conn in self._connections:
                try:
                    conn.shutdown(socket.SHUT_RDWR)  # wakes its thread's recv; it closes the socket
                except OSError:
                    pass
        if self._acceptor.is_alive():
            self._acceptor.join()
        self.path.unlink(missing_ok=True)

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return  # stopped
            if not self._slots.acquire(blocking=False):
                threading.Thread(target=self._refuse, args=(conn,), name="expertmesh-shm-refuse", daemon=True).start()
                continue
            with self._lock:
                if self._stopped:
                    conn.close()
                    self._slots.release()
                    return
                self._connections.add(conn)
            threading.Thread(target=self._serve, args=(conn,), name="expertmesh-shm-conn", daemon=True).start()

    @staticmethod
    def _refuse(conn: socket.socket) -> None:
        """Answer a connection past the limit with RESOURCE_EXHAUSTED, after reading its first frame:
        closing a socket with unread data resets it, and the caller would never read why."""
        try:
            conn.settimeout(HELLO_TIMEOUT_S)
            for fd in socket.recv_fds(conn, wire_frames.MAX_HEADER_BYTES, 1)[1]:
                os.close(fd)
            refusal = _error(
                0, grpc.StatusCode.RESOURCE_EXHAUSTED, "this group has its limit of same-host connections open"
            )
            conn.send(refusal.SerializeToString())
        except OSError:
            pass
        finally:
            conn.close()

    def _serve(self, conn: socket.socket) -> None:
        state = _Connection()
        use = self._servicer.transport_use
        helloed = False
        try:
            helloed = self._hello(conn)
            if not helloed:
                return
            use.opened(state.transport)
            while True:
                data, fds, flags, _ = socket.recv_fds(conn, wire_frames.MAX_HEADER_BYTES, 1)
                if not data and not fds:
                    return  # the router closed the connection
                before = state.transport
                reply = self._call(state, data, fds, flags)
                if state.transport != before:
                    use.closed(before)
                    use.opened(state.transport)
                conn.send(reply.SerializeToString())
        except OSError:
            pass  # a broken connection ends only itself
        finally:
            if helloed:
                use.closed(state.transport)
            with self._lock:
                self._connections.discard(conn)
            conn.close()
            self._slots.release()

    def _hello(self, conn: socket.socket) -> bool:
        """The connection's first frame must carry the token; answers it either way."""
        conn.settimeout(HELLO_TIMEOUT_S)
        data, fds, _, _ = socket.recv_fds(conn, wire_frames.MAX_HEADER_BYTES, 1)
        for fd in fds:
            os.close(fd)
        try:
            accepted = hmac.compare_digest(wire_frames.parse_header(data).token, self.token)
        except InvalidRequest:
            accepted = False
        if accepted:  # a packet of zero bytes would read as the end of the connection: say something
            conn.send(pb.DispatchFrame(message=f"expert group {self._servicer.group}").SerializeToString())
            conn.settimeout(None)
            return True
        refusal = _error(
            0,
            grpc.StatusCode.PERMISSION_DENIED,
            "this socket takes only callers that present the token of the group's Transports RPC",
        )
        conn.send(refusal.SerializeToString())
        return False

    def _call(self, state: _Connection, data: bytes, fds: list[int], flags: int) -> pb.DispatchFrame:
        try:
            if flags & (socket.MSG_TRUNC | socket.MSG_CTRUNC):
                raise InvalidRequest(
                    f"a frame over {wire_frames.MAX_HEADER_BYTES} bytes, or with more than one descriptor, "
                    "is not a dispatch frame"
                )
            frame = wire_frames.parse_header(data)
        except InvalidRequest as err:
            for fd in fds:
                os.close(fd)
            return _error(0, err.code, str(err))
        try:
            state.adopt(frame, fds)
        except InvalidRequest as err:
            return _error(frame.call_id, err.code, str(err))
        reply, partial = self._servicer.answer(frame, state.transport, lambda: state.request(frame))
        if partial is not None:
            try:
                state.put_answer(frame, partial, reply)
            except InvalidRequest as err:
                return _error(frame.call_id, err.code, f"the answer does not fit where the frame asks for it: {err}")
        return reply
