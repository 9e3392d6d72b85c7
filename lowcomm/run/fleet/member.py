"""One datacenter's job in a fleet (:mod:`lowcomm.run.fleet`): the run as usual inside the
datacenter, its outer level across datacenters through the fleet's channel.

The fleet starts each datacenter's MPI job with its identity in the environment
(:data:`~lowcomm.run.fleet.plan.ENV`). Here, on every rank of that job, the run in the form a
fleet runs it (:func:`~lowcomm.run.fleet.plan.plan`), then:

* :class:`FleetLevels`: the topology's communicators as this datacenter sees them: its own
  ranks (MPI) for the levels inside, the fleet's :class:`~lowcomm.run.fleet.channel.Channel`
  (on the datacenter's rank 0) as its peers across;
* :class:`FleetLockstep`: the loop's coordination with the batches of the rank's place in the
  whole fleet; a relaunched datacenter first waits to be admitted and takes the live state from
  a peer (no checkpoint is read) and starts at the step it was admitted at; at every round
  boundary the leader holds the admission round when a datacenter waits to come back (under
  asynchronous DiLoCo it hands its state over where its last arrival named a joiner); a round
  that says the fleet halts makes the leader vote to stop (a checkpoint, every datacenter at
  the same step).
"""
from __future__ import annotations

import io
import logging
import time
from pathlib import Path

import torch

from ...comm.roles import LevelSet
from ...comm.topology import Topology
from ...errors import ConfigError
from ...strategies.method import Context
from ...strategies.ownership import adopt
from .. import outcome
from ..lockstep import Lockstep
from ..signals import Interrupted
from .channel import Channel
from .store import Seat, store_client
from .corrupt import Corruptor
from .ranks import RankChannel, Span
from .plan import FleetPlan, plan

log = logging.getLogger("lowcomm.fleet")


class FleetLevels(LevelSet):
    """The topology's communicators as datacenter ``dc`` sees them (module docstring): the
    levels inside over ``inside`` (this job's world), the ``dc`` level's peers = ``channel``
    (None off the leader). Names, size and links are the whole topology's, so that every
    choice made from them (``auto`` algorithms) is the one a single MPI job makes. A
    :class:`~lowcomm.comm.roles.LevelSet`."""

    def __init__(self, topology: Topology, inside, channel: Channel | None, dc: int,
                 whole: Span | None = None, ranked=None):
        self.topology, self.world, self.channel, self.whole = topology, inside, channel, whole
        self._ranked, self._rank_channel = ranked, None
        names = topology.names
        inside.link = topology.link(names[1])
        self._inner = None
        if len(names) > 2:
            paths = [p[1:] for p in topology.paths if p[0] == topology.units("dc")[dc][0]]
            self._inner = Topology(names[1:], paths, topology.links, "fleet").comms(inside)

    hierarchy = None

    def group(self, level: str):
        if level == self.names[0]:
            return self.world
        return self._inner.group(level)

    def peers(self, level: str):
        if level == self.names[0]:
            return self.channel
        return self._inner.peers(level) if self._inner is not None else self.world

    @property
    def rank_channel(self) -> RankChannel | None:
        """The per-rank channel, where an outer loop over a sharded level made one."""
        return self._rank_channel

    def rank_peers(self, level: str):
        """Rank i of every datacenter at the ``dc`` level (an outer loop over a sharded level
        below: :class:`~lowcomm.run.fleet.ranks.RankChannel`, made on first use, on every rank of
        the datacenter together); :meth:`peers` below it."""
        if level != self.names[0]:
            return self.peers(level)
        if self._rank_channel is None:
            if self._ranked is None:
                raise ConfigError("policy", "this fleet's levels have no per-rank channel")
            self._rank_channel = self._ranked()
        return self._rank_channel

    def dup(self, ledger=None) -> "FleetLevels":
        return self


def connect(fp: FleetPlan, comm, me: dict) -> Channel | None:
    """The fleet's channel on the datacenter's leader (rank 0), None on its other ranks."""
    if comm.rank != 0:
        return None
    cfg = fp.cfg
    seat = Seat(me["dc"], cfg.fleet.dcs, fp.limits(), me["inc"], me["offset"], fp.link,
                cfg.fleet.transport)
    return Channel(me["address"], seat, connect_s=cfg.fleet.join_s if me["join"] else None,
                   arrivals=fp.arrivals)


def levels(fp: FleetPlan, comm, channel: Channel | None, me: dict) -> FleetLevels:
    """The topology's communicators of this datacenter, with the span of the whole fleet (what
    the outer loop averages the last partial period and the buffers over)."""
    whole = Span(comm, channel, me["total"], me["offset"] + comm.rank, fp.cfg.fleet.quorum > 0,
                 fp.arrivals)

    def ranked() -> RankChannel:
        limits, rank = fp.limits(), me["offset"] + comm.rank
        store = channel.store if channel is not None else \
            store_client(me["address"], fp.cfg.fleet.join_s if me["join"] else limits.limit_s,
                         me["dc"], rank)
        return RankChannel(comm, channel, store,
                           Seat(me["dc"], fp.cfg.fleet.dcs, limits, me["inc"], rank, fp.link,
                                fp.cfg.fleet.transport))
    return FleetLevels(fp.topology, comm, channel, me["dc"], whole, ranked)


