"""TlsComm: a :class:`~lowcomm.comm.p2p.PeerComm` over TLS 1.3 (RFC 8446, Python's ``ssl``),
the default transport between a fleet's datacenters (``fleet.transport = "tls"``).

Every member of a group holds the group's secret (a fleet's: :mod:`lowcomm.run.fleet.trust`);
from it each derives the same certificate authority and signs a fresh key of its own with it
(:mod:`~lowcomm.comm.tls_identity`), so a connection is accepted only from a holder of the
secret, in both directions, and every byte on it is encrypted and authenticated.

Rendezvous: each member listens on an ephemeral port of ``host``, publishes ``host:port`` in
the group's store under ``prefix`` (a fleet's store seals it), connects to every other member
and says who it is (rank and the group's token, over TLS); the one it connected to answers one
byte. Each pair so holds two connections, one each way (:mod:`~lowcomm.comm.tls_link`). A
connection that fails its handshake or says the wrong group is refused and logged — the group
waits on for its members; once all are connected the listener closes. A member that cannot
reach another, or is not reached by one within ``timeout_s``, raises
:class:`~lowcomm.errors.CommError` naming both and why (e.g. the peer does not hold the
secret).

lowcomm's algorithms run on it unchanged (their sums in the same order as over MPI or gloo).
"""
from __future__ import annotations

import datetime
import hashlib
import logging
import socket
import struct
import threading
import time
from dataclasses import dataclass

import torch

from ..errors import CommError
from .ledger import Ledger
from .p2p import PeerComm
from .tls_identity import contexts
from .tls_link import Inbound, Op, Outbound, read_into, shut, why

log = logging.getLogger("lowcomm.tls")
HELLO = struct.Struct("<8sI16s")
MAGIC = b"lowcomm1"


@dataclass
class Rendezvous:
    """Where a TLS group meets: ``store`` (set/get/wait, as torch's stores) under ``prefix``,
    this member's ``rank`` of ``size``, the group's ``secret`` (bytes; ``salt`` binds it to
    e.g. a coordinator's session), and the address this member listens on (``host``)."""
    store: object
    prefix: str
    rank: int
    size: int
    secret: bytes
    salt: bytes = b""
    host: str = "127.0.0.1"

    @property
    def token(self) -> bytes:
        return hashlib.sha256(self.salt + b"\0" + self.prefix.encode()).digest()[:16]


def address_toward(host: str, port: int = 9) -> str:
    """This machine's address on the route to ``host`` (what a peer reaching ``host`` reaches
    this machine by, e.g. the coordinator's)."""
    family = socket.getaddrinfo(host, port, type=socket.SOCK_DGRAM)[0][0]
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


