"""The fleet's coordinator: a small process holding the ``TCPStore`` that the datacenters'
leaders talk through (:mod:`lowcomm.run.fleet.channel`) and the membership's decisions
(:mod:`lowcomm.run.fleet.membership`).

``python -m lowcomm.run.fleet.coordinator --dcs D --min-dcs M --limit-s L --log FILE`` prints
``ready PORT`` once the store listens, then serves until told ``stop`` on stdin (or stdin
closes: the fleet that started it is gone). The fleet's supervisor
(:mod:`lowcomm.run.fleet.supervisor`) writes one JSON command a line on its stdin — ``launch``
(a datacenter's job incarnation was started), ``down`` (it ended, with the cause), ``retire``
(left out), ``halt`` (stop every member after the next round), ``stop`` — and reads the log's
events, one JSON line each, on its stdout. A thread per launched incarnation waits on that
incarnation's next message key (the store answers a wait when the key is set, so nothing
polls the network); the main loop reads heartbeats every half heartbeat, counts its own
heartbeat up, and moves the decisions' messages into the members' mailboxes. In a fleet of
asynchronous DiLoCo (``--server``) it also holds the outer state
(:mod:`~lowcomm.run.fleet.server`): each arrival's tensors are read from the store, applied and
answered with θ in the main loop, one at a time. When the
membership gives up (:class:`~lowcomm.run.fleet.membership.NoQuorum`) it logs why and exits
with status 3.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import queue
import sys
import threading
import time

import torch

from .store import connect, key
from .trust import Forged, Seal, SealedStore
from .arrivals import Arrivals
from .membership import LIVE, Membership, NoQuorum, Timeouts
from .rounds import Rounds
from .server import ArrivalServer


class _Watcher(threading.Thread):
    """Read incarnation ``inc`` of ``dc``'s messages in order into ``out`` (its own client of
    the store at ``host:port``). A value that does not open with the fleet's key, or is no
    message of that incarnation, is dropped and logged (``dropped``), and the next value
    written under the same name is read instead."""

    def __init__(self, address: tuple[str, int], dc: int, inc: int, out: queue.Queue):
        super().__init__(name=f"lowcomm-coord-{dc}.{inc}", daemon=True)
        self.address, self.dc, self.inc, self.out = address, dc, inc, out
        self.stop = threading.Event()

    def run(self) -> None:
        store = connect(*self.address, 30)
        k = 0
        while not self.stop.is_set():
            name = key("inbox", dc=self.dc, inc=self.inc, k=k)
            try:
                store.wait([name], datetime.timedelta(seconds=0.5))
            except Exception:  # noqa: BLE001 - the wait's timeout: look at the stop flag
                continue
            msg, why = self._message(store, name)
            if msg is None:
                if why:
                    self.out.put(("dropped", {"key": name, "why": why}))
                continue
            self.out.put(("msg", msg))
            k += 1

    def _message(self, store: SealedStore, name: str) -> tuple[dict | None, str]:
        """The message at ``name``, or None and why it is dropped."""
        try:
            msg = json.loads(store.get(name))
        except Forged as e:
            return None, "" if e.again else "does not authenticate"
        except ValueError:
            return None, "no JSON"
        if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
            return None, "no message"
        if (msg.get("dc"), msg.get("inc")) != (self.dc, self.inc):
            return None, f"names datacenter {msg.get('dc')!r}.{msg.get('inc')!r}"
        return msg, ""


class Coordinator:
    """Serve one fleet's membership on ``store`` (the master), logging events to ``log``;
    ``server``: asynchronous DiLoCo's arrival server (None: a fleet of rounds; with one, the
    membership's policy is :class:`~lowcomm.run.fleet.arrivals.Arrivals`), its state saved to
    ``state_path`` when the coordinator stops and loaded from there when it starts."""

    def __init__(self, store: SealedStore, membership: Membership, log, heartbeat_s: float,
                 server: ArrivalServer | None = None, state_path: str | None = None):
        self.store, self.m, self.log, self.heartbeat_s = store, membership, log, heartbeat_s
        self.address = (store.host, store.port)
        self.server, self.state_path = server, state_path
        if server is not None and state_path and os.path.exists(state_path):
            server.load_state_dict(torch.load(state_path, weights_only=True))
            self.m.event("server_state", arrivals=server.arrivals, **{"from": state_path})
        self.q: queue.Queue = queue.Queue()
        self.held: list = []
        self.watchers: dict[tuple[int, int], _Watcher] = {}
        self.sent: dict[tuple[int, int], int] = {}
        self.beats: dict[tuple[int, int], int] = {}
        self.beat = 0                                   # this coordinator's heartbeat
        self.stopping = False

    def serve(self, commands) -> int:
        """Run until ``stop``; the exit status (3 when the membership gave up)."""
        threading.Thread(target=self._read, args=(commands,), daemon=True).start()
        self.m.event("start", port=self.store.port)
        next_hb = 0.0
        try:
            while not self.stopping:
                now = time.monotonic()
                self._drain(now)
                if now >= next_hb:
                    self._heartbeats(now)
                    next_hb = now + self.heartbeat_s / 2
                self.m.tick(now)
                self._serve()
                self._flush()
                self._wait(0.02)
        except NoQuorum as e:
            self.m.event("gave_up", why=str(e))
            self._flush()
            return 3
        finally:
            self._save()
        return 0

    # asynchronous DiLoCo's arrivals -------------------------------------------------------------
    def _serve(self) -> None:
        """Apply the arrivals the membership queued, in order, and answer each; then the final
        ones, all applied before any is answered (every member takes the same θ)."""
        arrivals, server = self.m.policy, self.server
        if server is None:
            return
        for dc, inc, msg in arrivals.queue:
            self._apply(dc, inc, msg)
            self._answer(dc, inc, msg, self._state())
        arrivals.queue.clear()
        if arrivals.barrier:
            for dc, inc, msg in arrivals.barrier:
                self._apply(dc, inc, msg)
            state = self._state()                  # the same θ for every member
            for dc, inc, msg in arrivals.barrier:
                self._answer(dc, inc, msg, state)
            arrivals.barrier = []
            self.m.event("final", arrivals=server.arrivals)

    def _apply(self, dc: int, inc: int, msg: dict) -> None:
        name = key("arrival", dc=dc, inc=inc, n=msg["n"])
        try:
            data = self.store.get(name)
        except Forged:             # overwritten by an outsider: this arrival brings nothing
            self.m.event("dropped", key=name, why="does not authenticate")
            return
        x = torch.frombuffer(bytearray(data), dtype=torch.float32) if data else torch.zeros(0)
        self.store.delete_key(name)
        numel, at = int(msg["numel"]), 0
        if msg.get("base"):
            self.server.start(x[:numel])
            at = numel
        delta = None if msg.get("empty") else x[at:at + numel]
        self.server.arrive(dc, delta, x[at + (0 if delta is None else numel):])

    def _state(self) -> bytes:
        """θ and the members' mean buffers, as an answer carries them."""
        return torch.cat([self.server.theta.detach(), self.server.mean_buffers()]).numpy().tobytes()

    def _answer(self, dc: int, inc: int, msg: dict, state: bytes) -> None:
        self.store.set(key("theta", dc=dc, inc=inc, n=msg["n"]), state)
        self.m.mail(dc, self.m.policy.answer(dc, msg, self.server.arrivals), inc)

    def _save(self) -> None:
        if self.server is None or not self.state_path or not self.server.ready:
            return
        tmp = self.state_path + ".tmp"
        torch.save(self.server.state_dict(), tmp)
        os.replace(tmp, self.state_path)

    def _read(self, commands) -> None:
        for line in commands:
            if line.strip():
                self.q.put(("cmd", json.loads(line)))
        self.q.put(("cmd", {"cmd": "stop"}))

    def _wait(self, seconds: float) -> None:
        try:
            self.held.append(self.q.get(timeout=seconds))     # first in the next drain
        except queue.Empty:
            pass

    def _drain(self, now: float) -> None:
        while True:
            if self.held:
                kind, obj = self.held.pop(0)
            else:
                try:
                    kind, obj = self.q.get_nowait()
                except queue.Empty:
                    return
            if kind == "msg":
                self.m.message(obj, now)
            elif kind == "dropped":
                self.m.event("dropped", **obj)
            else:
                self._command(obj, now)

    def _command(self, c: dict, now: float) -> None:
        if c["cmd"] == "launch":
            w = self.watchers.get((c["dc"], c["inc"]))
            if w is None:
                w = self.watchers[(c["dc"], c["inc"])] = _Watcher(self.address, c["dc"],
                                                                  c["inc"], self.q)
                w.start()
        elif c["cmd"] == "down":
            self.m.down(c["dc"], c["inc"], c["cause"], now)
            w = self.watchers.pop((c["dc"], c["inc"]), None)
            if w is not None:
                w.stop.set()
        elif c["cmd"] == "retire":
            self.m.retire(c["dc"], c.get("why", "failed too often"))
        elif c["cmd"] == "halt":
            self.m.halt(c["signum"])
        elif c["cmd"] == "stop":
            self.stopping = True

    def _heartbeats(self, now: float) -> None:
        self.beat += 1
        self.store.count(key("coordinator"), self.beat)
        for d, s in self.m.sites.items():
            if s.state in LIVE:
                n = self.store.counted(key("heartbeat", dc=d, inc=s.inc))
                if n is not None and n > self.beats.get((d, s.inc), 0):   # a replay is older
                    self.beats[(d, s.inc)] = n
                    self.m.heartbeat(d, s.inc, now)

    def _flush(self) -> None:
        for dc, inc, msg in self.m.outbox:
            n = self.sent.get((dc, inc), 0)
            self.store.set(key("mailbox", dc=dc, inc=inc, n=n), json.dumps(msg))
            self.sent[(dc, inc)] = n + 1
        self.m.outbox.clear()
        for ev in self.m.events:
            line = json.dumps(ev)
            if self.log is not None:
                self.log.write(line + "\n")
                self.log.flush()
            sys.stdout.write(line + "\n")
        sys.stdout.flush()
        self.m.events.clear()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--host", default="127.0.0.1", help="the address the store listens on")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--dcs", type=int, required=True)
    ap.add_argument("--min-dcs", type=int, required=True)
    ap.add_argument("--limit-s", type=float, required=True)
    ap.add_argument("--heartbeat-s", type=float, default=0.5)
    ap.add_argument("--start-s", type=float, default=300.0)
    ap.add_argument("--quorum-s", type=float, default=600.0)
    ap.add_argument("--quorum", type=int, default=0)
    ap.add_argument("--grace", type=float, default=0.0)
    ap.add_argument("--log", default=None)
    ap.add_argument("--server", default=None, help="asynchronous DiLoCo's arrival server: JSON "
                    "{\"lr\", \"momentum\", \"every\"}")
    ap.add_argument("--state", default=None, help="where the arrival server's state is saved")
    a = ap.parse_args(argv)
    from torch.distributed import TCPStore
    master = TCPStore(a.host, a.port, is_master=True, wait_for_workers=False,
                      timeout=datetime.timedelta(seconds=60))
    store = SealedStore(master, Seal.from_env(), host=a.host)
    m = Membership(a.dcs, a.min_dcs, time.monotonic(), Timeouts(a.limit_s, a.start_s, a.quorum_s),
                   Arrivals() if a.server else Rounds(a.quorum, a.grace))
    server = ArrivalServer(**json.loads(a.server)) if a.server else None
    print(f"ready {store.port}", flush=True)
    log = open(a.log, "a") if a.log else None
    try:
        return Coordinator(store, m, log, a.heartbeat_s, server, a.state).serve(sys.stdin)
    finally:
        if log is not None:
            log.close()


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    os._exit(code)     # not through the store's destructors: its waiting threads would abort
