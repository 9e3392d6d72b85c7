"""The coordinator's store as a fleet's members and coordinator reach it: its keys
(:data:`PROTOCOL`), a sealed client (:func:`connect`, :mod:`~lowcomm.run.fleet.trust`), the
limits a fleet waits by, a member's seat, and the heartbeat thread; the rounds over it are
:mod:`~lowcomm.run.fleet.channel`'s."""
from __future__ import annotations

import datetime
import threading
import time
from dataclasses import dataclass, field

from ...comm.watchdog import predict
from ...errors import CommError
from .trust import Seal, SealedStore

#: the store's keys: member -> coordinator messages, coordinator -> member mailbox, heartbeats,
#: the coordinator's own heartbeat, the round groups' rendezvous prefixes, and the tensors of
#: asynchronous DiLoCo's arrivals (float32 bytes; each deleted once read)
PROTOCOL = {"inbox": "in/{dc}/{inc}/{k}", "mailbox": "out/{dc}/{inc}/{n}",
            "heartbeat": "hb/{dc}/{inc}", "coordinator": "coord/hb", "group": "pg/{group}/",
            # asynchronous DiLoCo: an arrival's tensors, the server's answer, a donor's state
            "arrival": "arr/{dc}/{inc}/{n}", "theta": "theta/{dc}/{inc}/{n}",
            "state": "state/{dc}/{donor}/{step}"}


def key(kind: str, **parts) -> str:
    return PROTOCOL[kind].format(**parts)


class FleetError(CommError):
    """This datacenter cannot go on in the fleet: it was fenced (left out while it was silent),
    the coordinator is gone, or the run ended before it was admitted."""


@dataclass
class Limits:
    """How long a fleet waits: ``heartbeat_s`` between heartbeats; ``limit_s``, after which the
    coordinator counts a silent datacenter out (2 heartbeats, ``factor`` × a round trip on the
    cross-datacenter ``link``, and the link's outage allowance — the α–β model, as the watchdog's
    limits); a member gives the coordinator twice that; ``join_s`` is how long a relaunched
    datacenter waits to be admitted (its link may still be down)."""
    heartbeat_s: float = 0.5
    limit_s: float = 30.0
    join_s: float = 600.0
    factor: float = 10.0

    @classmethod
    def of(cls, link, heartbeat_s: float, factor: float, outage_s: float,
           join_s: float = 600.0) -> "Limits":
        rtt = 2 * link.alpha_s if link is not None else 0.0
        return cls(heartbeat_s, 2 * heartbeat_s + factor * rtt + outage_s, join_s, factor)

    def op_s(self, nbytes: int, size: int, link) -> float:
        """The longest a round group's call of ``nbytes`` among ``size`` members may wait."""
        extra = self.factor * predict("allreduce.ring", nbytes, size, link) if link else 0.0
        return self.limit_s + extra


@dataclass(frozen=True)
class Seat:
    """Where a fleet member sits: datacenter ``dc`` of the fleet's ``dcs``, this job's
    incarnation ``inc`` (0 for the first launch, one more for each relaunch), ``rank`` (the
    world rank named in errors), the fleet's :class:`Limits` and ``link`` (the cross-datacenter
    links' α–β model, or None), and the ``transport`` of the rounds' traffic (``fleet.transport``:
    ``"tls"`` or ``"gloo"``)."""
    dc: int
    dcs: int
    limits: Limits = field(default_factory=Limits)
    inc: int = 0
    rank: int = 0
    link: object = None
    transport: str = "tls"


def connect(host: str, port: int, timeout_s: float) -> SealedStore:
    """A client of the coordinator's store, every value sealed with the fleet's key
    (:mod:`~lowcomm.run.fleet.trust`)."""
    from torch.distributed import TCPStore
    return SealedStore(TCPStore(host, port, is_master=False, wait_for_workers=False,
                                timeout=datetime.timedelta(seconds=timeout_s)),
                       Seal.from_env(), host)


def store_client(address: str, within_s: float, dc: int, rank: int):
    """A client of the coordinator's store at ``address`` (host:port); a coordinator out of
    reach (its link may be down) is tried again until ``within_s`` have passed, then a
    :class:`FleetError` naming datacenter ``dc`` and ``rank``."""
    host, _, port = address.rpartition(":")
    t0 = time.monotonic()
    while True:
        try:
            store = connect(host, int(port), max(2.0, min(10.0, within_s)))
            break
        except Exception as e:  # noqa: BLE001 - a refused or timed-out connect: try again
            if time.monotonic() - t0 > within_s:
                raise FleetError("fleet.connect", rank, f"datacenter {dc} cannot reach the "
                                 f"coordinator at {host}:{port} within {within_s:g} s: "
                                 f"{str(e).splitlines()[0][:200]}") from None
            time.sleep(0.5)
    authenticate(store, f"{host}:{port}", dc, rank)
    return store


def authenticate(store: SealedStore, address: str, dc: int, rank: int) -> None:
    """Fail at once when the coordinator at ``address`` does not hold this member's secret:
    its heartbeat (written within half a heartbeat of its start) does not open here."""
    try:
        store.wait([key("coordinator")], datetime.timedelta(seconds=10))
    except Exception:  # noqa: BLE001 - no heartbeat yet: the channel's own limits decide
        return
    if store.counted(key("coordinator")) is None:
        raise FleetError("fleet.connect", rank, f"datacenter {dc}: authentication failed "
                         f"with the coordinator at {address} (its values do not open with "
                         "this member's fleet secret: the secret differs)")


class _Heartbeat(threading.Thread):
    """Counts this member's heartbeat up every ``heartbeat_s`` on its own store client and
    watches the coordinator's: ``lost`` says why the coordinator is out of reach (gone, or
    silent for ``silent_s``)."""

    def __init__(self, connect, hb_key: str, heartbeat_s: float, silent_s: float):
        super().__init__(name="lowcomm-fleet-heartbeat", daemon=True)
        self.connect, self.hb_key = connect, hb_key
        self.heartbeat_s, self.silent_s = heartbeat_s, silent_s
        self.lost: str | None = None
        self.stop = threading.Event()

    def run(self) -> None:
        store, seen, last, beat = None, 0, time.monotonic(), 0
        while not self.stop.wait(self.heartbeat_s):
            try:
                store = store or self.connect(max(1.0, self.heartbeat_s * 4))
                beat += 1
                store.count(self.hb_key, beat)
                theirs = store.counted(key("coordinator"))
            except Exception as e:  # noqa: BLE001 - the store's errors: reconnect next time
                store = None
                if "closed" in str(e) or "refused" in str(e).lower():
                    self.lost = f"the coordinator is gone ({str(e).splitlines()[0][:120]})"
                    return
                theirs = seen
            if theirs is not None and theirs > seen:       # an older value is a replay
                seen, last = theirs, time.monotonic()
            elif time.monotonic() - last > self.silent_s:
                self.lost = f"no word from the coordinator for {self.silent_s:.3g} s"
                return


__all__ = ["FleetError", "Limits", "PROTOCOL", "Seat", "connect", "key", "store_client"]
