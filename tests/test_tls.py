"""TLS between a fleet's datacenters (lowcomm.comm.tls): members on threads over loopback. The
same algorithm sums bit for bit as over gloo; only holders of the group's secret connect; a
plain-TCP client is refused without stopping the group; bytes changed in flight fail the call,
never reach the sum. (A live fleet over TLS, equal to one MPI job: tests/test_fleet.py.)"""
import datetime
import socket
import threading

import pytest
import torch
from torch.distributed import HashStore, PrefixStore, ProcessGroupGloo

from lowcomm.comm.collectives import allreduce_
from lowcomm.comm.gloo import GlooComm
from lowcomm.comm.tls import Rendezvous, TlsComm
from lowcomm.errors import CommError

SECRET = bytes(range(32))


def together(n: int, member) -> list:
    """``member(r)`` for r < n on threads: each one's result, or the exception it raised."""
    out = [None] * n

    def run(r):
        try:
            out[r] = member(r)
        except Exception as e:  # noqa: BLE001 - handed to the test
            out[r] = e
    threads = [threading.Thread(target=run, args=(r,)) for r in range(n)]
    [t.start() for t in threads]
    [t.join(60) for t in threads]
    return out


def tls(store, r: int, n: int, secret: bytes = SECRET, timeout_s: float = 20.0) -> TlsComm:
    return TlsComm(Rendezvous(store, "pg/g/", r, n, secret), timeout_s=timeout_s)


def reduced(comm, x: torch.Tensor) -> dict:
    out = {}
    for algorithm in ("ring", "rabenseifner"):
        y = x.clone()
        allreduce_(y, comm, algorithm, op="avg")
        out[algorithm] = y
    out["gathered"] = comm.allgather(x[:5])
    comm.close()
    return out


def test_the_same_algorithm_sums_bit_for_bit_over_tls_as_over_gloo():
    xs = [torch.randn(100_003, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    tls_store, gloo_store = HashStore(), HashStore()
    over_tls = together(3, lambda r: reduced(tls(tls_store, r, 3), xs[r]))
    over_gloo = together(3, lambda r: reduced(GlooComm(ProcessGroupGloo(
        PrefixStore("gloo/", gloo_store), r, 3, datetime.timedelta(seconds=20))), xs[r]))
    for r in range(3):
        for what in ("ring", "rabenseifner", "gathered"):
            assert torch.equal(over_tls[r][what], over_gloo[r][what]), (r, what)
        assert torch.equal(over_tls[r]["ring"], over_tls[0]["ring"])
    assert torch.allclose(over_tls[0]["ring"], sum(xs) / 3, atol=1e-6)
    assert torch.equal(over_tls[1]["gathered"], torch.stack([x[:5] for x in xs]))


def test_a_member_without_the_secret_is_refused_by_name_and_reason():
    """Whichever of the two fails first says why (the other may only see the connection
    it was shaking hands on go away); both name both."""
    store = HashStore()
    out = together(2, lambda r: tls(store, r, 2, SECRET if r == 0 else bytes(32), 3.0))
    assert all(isinstance(e, CommError) and "dc 0" in str(e) and "dc 1" in str(e) for e in out)
    assert any("the two do not hold the same secret" in str(e) for e in out), out


class Outsider(HashStore):
    """A store through which the outsider sees member 0's address and, before member 1 reads
    it, connects there over plain TCP and sends what a member would say, then a frame."""

    done = False

    def get(self, key):
        value = super().get(key)
        if key == "pg/g/tls/0" and not self.done:
            self.done = True
            host, _, port = value.decode().rpartition(":")
            with socket.create_connection((host, int(port))) as s:
                s.sendall(b"lowcomm1" + bytes(20) + bytes(16) + b"\xff" * 64)
                try:
                    answer = s.recv(1)
                except ConnectionResetError:
                    answer = b""
                assert answer == b"", "a plain-TCP client gets no answer"
        return value


def test_a_plain_tcp_client_is_refused_and_the_group_forms_and_sums_without_it():
    store, xs = Outsider(), [torch.full((8,), float(r + 1)) for r in range(2)]
    out = together(2, lambda r: (lambda c: (c.refused, reduced(c, xs[r])))(tls(store, r, 2)))
    assert store.done and len(out[0][0]) == 1 and not out[1][0], out
    for r in range(2):
        assert torch.equal(out[r][1]["ring"], torch.full((8,), 1.5))


class Tamper(threading.Thread):
    """A relay to ``target`` that flips one byte of what it carries after ``after`` bytes."""

    def __init__(self, target: str, after: int):
        super().__init__(daemon=True)
        self.target, self.after = target, after
        self.server = socket.create_server(("127.0.0.1", 0))

    def run(self):
        a, _ = self.server.accept()
        host, _, port = self.target.rpartition(":")
        b = socket.create_connection((host, int(port)))
        threading.Thread(target=self.pipe, args=(b, a, None), daemon=True).start()
        self.pipe(a, b, self.after)

    @staticmethod
    def pipe(src, dst, after):
        seen = 0
        with src, dst:
            while data := src.recv(65536):
                if after is not None and seen <= after < seen + len(data):
                    data = bytearray(data)
                    data[after - seen] ^= 1
                seen += len(data)
                try:
                    dst.sendall(data)
                except OSError:
                    return


def test_bytes_changed_in_flight_fail_the_call_and_never_reach_the_sum():
    class Relayed(HashStore):              # member 0 reaches member 1 through the relay
        def get(self, key):
            value = super().get(key)
            if key == "pg/g/tls/1":
                relay = Tamper(value.decode(), 8_000)
                relay.start()
                return f"127.0.0.1:{relay.server.getsockname()[1]}".encode()
            return value

    store = Relayed()

    def member(r):
        comm = tls(store, r, 2, timeout_s=10.0)
        x = torch.ones(4096)
        try:
            allreduce_(x, comm, "ring", op="sum")
        finally:
            comm.close()
        return x
    out = together(2, member)
    assert isinstance(out[1], CommError), out[1]
    assert "TLS error" in str(out[1]) and "dc 0" in str(out[1])
    assert isinstance(out[0], CommError), "the sender learns its peer's call failed"


def test_a_bad_transport_is_an_error_naming_the_setting():
    from lowcomm.errors import ConfigError
    from lowcomm.run.config import FleetConfig
    with pytest.raises(ConfigError, match="fleet.transport.*'udp'.*tls, gloo"):
        FleetConfig(dcs=2, transport="udp").validate()
