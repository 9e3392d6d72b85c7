"""The cross-datacenter channel of a fleet: one MPI job per datacenter, and between their
leaders (rank 0 of each job) rounds agreed with a coordinator and reduced over a group of the
round's members.

Pieces:

* membership and rounds go through the coordinator's ``torch.distributed.TCPStore`` (the
  c10d store that torchelastic's rendezvous and torchft's lighthouse build on): each leader
  writes its messages under its own keys and reads the coordinator's from its mailbox keys,
  one blocking ``get`` each (the store answers when the key is set), and a thread with its own
  store client heartbeats (:data:`PROTOCOL`);
* the reduction runs over a group of the members the coordinator names, meeting through that
  store and re-created when the group changes: by default TLS 1.3 connections that only
  holders of the fleet's secret open (:class:`~lowcomm.comm.tls.TlsComm`), or with
  ``fleet.transport = "gloo"`` a ``ProcessGroupGloo`` on a ``PrefixStore`` of the store (plain
  TCP, :class:`~lowcomm.comm.gloo.GlooComm`); lowcomm's ring / tree / Rabenseifner run on
  either in the same order as over MPI.

A round (:meth:`Channel.average`): the leader says it is ready (with the round's tag, e.g.
``t40.f0``, the same on every member); the coordinator decides who takes part — the members that
are ready, without those found dead (their job ended, or no heartbeat for the limit), as long as a
quorum remains — and names the group; the members all-reduce; each reports whether its
reduction completed; only when every one did is the round committed (a member that died half-way
through makes the others redo the round without it, from the same contributions: nobody loses an
inner step, nobody applies a partial sum).

A datacenter that comes back (:meth:`Channel.join`) is admitted at the next round boundary in an
admission round (:meth:`Channel.admit`), in which one member (the donor) sends it the live state.

A fenced member (left out while it was silent), a coordinator that is gone or silent, and the end
of the run all raise :class:`FleetError` naming this rank, the op and what happened — never a
hang.
"""
from __future__ import annotations

import datetime
import json
import logging
import threading
import time

import torch

from ...comm.collectives import allreduce_
from ...comm.gloo import GlooComm
from ...comm.p2p import PeerComm
from ...comm.tls import Rendezvous, TlsComm, address_toward
from ...comm.ledger import Ledger
from ...comm.round_tag import RoundTag
from ...errors import CommError
from .store import FleetError, Seat, _Heartbeat, connect, key, store_client
from .trust import Forged, secret_from_env

log = logging.getLogger("lowcomm.fleet")

def _across(name: str, comm: PeerComm, x: torch.Tensor, levels, link) -> str:
    """lowcomm's algorithm for ``name`` between datacenters: ``auto`` decided from the
    members' count and the link, as over the MPI leaders. The vendor's all-reduce (``mpi``)
    has no counterpart between separately launched jobs: the ring runs instead (Open MPI's own
    choice for large messages), as does the hierarchical all-reduce of one rank per
    datacenter."""
    if name != "auto":
        return "ring" if name in ("hierarchical", "mpi") else name
    from ...comm.tuning import Policy
    policy = Policy(comm.size, False, link.alpha_s if link else 25e-3,
                    link.bytes_per_s if link else 12.5e6)
    chosen = policy.choose(x.numel() * x.element_size(),
                           levels if levels is not None and levels.size == comm.size else None)
    return "ring" if chosen in ("hierarchical", "shm", "mpi") else chosen