class TlsComm(PeerComm):
    """The members of rendezvous ``rv`` (module docstring), connected on construction."""

    def __init__(self, rv: Rendezvous, ledger: Ledger | None = None, level: str = "dc",
                 timeout_s: float = 60.0, peers: list | None = None, link=None):
        super().__init__(rv.rank, rv.size, ledger, level, timeout_s, peers, link)
        self.rv = rv
        self.out: dict[int, Outbound] = {}
        self.inn: dict[int, Inbound] = {}
        self.refused: list[str] = []                 # connections refused, and why
        self._lock = threading.Lock()
        self._closed = False
        try:
            self._meet()
        except BaseException:
            self.close()
            raise

    def _me(self) -> str:
        return f"{self.level} {self.peers[self.rank]}"

    # rendezvous --------------------------------------------------------------------------------
    def _meet(self) -> None:
        server, client = contexts(self.rv.secret, self.rv.salt)
        listener = socket.create_server((self.rv.host, 0), backlog=self.size + 8)
        host, port = listener.getsockname()[:2]
        deadline = time.monotonic() + self.timeout_s
        acceptor = threading.Thread(target=self._accept, args=(listener, server, deadline),
                                    name=f"lowcomm-tls-accept-{self.rank}", daemon=True)
        acceptor.start()
        try:
            self.rv.store.set(f"{self.rv.prefix}tls/{self.rank}", f"{host}:{port}")
            for j in range(self.size):
                if j != self.rank:
                    self._connect(j, client, deadline)
            acceptor.join(max(0.0, deadline - time.monotonic()))
        finally:
            listener.close()
        missing = [self.peers[j] for j in range(self.size) if j != self.rank and j not in self.inn]
        if missing:
            refused = f"; refused: {'; '.join(self.refused[-3:])}" if self.refused else ""
            raise CommError("tls.accept", self.rank, f"{self._me()} was not reached by "
                            f"{self.level} {missing} within {self.timeout_s:g} s{refused}")

    def _connect(self, j: int, client, deadline: float) -> None:
        """The connection this member sends to ``j`` over (module docstring)."""
        key, where = f"{self.rv.prefix}tls/{j}", "no address"
        try:
            self.rv.store.wait([key], datetime.timedelta(seconds=max(0.1, deadline -
                                                                     time.monotonic())))
            where = self.rv.store.get(key).decode()
            host, _, port = where.rpartition(":")
            raw = socket.create_connection((host, int(port)),
                                           timeout=max(0.1, deadline - time.monotonic()))
            sock = client.wrap_socket(raw)
        except Exception as e:  # noqa: BLE001 - the store's timeouts, refused or failed TLS
            raise CommError("tls.connect", self.rank, f"{self._me()} cannot connect to "
                            f"{self.level} {self.peers[j]} ({where}): {why(e)}") from None
        try:
            sock.sendall(HELLO.pack(MAGIC, self.rank, self.rv.token))
            read_into(sock, memoryview(bytearray(1)))
        except OSError as e:
            shut(sock)
            raise CommError("tls.connect", self.rank, f"{self._me()} was refused by "
                            f"{self.level} {self.peers[j]} ({where}): {why(e)}") from None
        sock.settimeout(None)
        self.out[j] = Outbound(sock, f"lowcomm-tls-send-{self.rank}-{j}")
        self.out[j].start()

    def _accept(self, listener, server, deadline: float) -> None:
        """Take connections until every other member's is in (or the deadline, or the
        listener closes); each is shaken hands with on a thread of its own."""
        while len(self.inn) < self.size - 1 and time.monotonic() < deadline:
            try:
                listener.settimeout(max(0.05, min(0.5, deadline - time.monotonic())))
                raw, addr = listener.accept()
            except socket.timeout:
                continue
            except OSError:
                return
            threading.Thread(target=self._admit, args=(raw, addr, server, deadline),
                             daemon=True).start()
        while len(self.inn) < self.size - 1 and time.monotonic() < deadline:
            time.sleep(0.01)                         # the last handshakes still running

    def _admit(self, raw, addr, server, deadline: float) -> None:
        """Shake hands with one incoming connection: keep it as member r's, or refuse it."""
        raw.settimeout(max(0.1, deadline - time.monotonic()))
        try:
            sock = server.wrap_socket(raw, server_side=True)
            hello = bytearray(HELLO.size)
            read_into(sock, memoryview(hello))
        except OSError as e:
            return self._refuse(raw, addr, why(e))
        magic, r, token = HELLO.unpack(hello)
        with self._lock:
            bad = "not a lowcomm member" if magic != MAGIC else \
                "a member of another group" if token != self.rv.token else \
                f"rank {r} of {self.size}" if not 0 <= r < self.size or r == self.rank else \
                f"rank {r} again" if r in self.inn else \
                "the group is closed" if self._closed else None
            if bad is None:
                self.inn[r] = Inbound(sock, f"lowcomm-tls-recv-{self.rank}-{r}")
        if bad is not None:
            return self._refuse(sock, addr, bad)
        try:
            sock.sendall(b"\1")
        except OSError as e:
            with self._lock:
                del self.inn[r]
            return self._refuse(sock, addr, why(e))
        sock.settimeout(None)
        self.inn[r].start()

    def _refuse(self, sock, addr, reason: str) -> None:
        shut(sock)
        self.refused.append(f"{addr[0]}:{addr[1]}: {reason}")
        log.warning("%s refused a connection from %s:%s: %s", self._me(), addr[0], addr[1],
                    reason)

    # the transport -----------------------------------------------------------------------------
    def _post_send(self, flat: torch.Tensor, dest: int, tag: int) -> Op:
        return self.out[dest].post(Op(tag, flat))

    def _post_recv(self, flat: torch.Tensor, source: int, tag: int) -> Op:
        return self.inn[source].post(Op(tag, flat))

    def _wait(self, op: Op, name: str, nbytes: int, peer: int | None) -> None:
        if not op.done.wait(self.timeout_s):
            raise CommError(name, self.rank, f"{self._me()} waited {self.timeout_s:g} s for "
                            f"{self._who(peer)}", nbytes)
        if op.error is not None:
            raise CommError(name, self.rank, f"{self._me()} and {self._who(peer)}: {op.error}",
                            nbytes)

    def close(self) -> None:
        """Close every connection (a thread blocked on one returns; what is in flight fails)."""
        with self._lock:
            self._closed = True
        for link in [*self.out.values(), *self.inn.values()]:
            link.close()


__all__ = ["Rendezvous", "TlsComm", "address_toward"]