def run(cfg, task, comm, me: dict, opts) -> dict:
    """Train this datacenter's part of the fleet (module docstring), written and resumed as
    ``opts`` (:class:`~lowcomm.run.folder.RunOptions`) says; its summary."""
    from ..config import apply_comm_settings
    from ..loop import run as run_loop
    from ..registry import build_strategy
    fp = plan(cfg, cfg.fleet.dcs, me["total"])
    cfg = fp.cfg
    apply_comm_settings(cfg, comm)
    channel = connect(fp, comm, me)
    if channel is not None and opts.out is not None:     # lowcomm fault corrupt, from OUT
        channel.corrupt = Corruptor(Path(opts.out).parent, me["dc"])
    lv = levels(fp, comm, channel, me)
    build = lambda m, o, c, **kw: build_strategy(cfg, m, o, c, Context(levels=lv, **kw))  # noqa: E731
    return run_loop(cfg, task, build, comm, opts, coordination=lambda r: FleetLockstep(r, me, channel, lv))


def payload(r) -> bytes:
    """The live state a donor hands a rejoining datacenter: model and method state."""
    buf = io.BytesIO()
    torch.save({"model": r.strategy.model_state_dict(), "strategy": r.strategy.state_dict()}, buf)
    return buf.getvalue()


def bundle(parts: list[bytes]) -> bytes:
    """A datacenter's per-rank states (sharded outer state: each rank holds its range) as one
    payload, rank i's at ``i``; :func:`install` on rank i takes its own."""
    buf = io.BytesIO()
    torch.save({"per_rank": [torch.frombuffer(bytearray(p), dtype=torch.uint8) for p in parts]}, buf)
    return buf.getvalue()


def install(r, data: bytes, reset_inner: bool) -> None:
    """Take a donor's state: its model and method state (the inner optimizer's too, unless
    ``reset_inner``), then the model set to the live outer parameters (the method's
    ``joined``: a round in flight, the donor's, keeps only this member's progress). A
    :func:`bundle` gives each rank the donor's rank of the same index (the datacenters have as
    many ranks)."""
    state = torch.load(io.BytesIO(data), weights_only=True)
    if "per_rank" in state:
        parts = state["per_rank"]
        if len(parts) != r.comm.size:
            raise ConfigError("fleet", f"the donor datacenter has {len(parts)} ranks, this one "
                              f"{r.comm.size}: a sharded outer state moves rank to rank")
        state = torch.load(io.BytesIO(parts[r.comm.rank].numpy().tobytes()), weights_only=True)
    r.strategy.load_model_state_dict(state["model"])
    s = state["strategy"]
    if reset_inner:
        s = dict(s, optimizer=r.strategy.optimizer.state_dict())
    r.strategy.load_state_dict(adopt(s))        # the donor's, another rank's on purpose
    r.strategy.joined()