class _Groups:
    """The data plane of a round: a group over the members a decision names (one per decision's
    ``group``, meeting through the coordinator's store under ``pg/<group>/`` and ``suffix``: the
    leaders' own, or ``rank{i}/`` for rank i of every member, :class:`RankChannel`), created on
    first use and kept while unchanged; a failed group is closed and never reused. Over the
    seat's ``transport``: TLS 1.3 between holders of the fleet's secret
    (:class:`~lowcomm.comm.tls.TlsComm`), or a gloo process group (plain TCP,
    :class:`~lowcomm.comm.gloo.GlooComm`)."""

    def __init__(self, store, seat: Seat, suffix: str = ""):
        self.store, self.seat, self.suffix = store, seat, suffix
        self.dc, self.limits, self.link, self.rank = seat.dc, seat.limits, seat.link, seat.rank
        self._id, self._comm = None, None

    def forget(self) -> None:
        if self._comm is not None:
            self._comm.close()
        self._id = self._comm = None

    def group(self, d: dict, nbytes: int, ledger: Ledger) -> PeerComm:
        members = list(d["members"])
        timeout = self.limits.op_s(nbytes, len(members), self.link)
        if d["group"] != self._id:
            self.forget()
            prefix = key("group", group=d["group"]) + self.suffix
            try:
                self._comm = self._open(prefix, members, timeout)
            except Exception as e:  # noqa: BLE001 - a member gone while the group formed
                raise CommError("fleet.group", self.rank, f"datacenter {self.dc} cannot form "
                                f"the group of {members}: {str(e).splitlines()[0][:300]}") from None
            self._id = d["group"]
        self._comm.ledger, self._comm.timeout_s = ledger, timeout
        return self._comm

    def _open(self, prefix: str, members: list[int], timeout: float) -> PeerComm:
        rank, size = members.index(self.dc), len(members)
        if self.seat.transport == "gloo":
            from torch.distributed import PrefixStore, ProcessGroupGloo
            pg = ProcessGroupGloo(PrefixStore(prefix, self.store), rank, size,
                                  datetime.timedelta(seconds=timeout))
            return GlooComm(pg, level="dc", timeout_s=timeout, peers=members, link=self.link)
        secret, session = secret_from_env()
        rv = Rendezvous(self.store, prefix, rank, size, secret, session.encode(),
                        address_toward(self.store.host))
        return TlsComm(rv, level="dc", timeout_s=timeout, peers=members, link=self.link)

    def gather(self, d: dict, flat: torch.Tensor, ledger: Ledger):
        """(every member's ``flat``, None) or (None, why it failed)."""
        try:
            comm = self.group(d, flat.numel() * flat.element_size() * len(d["members"]), ledger)
            return comm.allgather(flat), None
        except CommError as e:
            self.forget()
            return None, str(e)

    def reduce(self, d: dict, flat: torch.Tensor, algorithm: str, levels, ledger: Ledger):
        """(the average over ``d``'s members, None) or (None, why it failed)."""
        try:
            comm = self.group(d, flat.numel() * flat.element_size(), ledger)
            x = flat.clone()
            allreduce_(x, comm, _across(algorithm, comm, x, levels, self.link), op="avg")
            return x, None
        except CommError as e:
            self.forget()
            return None, str(e)


