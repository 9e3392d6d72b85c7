"""GlooComm: a :class:`~lowcomm.comm.p2p.PeerComm` over a torch gloo process group (plain TCP),
for a fleet whose datacenters trust the network between them (``fleet.transport = "gloo"``;
the default is TLS, :class:`~lowcomm.comm.tls.TlsComm`).

A fleet of datacenters (:mod:`lowcomm.run.fleet`) runs one MPI job per datacenter; between
them there is no MPI communicator, so the outer level's reduction runs over a group that the
datacenters' leaders re-create whenever the membership changes (here torch's
``ProcessGroupGloo`` on a ``PrefixStore`` of the coordinator's ``TCPStore``, as torchelastic and
torchft rendezvous). ``mpi`` (the vendor all-reduce) has no counterpart between separately
launched jobs: the channel runs the ring instead (:func:`lowcomm.run.fleet.channel._across`).
"""
from __future__ import annotations

import datetime

import torch

from ..errors import CommError
from .ledger import Ledger
from .p2p import PeerComm, PeerRequest

GlooRequest = PeerRequest


class GlooComm(PeerComm):
    """A communicator of the ranks of the gloo process group ``pg`` (its size and this one's rank
    are the group's; module docstring)."""

    def __init__(self, pg, ledger: Ledger | None = None, level: str = "dc",
                 timeout_s: float = 60.0, peers: list | None = None, link=None):
        super().__init__(pg.rank(), pg.size(), ledger, level, timeout_s, peers, link)
        self.pg = pg

    def _post_send(self, flat: torch.Tensor, dest: int, tag: int):
        return self.pg.send([flat], dest, tag)

    def _post_recv(self, flat: torch.Tensor, source: int, tag: int):
        return self.pg.recv([flat], source, tag)

    def _wait(self, work, op: str, nbytes: int, peer: int | None) -> None:
        who = self._who(peer)
        try:
            ok = work.wait(datetime.timedelta(seconds=self.timeout_s))
        except RuntimeError as e:
            raise CommError(op, self.rank, f"{self.level} {self.peers[self.rank]} waiting for "
                            f"{who}: {str(e).splitlines()[0][:300]}", nbytes) from None
        if ok is False:
            raise CommError(op, self.rank, f"{self.level} {self.peers[self.rank]} waited "
                            f"{self.timeout_s:g} s for {who}", nbytes)


__all__ = ["GlooComm", "GlooRequest"]
