"""The two directions of a TLS connection between two members of a
:class:`~lowcomm.comm.tls.TlsComm`: every pair holds two connections, one each way, so each TLS
connection is written by one thread and read by another process's one thread (OpenSSL's
connection objects are not for concurrent use). :class:`Outbound` sends frames in the order
they were posted, from a thread of its own (a ring's simultaneous sends and receives never wait
on each other); :class:`Inbound` reads them on a thread of its own, straight into the buffer of
the receive posted for its tag (a frame that arrives before its receive is posted is kept
until it is). A frame: a 16-byte header (tag, byte count) and the bytes."""
from __future__ import annotations

import queue
import socket
import ssl
import struct
import threading

import torch

HEADER = struct.Struct("<qQ")


def why(e: BaseException) -> str:
    """A connection's failure in words."""
    if isinstance(e, ssl.SSLCertVerificationError):
        return (f"the peer's certificate is not of this group's authority: the two do not "
                f"hold the same secret ({e.verify_message})")
    if isinstance(e, ssl.SSLError) and "alert" in str(e):
        return (f"the peer refused this member's certificate: the two do not hold the same "
                f"secret ({e.reason})")
    if isinstance(e, ssl.SSLError):
        return f"TLS error: {e.reason or e}"
    return f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else 'closed'}"


def shut(sock) -> None:
    """End ``sock`` now: a thread blocked reading or writing it returns."""
    try:
        socket.socket.shutdown(sock, socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def as_bytes(flat: torch.Tensor) -> memoryview:
    """The bytes of a contiguous 1-D tensor, shared (written into by a receive)."""
    return memoryview(flat.view(torch.uint8).numpy())


class Op:
    """A send or receive in flight: ``done`` is set once it completed or failed (``error``)."""

    def __init__(self, tag: int, flat: torch.Tensor):
        self.tag, self.flat, self.view = tag, flat, as_bytes(flat)
        self.done, self.error = threading.Event(), None

    def finish(self, error: str | None = None) -> None:
        self.error, self.view = error, None
        self.done.set()


def read_into(sock, view: memoryview) -> None:
    while len(view):
        n = sock.recv_into(view, len(view))
        if n == 0:
            raise ConnectionError("the peer closed the connection")
        view = view[n:]


class Outbound(threading.Thread):
    """Sends the frames posted (:meth:`post`) to one peer, in order (module docstring)."""

    def __init__(self, sock, name: str):
        super().__init__(name=name, daemon=True)
        self.sock, self.error = sock, None
        self.jobs: queue.SimpleQueue = queue.SimpleQueue()

    def post(self, op: Op) -> Op:
        if self.error is not None:
            op.finish(self.error)
        else:
            self.jobs.put(op)
        return op

    def run(self) -> None:
        while (op := self.jobs.get()) is not None:
            if self.error is None:
                try:
                    self.sock.sendall(HEADER.pack(op.tag, len(op.view)))
                    if len(op.view):
                        self.sock.sendall(op.view)
                except (OSError, ValueError) as e:
                    self.error = why(e)
            op.finish(self.error)

    def close(self) -> None:
        self.error = self.error or "the group was closed"
        self.jobs.put(None)
        shut(self.sock)


class Inbound(threading.Thread):
    """Reads the frames one peer sends into the receives posted for them (module docstring)."""

    def __init__(self, sock, name: str):
        super().__init__(name=name, daemon=True)
        self.sock, self.error = sock, None
        self.lock = threading.Lock()
        self.posted: list[Op] = []                       # receives waiting for their frame
        self.early: list[tuple[int, bytearray]] = []     # frames waiting for their receive

    def post(self, op: Op) -> Op:
        with self.lock:
            for i, (tag, data) in enumerate(self.early):   # arrived before the peer closed
                if tag == op.tag:
                    del self.early[i]
                    self._fill(op, data)
                    return op
            if self.error is not None:
                op.finish(self.error)
                return op
            self.posted.append(op)
        return op

    @staticmethod
    def _fill(op: Op, data: bytearray) -> None:
        if len(data) != len(op.view):
            op.finish(f"the peer sent {len(data)} bytes where {len(op.view)} were expected")
            return
        op.view[:] = data
        op.finish()

    def _take(self, tag: int) -> Op | None:
        with self.lock:
            for i, op in enumerate(self.posted):
                if op.tag == tag:
                    return self.posted.pop(i)
        return None

    def run(self) -> None:
        head = bytearray(HEADER.size)
        op = None                                    # a receive being read into: fails with it
        try:
            while True:
                op = None
                read_into(self.sock, memoryview(head))
                tag, n = HEADER.unpack(head)
                op = self._take(tag)
                if op is not None and len(op.view) == n:
                    read_into(self.sock, op.view)
                    op.finish()
                    continue
                data = bytearray(n)                  # early, or the wrong size: read it all
                read_into(self.sock, memoryview(data))
                with self.lock:
                    op = op or next((o for o in self.posted if o.tag == tag), None)
                    if op is None:
                        self.early.append((tag, data))
                        continue
                    if op in self.posted:
                        self.posted.remove(op)
                self._fill(op, data)
        except (OSError, ValueError) as e:
            self._fail(why(e))
            if op is not None and not op.done.is_set():
                op.finish(self.error)

    def _fail(self, error: str) -> None:
        with self.lock:
            self.error = self.error or error
            posted, self.posted = self.posted, []
        for op in posted:
            op.finish(self.error)

    def close(self) -> None:
        self._fail("the group was closed")
        shut(self.sock)


__all__ = ["HEADER", "Inbound", "Op", "Outbound", "as_bytes", "read_into", "shut", "why"]