class Channel:
    """A datacenter's side of the fleet (on its leader; module docstring), at ``seat``
    (:class:`Seat`: its datacenter, incarnation, rank, limits and link); ``connect_s``: how long
    it waits for the coordinator (default the seat's ``limits.limit_s``); ``arrivals``: it
    sends asynchronous DiLoCo's arrivals."""

    rounds = True        # an outer loop reduces through average(), not through a Comm
    per_rank = False     # (a :class:`~lowcomm.comm.roles.Peers`: one leader per datacenter)

    def __init__(self, address: str, seat: Seat, ledger: Ledger | None = None,
                 connect_s: float | None = None, *, arrivals: bool = False):
        host, _, port = address.rpartition(":")
        dc, inc, limits, link, rank = seat.dc, seat.inc, seat.limits, seat.link, seat.rank
        self.dcs, self.arrivals = seat.dcs, arrivals
        self._arrived = 0                     # arrivals sent by this incarnation
        self.donate_to: list[int] = []        # joining datacenters this member hands over to
        self.host, self.port = host, int(port)
        self.dc, self.inc, self.limits, self.link, self.rank = dc, inc, limits, link, rank
        self.ledger = ledger if ledger is not None else Ledger()
        self.store = store_client(address, connect_s or limits.limit_s, dc, rank)
        self.round = 0                        # the next round this member takes part in
        self.members: list[int] = []          # of the last committed round
        self.epoch_rounds: list[dict] = []    # committed decisions (the membership log)
        self._k = self._n = 0                 # messages sent / mailbox messages read
        self.plane = _Groups(self.store, seat)
        self.corrupt = None                   # a fault's Corruptor (fleet/corrupt.py), or None
        # what committed decisions said, from the step of the round's tag on (-1: a round of
        # no step, held by the training thread): a datacenter waits to be admitted (the
        # earliest such step, None when none waits), the fleet halts (step and signal)
        self._admit_from: int | None = None
        self._halt: tuple[int, int] | None = None
        # where this member's time in rounds went: waiting for the others to be ready (and to be
        # admitted), and in rounds from its ready to their commit (the waits included); the
        # part of each spent on a thread that overlapped the steps (a delayed outer loop)
        self.wait_s = self.round_s = 0.0
        self.overlapped = {"wait_s": 0.0, "round_s": 0.0}
        self._ready_t: float | None = None
        self._hb = _Heartbeat(lambda t: connect(self.host, self.port, t),
                              key("heartbeat", dc=dc, inc=inc), limits.heartbeat_s,
                              2 * limits.limit_s)
        self._hb.start()

    # messages -----------------------------------------------------------------------------------
    def send(self, kind: str, **fields) -> None:
        if kind == "ready" and self._ready_t is None:
            self._ready_t = time.monotonic()
        msg = {"type": kind, "dc": self.dc, "inc": self.inc, "t": time.time(), **fields}
        try:
            self.store.set(key("inbox", dc=self.dc, inc=self.inc, k=self._k), json.dumps(msg))
        except Exception as e:  # noqa: BLE001
            raise self._lost_error(f"fleet.{kind}", e) from None
        self._k += 1

    def _lost_error(self, op: str, e: Exception | None = None) -> FleetError:
        why = self._hb.lost or (str(e).splitlines()[0][:200] if e else "no answer")
        return FleetError(op, self.rank, f"datacenter {self.dc} lost the coordinator at "
                          f"{self.host}:{self.port}: {why}; the fleet falls back to its "
                          "checkpoints")

    def receive(self, op: str, wait_s: float | None = None) -> dict:
        """The next message of this member's mailbox; a fence, the run's end or a lost
        coordinator raise :class:`FleetError`."""
        k = key("mailbox", dc=self.dc, inc=self.inc, n=self._n)
        t0 = time.monotonic()
        self.store.set_timeout(datetime.timedelta(seconds=1.0))
        while True:
            try:
                msg = json.loads(self.store.get(k))
                if isinstance(msg, dict) and isinstance(msg.get("type"), str):
                    break
                raise Forged(k)                     # sealed, but no message: not ours
            except Exception as e:  # noqa: BLE001 - a wait timeout: look at the heartbeat
                if isinstance(e, Forged) and not e.again:     # an outsider's: never acted on
                    log.warning("datacenter %d: %s", self.dc, e)
                if self._hb.lost:
                    raise self._lost_error(op) from None
                if wait_s is not None and time.monotonic() - t0 > wait_s:
                    raise FleetError(op, self.rank, f"datacenter {self.dc} waited {wait_s:g} s "
                                     f"for the coordinator ({str(e).splitlines()[0][:120]})") from None
        self._n += 1
        if msg["type"] == "fence":
            raise FleetError(op, self.rank, f"datacenter {self.dc} was left out of the fleet "
                             f"({msg.get('why', 'fenced')}); its job ends and is relaunched")
        if msg["type"] == "over":
            raise FleetError(op, self.rank, f"the fleet's run ended before datacenter {self.dc} "
                             "was admitted")
        return msg

    # rounds -------------------------------------------------------------------------------------
    def dup(self, ledger: Ledger | None = None) -> "Channel":
        """This channel, its data plane charged to ``ledger`` (one channel per member)."""
        if ledger is not None:
            self.ledger = ledger
        return self

    def average(self, flat: torch.Tensor, tag: RoundTag, algorithm: str = "ring",
                levels=None) -> torch.Tensor:
        """The average of ``flat`` over the members of round ``tag`` (module docstring): a
        fresh tensor, equal on every member. ``algorithm``: lowcomm's (``auto`` decided as over
        MPI)."""
        flat = self.corrupt(flat, tag) if self.corrupt is not None else flat
        return self.round_of("fleet.average", lambda d: self._reduce(d, flat, algorithm, levels),
                             ready={"tag": tag, "numel": flat.numel()})[1]

    def gather(self, flat: torch.Tensor, tag: RoundTag) -> tuple[torch.Tensor, list[int]]:
        """Every member's ``flat`` of round ``tag`` (rows in the members' order, a ring
        all-gather over the group) and the members: what a robust rule aggregates."""
        flat = self.corrupt(flat, tag) if self.corrupt is not None else flat
        d, rows = self.round_of("fleet.gather", lambda d: self.plane.gather(d, flat, self.ledger),
                                ready={"tag": tag, "numel": flat.numel()})
        return rows, list(d["members"])

    def round_of(self, op: str, work, ready: dict | None = None):
        """The fleet's one round: say ready (with ``ready``'s fields, its ``tag`` a
        :class:`~lowcomm.comm.round_tag.RoundTag`; not for a joiner, which the coordinator
        admits), then for each decision of this round — an attempt — run
        ``work(decision)`` (result, or None and why it failed) and report it done, until an
        attempt is committed; returns (the committed decision, its result). Every kind of round
        (an average, an admission, a join, a sharded average's leader) is this loop."""
        if ready is not None:
            if not isinstance(ready["tag"], RoundTag):
                raise TypeError(f"{op}: a round's tag is a RoundTag, got {ready['tag']!r}")
            self.send("ready", round=self.round, **{**ready, "tag": str(ready["tag"])})
        while True:
            d = self._decision(op)
            if d["type"] == "late":                  # it went ahead without this member
                self.round = d["round"] + 1
                if self._ready_t is not None:
                    self._spent("round_s", time.monotonic() - self._ready_t)
                    self._ready_t = None
                return d, None
            result, err = work(d)
            self.send("done", round=d["round"], attempt=d["attempt"], ok=err is None, error=err)
            if self._committed(d, err):
                return d, result

    def _decision(self, op: str) -> dict:
        """The coordinator's next decision, or its word that this member's round went ahead
        without it (``late``: a quorum and its grace window); the time waited for it is
        :attr:`wait_s`."""
        t0 = time.monotonic()
        try:
            while True:
                m = self.receive(op)
                if m["type"] in ("decision", "late"):
                    return m
        finally:
            self._spent("wait_s", time.monotonic() - t0)

    def _spent(self, what: str, seconds: float) -> None:
        setattr(self, what, getattr(self, what) + seconds)
        if threading.current_thread() is not threading.main_thread():
            self.overlapped[what] += seconds

    def _committed(self, d: dict, err) -> bool:
        o = self.receive("fleet.commit")
        while o["type"] != "outcome":
            o = self.receive("fleet.commit")
        if not o["commit"]:
            return False
        if err is not None:       # cannot happen: the coordinator commits only all-complete rounds
            raise FleetError("fleet.commit", self.rank, f"round {d['round']} committed although "
                             f"datacenter {self.dc}'s reduction failed: {err}")
        self.round, self.members = d["round"] + 1, list(d["members"])
        if self._ready_t is not None:
            self._spent("round_s", time.monotonic() - self._ready_t)
            self._ready_t = None
        step = RoundTag.parse(d["tag"]).step
        step = -1 if step is None else step
        if d.get("admit_next"):
            self._admit_from = step if self._admit_from is None else min(self._admit_from, step)
        if d.get("halt") and (self._halt is None or step < self._halt[0]):
            self._halt = (step, int(d["halt"]))
        self.epoch_rounds.append({k: d[k] for k in ("round", "tag", "members", "attempt")})
        return True

    def _reduce(self, d: dict, flat: torch.Tensor, algorithm: str, levels):
        """(the average, None) or (None, why it failed) for decision ``d``."""
        return self.plane.reduce(d, flat, algorithm, levels, self.ledger)

    def group(self, d: dict, nbytes: int) -> PeerComm:
        """The group decision ``d`` names (created on first use, kept while unchanged)."""
        return self.plane.group(d, nbytes, self.ledger)

    # admission ----------------------------------------------------------------------------------
    def admission_due(self, through: int | None = None) -> bool:
        """Whether a datacenter waits to be admitted at this round boundary, by the committed
        rounds sent at inner step ``through`` or earlier (None: every committed round). Every
        member reads the same decisions, so they agree — also while a delayed outer loop's
        round is in flight on a thread: it is counted from the boundary after it landed."""
        at = self._admit_from
        return at is not None and (through is None or at <= through)

    def halted_by(self, through: int | None = None) -> int:
        """The signal the fleet was stopped by, as the committed rounds sent at inner step
        ``through`` or earlier said (0: none); see :meth:`admission_due`."""
        if self._halt is None or through is not None and self._halt[0] > through:
            return 0
        return self._halt[1]

    @property
    def halted(self) -> int:
        """The signal the fleet was stopped by, as any committed round said (0: none)."""
        return self.halted_by()

    def admit(self, step: int, state, ledger: Ledger | None = None) -> list[int]:
        """The admission round at boundary ``step``: the donor sends ``state()`` (bytes) to
        each datacenter admitted; returns the admitted ones."""
        made = []                                    # the donor's state, made once

        def donate(d: dict):
            try:
                comm = self.group(d, 0)
                if d["joiners"] and d["donor"] == self.dc:
                    made[:] = made or [state()]
                    self._send_state(comm, d, made[0], ledger or self.ledger, d["joiners"])
                return None, None
            except CommError as e:
                self.plane.forget()
                return None, str(e)
        d, _ = self.round_of("fleet.admit", donate,
                             ready={"tag": RoundTag.admit(step), "numel": 0, "admit": True})
        self._admit_from = None                      # held
        return list(d["joiners"])

    def _send_state(self, comm: PeerComm, d: dict, payload: bytes, ledger: Ledger,
                    to: list[int], op: str = "heal") -> None:
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
        size = torch.tensor([data.numel()], dtype=torch.int64)
        t0 = time.perf_counter()
        for j in to:
            peer = d["members"].index(j)
            comm.send(size, peer)
            comm.send(data, peer)
        ledger.record(op, "dc", (data.numel() + 8) * len(to), 0, time.perf_counter() - t0)

    def join(self, ledger: Ledger | None = None) -> dict:
        """This relaunched datacenter's way back in: wait to be admitted (at most
        ``limits.join_s``), take the donor's state; returns ``{"payload", "step", "round",
        "bytes", "wait_s", "transfer_s"}``."""
        t0, t1 = time.monotonic(), [0.0]
        if self.arrivals:                            # the donor's state through the store
            m = self.receive("fleet.join")
            while m["type"] != "admitted":
                m = self.receive("fleet.join")
            t1[0] = time.monotonic()
            payload = self.store.get(m["key"])
            self.store.delete_key(m["key"])
            (ledger or self.ledger).record("heal", "dc", 0, len(payload), time.monotonic() - t1[0])
            return {"payload": payload, "step": m["step"], "round": 0, "bytes": len(payload),
                    "wait_s": t1[0] - t0, "transfer_s": time.monotonic() - t1[0]}

        def take(d: dict):
            t1[0] = time.monotonic()
            try:
                return self._take_state(self.group(d, 0), d, ledger or self.ledger), None
            except CommError as e:
                self.plane.forget()
                return None, str(e)
        d, payload = self.round_of("fleet.join", take)
        return {"payload": payload, "step": RoundTag.parse(d["tag"]).step, "round": d["round"],
                "bytes": len(payload), "wait_s": t1[0] - t0, "transfer_s": time.monotonic() - t1[0]}

    def _take_state(self, comm: PeerComm, d: dict, ledger: Ledger, op: str = "heal") -> bytes:
        donor = d["members"].index(d["donor"])
        size = torch.zeros(1, dtype=torch.int64)
        comm.recv_(size, donor)
        data = torch.empty(int(size.item()), dtype=torch.uint8)
        t0 = time.perf_counter()
        comm.recv_(data, donor)
        ledger.record(op, "dc", 0, data.numel() + 8, time.perf_counter() - t0)
        return data.numpy().tobytes()

    # a round that may go ahead without a late member --------------------------------------------
    def contribute(self, payload, tag: RoundTag, steps: int, state, algorithm: str = "ring",
                   levels=None, carried: bool = False):
        """This member's part of a round under a quorum (:mod:`~lowcomm.run.fleet.membership`):
        ``payload(catching_up, corrector)`` is the tensor it adds to the round's average, given
        the steps each member catching up carries and whether this member is the round's
        ``donor`` (who adds their correction); ``carried``: this member's steps go back to an
        older outer state (it was late, maybe before a restart); ``state()`` the bytes of its outer state, which
        the donor hands to each member catching up. Returns ("late", None, None) when the round
        went ahead without this member, else ("average", the average, the donor's state bytes
        where this member catches up, else None)."""
        def work(d: dict):
            catching = {int(k): v for k, v in d.get("catching_up", {}).items()}
            flat = payload(catching, d["donor"] == self.dc)
            avg, err = self.plane.reduce(d, flat, algorithm, levels, self.ledger)
            if err is not None or not catching:
                return (avg, None), err
            try:
                comm = self.group(d, 0)
                if d["donor"] == self.dc:
                    self._send_state(comm, d, state(), self.ledger, sorted(catching), "catch-up")
                    return (avg, None), None
                if self.dc in catching:
                    return (avg, self._take_state(comm, d, self.ledger, "catch-up")), None
                return (avg, None), None
            except CommError as e:
                self.plane.forget()
                return None, str(e)
        d, result = self.round_of("fleet.average", work,
                                  ready={"tag": tag, "numel": 0, "steps": steps,
                                         "carried": carried})
        if d["type"] == "late":
            return "late", None, None
        return "average", *result

    # asynchronous DiLoCo: arrivals at the coordinator's server ------------------------------------
    def arrive(self, delta: torch.Tensor | None, base: torch.Tensor, buffers: torch.Tensor,
               **fields) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Hand this member's pseudo-gradient ``delta`` (None: none) and floating buffers to the
        arrival server (:mod:`~lowcomm.run.fleet.server`) and take θ and the members' mean
        buffers back, with the coordinator's answer (speeds, ``halt``, ``donate``). The first
        arrival of an incarnation also carries ``base``, the θ it started from (the server's θ
        where it has none). ``fields``: ``step``, ``period``, ``steps``, ``speed``, ``final``
        (a final arrival is answered once every member's is in: the time until then is
        waiting). Charged to the ledger as ``arrival``."""
        n, first = self._arrived, self._arrived == 0
        parts = ([base] if first else []) + ([] if delta is None else [delta]) + [buffers]
        data = torch.cat([p.reshape(-1).to(torch.float32) for p in parts]).numpy().tobytes()
        t0 = time.monotonic()
        try:
            self.store.set(key("arrival", dc=self.dc, inc=self.inc, n=n), data)
        except Exception as e:  # noqa: BLE001
            raise self._lost_error("fleet.arrive", e) from None
        self._arrived += 1
        self.send("arrive", n=n, numel=base.numel(), base=first, empty=delta is None, **fields)
        m = self.receive("fleet.arrive")
        while m["type"] != "arrived" or m["n"] != n:
            m = self.receive("fleet.arrive")
        name = key("theta", dc=self.dc, inc=self.inc, n=n)
        try:
            x = torch.frombuffer(bytearray(self.store.get(name)), dtype=torch.float32)
            self.store.delete_key(name)
        except Exception as e:  # noqa: BLE001 - the coordinator went away after answering
            raise self._lost_error("fleet.arrive", e) from None
        seconds = time.monotonic() - t0
        self.ledger.record("arrival", "dc", len(data), x.numel() * 4, seconds)
        self._spent("round_s", seconds)
        if fields.get("final"):
            self._spent("wait_s", seconds)
        if m.get("halt") and (self._halt is None or m["halt"][0] < self._halt[0]):
            self._halt = (int(m["halt"][0]), int(m["halt"][1]))
        # kept until donated: with τ > 0 the next arrival may be answered before the boundary
        self.donate_to += [j for j in m.get("donate") or [] if j not in self.donate_to]
        self.round = int(m["arrivals"])
        return x[:base.numel()], x[base.numel():], m

    def donate(self, step: int, payload: bytes, ledger: Ledger | None = None) -> list[int]:
        """Hand this member's live state (taken at the boundary of inner step ``step``) to the
        joining datacenters its last arrival named; returns them."""
        to, self.donate_to = self.donate_to, []
        if not to:
            return []
        for j in to:                                 # a key each: each joiner deletes its own
            name = key("state", dc=j, donor=f"{self.dc}.{self.inc}", step=step)
            t0 = time.monotonic()
            self.store.set(name, payload)
            (ledger or self.ledger).record("heal", "dc", len(payload), 0, time.monotonic() - t0)
            self.send("donated", to=[j], key=name, step=step, bytes=len(payload))
        return to

    def close(self, reason: str = "finished") -> None:
        """Tell the coordinator this member is done (best effort) and stop heartbeating. The
        heartbeat thread is joined (its store call times out within 4 heartbeats): a daemon
        thread still inside a store call when the interpreter exits aborts the process."""
        try:
            if not self._hb.lost:
                self.send("bye", reason=reason)
        except FleetError:
            pass
        self.plane.forget()
        self._hb.stop.set()
        if self._hb.is_alive() and self._hb is not threading.current_thread():
            self._hb.join(timeout=max(1.0, self._hb.heartbeat_s * 4) * 2 + 1)


__all__ = ["Channel"]