class FleetLockstep(Lockstep):
    """The loop's coordination in a fleet's datacenter (module docstring)."""

    def __init__(self, r, me: dict, channel: Channel | None, lv: FleetLevels | None = None):
        self.me = me
        super().__init__(r)
        self.samples_per_step = r.cfg.batch_size * r.strategy.batch_place()[1]   # this datacenter's
        self.channel = channel
        self.ranked = lv.rank_channel if lv is not None else None    # sharded outer state
        self.rank, self.world = me["offset"] + r.comm.rank, me["total"]
        self.joined: dict | None = None
        self.t_hello = time.monotonic()
        self.stopped = False

    def batch_place(self) -> tuple[int, int]:
        """This rank's place among the whole fleet's batches: its place inside the datacenter
        as the method there sees it (the ranks of one split model share one batch), the
        datacenters one after another (each has as many ranks)."""
        i, n = self.r.strategy.batch_place()
        size = self.r.comm.size
        return self.me["offset"] // size * n + i, self.me["total"] // size * n

    def start(self):
        state = super().start()
        if self.channel is not None:
            self.channel.send("hello", joining=self.me["join"], ranks=self.r.comm.size)
            self.t_hello = time.monotonic()
        if self.me["join"]:
            self._join(state)
        self.first_step, self.first_passed, self.t_start = state.step, state.passed, self.t0
        return state

    def _join(self, state) -> None:
        """Wait to be admitted (the leader; the other ranks wait for it without the
        watchdog's floor: the leader's own limit covers them), then take the state."""
        r, dog = self.r, self.r.ctl.watchdog
        info = None
        if self.channel is not None:
            info = self.channel.join(r.comm.ledger)
        floor, dog.timeout_s = dog.timeout_s, (dog.timeout_s if self.channel else 0)
        try:
            info = r.ctl.bcast_object(info) if r.comm.size > 1 else info
        finally:
            dog.timeout_s = floor
        install(r, info["payload"], self.r.cfg.fleet.heal_inner == "reset")
        state.step = info["step"]
        state.samples = state.step * self.samples_per_step * self.me["total"] // r.comm.size
        self.joined = {k: v for k, v in info.items() if k != "payload"}
        self.joined["since_hello_s"] = round(time.monotonic() - self.t_hello, 3)
        if self.channel is not None:
            self.channel.send("healed", step=info["step"], round=info["round"],
                              bytes=info["bytes"], seconds=self.joined["since_hello_s"],
                              wait_s=info["wait_s"], transfer_s=info["transfer_s"])
        log.info("datacenter %d admitted at step %d (round %d): %d bytes of state, %.2f s after "
                 "its hello", self.me["dc"], info["step"], info["round"], info["bytes"],
                 self.joined["since_hello_s"])

    def after_step(self, state) -> None:
        super().after_step(state)
        s = self.r.strategy
        at = state.step - s.warmup_steps
        if at <= 0 or at % s.period:
            return
        if self.ranked is not None:                  # every rank knows, every rank's state
            if self.ranked.admit_due:
                parts = self.r.ctl.allgather_object(payload(self.r))
                if self.channel is not None:
                    self._admit(state, lambda: bundle(parts))
                self.ranked.admitted()
        elif self.channel is not None and self.channel.donate_to:    # asynchronous DiLoCo
            to = self.channel.donate(state.step, payload(self.r), self.r.comm.ledger)
            log.info("handed the state to datacenter(s) %s at step %d", to, state.step)
        elif self.channel is not None and self.channel.admission_due(self._landed()):
            s.drain()                                # no round of the outer loop in flight
            self._admit(state, lambda: payload(self.r))

    def _landed(self) -> int:
        """The last inner step whose rounds have landed on every member: a delayed outer loop
        (τ = ``delay``) applies a round sent at step t after step t + τ."""
        return self.r.strategy.landed(self.state.step)

    def _admit(self, state, make) -> None:
        admitted = self.channel.admit(state.step, make, self.r.comm.ledger)
        if admitted:
            log.info("admitted datacenter(s) %s at step %d", admitted, state.step)

    def stop(self, state, flag) -> bool:
        """The loop's stop vote; the leader votes to stop once a committed round said the
        fleet halts (every datacenter then stops at the same step, :data:`STOP_VOTE_LAG` after
        that round's boundary, and writes its checkpoint)."""
        halted = self.channel.halted_by(self._landed()) if self.channel is not None else 0
        if halted and not flag.signum:
            flag.signum = halted
            outcome.stop_signal(flag.signum)
        try:
            return super().stop(state, flag)
        except Interrupted:
            self.stopped = True
            raise

    def line_extra(self) -> dict:
        if self.channel is None:
            return {}
        ch = self.channel
        return {"fleet_round": ch.round, "members": ch.members, **self._times()}

    def _times(self) -> dict:
        """This incarnation's seconds since its loop started (``run_s``), of them waiting for
        the others at rounds (``idle_s``) and in rounds in all (``rounds_s``: the waits and the
        reductions)."""
        ch, held = self.channel, self.r.strategy.wait_s
        if not self.r.strategy.delay:
            held = 0.0             # a blocking outer loop's rounds are the channel's own
        return {"run_s": round(time.perf_counter() - self.t_start, 4),
                "idle_s": round(ch.wait_s - ch.overlapped["wait_s"] + held, 4),
                "rounds_s": round(ch.round_s - ch.overlapped["round_s"] + held, 4)}

    def time_use(self) -> dict:
        """What this incarnation did with its time, for the fleet's goodput: its steps computed
        (not those dynamic local updates passed over), samples
        and tokens (where the task says the tokens of a sample), its seconds (:meth:`_times`)
        and the busy ones (not in a round)."""
        r, state = self.r, self.state
        steps = state.step - self.first_step - (state.passed - self.first_passed)   # computed
        samples = steps * r.cfg.batch_size * r.comm.size
        per = r.task.tokens_per_sample(r.cfg)
        times = self._times()
        return {"steps": steps, "samples": samples, "tokens": samples * per if per else None,
                **times, "busy_s": round(times["run_s"] - times["rounds_s"], 4)}

    def summary_extra(self) -> dict:
        out = {"dc": self.me["dc"], "inc": self.me["inc"], "joined": self.joined}
        if self.channel is not None:
            out["rounds"] = self.channel.epoch_rounds
            out["time"] = self.time_use()
        return {"fleet": out}

    def finish(self, state):
        summary = super().finish(state)
        if self.channel is not None:
            self.channel.close("finished")
        return summary

    def abandon(self) -> None:
        super().abandon()
        if self.channel is not None:
            self.channel.close("stopped" if self.stopped else "failed")


__all__ = ["FleetLevels", "FleetLockstep", "bundle", "connect", "install", "levels", "payload",
           "run"]
