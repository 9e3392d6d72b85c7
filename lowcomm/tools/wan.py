"""WAN emulation with real packets: one network namespace per datacenter, joined by a user-space
forwarder that adds one-way delay, a rate limit and a bounded drop-tail queue per direction.

This machine's kernel has namespaces, TUN, HTB and TBF but no ``netem``, so the delay is added in
user space: every datacenter namespace ``lowcomm-dc<i>`` holds a TUN device ``lcwan<i>`` with
address ``10.77.0.<i+1>/24``; the forwarder (one process in the root namespace, holding the TUN
file descriptors) reads each IP packet, looks up the link (source dc, destination dc), queues it
behind the link's earlier packets (serialisation at the link rate; a packet that would push the
queue past ``queue_bytes`` is dropped, as in a drop-tail router) and writes it into the
destination namespace ``delay`` seconds after it left the queue.

Only the namespaces this module creates carry traffic; nothing leaves the machine. Needs root.

Faults (:mod:`lowcomm.tools.wan_faults`): a link can be taken down for a while (its packets dropped,
or held) and given random packet loss, on the running forwarder (``lowcomm wan fault``) or
scheduled when the WAN comes up (``--fault``).

Commands (``lowcomm wan up|fault|down|status``; ranks run with ``launchers/wan.sh``)::

    lowcomm wan up --dcs 2 --delay-ms 25 --rate-mbit 100 [--link 0,1,50,20] [--fault down:0-1:at=20s:for=10s]
    lowcomm wan fault --link 0-1 --down 10s          # or --loss 1% [--seed 7], or --clear
    launchers/wan.sh -n 4 --dcs 2 lowcomm bench allreduce --algorithms ring,hierarchical
    lowcomm wan down

Where emulation is impossible, :func:`model_seconds` charges the α–β time of a run's inter-dc
traffic from its ledger rows instead (a virtual clock).
"""
from __future__ import annotations

import errno
import fcntl
import heapq
import json
import os
import select
import shutil
import signal
import struct
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..errors import LowcommError
from ..comm.ledger import alpha_beta_seconds
from .wan_faults import Fault, FaultTable, add as add_faults, load as load_faults

STATE_DIR = Path(os.environ.get("LOWCOMM_WAN_STATE", "/run/lowcomm-wan"))
NS_PREFIX = "lowcomm-dc"
DEV_PREFIX = "lcwan"
SUBNET = "10.77.0"
TUNSETIFF, IFF_TUN, IFF_NO_PI = 0x400454CA, 0x0001, 0x1000


class WanError(LowcommError):
    """The emulated WAN cannot be set up, used or taken down; the message says why."""


@dataclass
class Link:
    """One direction of a link between datacenters ``a`` -> ``b``."""
    a: int
    b: int
    delay_ms: float
    rate_mbit: float
    queue_bytes: int

    @property
    def bytes_per_s(self) -> float:
        return self.rate_mbit * 1e6 / 8


@dataclass
class WanSpec:
    dcs: int
    delay_ms: float = 25.0
    rate_mbit: float = 100.0
    queue_kb: float = 0.0          # 0: one bandwidth-delay product (rate x 2·delay), >= 64 KiB
    mtu: int = 9000
    links: list[Link] = field(default_factory=list)

    def __post_init__(self):
        if not 2 <= self.dcs <= 32:
            raise WanError(f"--dcs must be in [2, 32], got {self.dcs}")
        if self.delay_ms < 0 or self.rate_mbit <= 0:
            raise WanError(f"needs delay >= 0 and rate > 0, got {self.delay_ms} ms, {self.rate_mbit} Mbit/s")
        if not 576 <= self.mtu <= 65000:
            raise WanError(f"--mtu must be in [576, 65000], got {self.mtu}")
        given = {(x.a, x.b): x for x in self.links}
        full = []
        for a in range(self.dcs):
            for b in range(self.dcs):
                if a != b:
                    full.append(given.get((a, b)) or self._link(a, b, self.delay_ms, self.rate_mbit))
        self.links = full

    def _link(self, a, b, delay_ms, rate_mbit) -> Link:
        q = int(self.queue_kb * 1024) or max(64 << 10, int(rate_mbit * 1e6 / 8 * 2 * delay_ms / 1e3))
        return Link(a, b, delay_ms, rate_mbit, q)

    def set_link(self, text: str) -> None:
        """``"a,b,delay_ms,rate_mbit"``: both directions between dcs a and b."""
        try:
            a, b, d, r = text.split(",")
            a, b, d, r = int(a), int(b), float(d), float(r)
        except ValueError:
            raise WanError(f"--link {text!r}: use a,b,delay_ms,rate_mbit (e.g. 0,1,50,20)") from None
        if not (0 <= a < self.dcs and 0 <= b < self.dcs and a != b) or d < 0 or r <= 0:
            raise WanError(f"--link {text!r}: dcs must be two different ones of 0..{self.dcs - 1}, "
                           "delay >= 0 and rate > 0")
        self.links = [x for x in self.links if {x.a, x.b} != {a, b}]
        self.links += [self._link(a, b, d, r), self._link(b, a, d, r)]

    def link(self, a: int, b: int) -> Link:
        return next(x for x in self.links if x.a == a and x.b == b)


def namespace(i: int) -> str:
    return f"{NS_PREFIX}{i}"


def address(i: int) -> str:
    return f"{SUBNET}.{i + 1}"


# ---------------------------------------------------------------------------------------------
# the forwarder
# ---------------------------------------------------------------------------------------------
def open_tun(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TUN | IFF_NO_PI))
    return fd


def forward(fds: list[int], spec: WanSpec, stats_path: Path | None = None,
            state_dir: Path | None = None) -> None:
    """Move IPv4 packets between the TUN devices ``fds`` (index = datacenter) until SIGTERM.

    Per direction a -> b: a packet of L bytes starts serialising at max(now, busy_until), ends
    L/rate later, and is written to dc b ``delay`` after that; if the bytes still waiting to be
    serialised exceed the queue bound, it is dropped (drop-tail). Faults
    (:mod:`lowcomm.tools.wan_faults`, read from ``state_dir``'s control file every 0.2 s) come
    first: a link that is down drops the packet, or holds it (its serialisation starts when
    the link is back, the queue bound counted from then); a lossy link drops it at its rate.
    The counters go to ``stats_path`` about once a second and at the end."""
    forwarder = _Forwarder(fds, spec, stats_path, state_dir)
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    forwarder.run(stop)


class _Forwarder:
    """:func:`forward`'s links, queues and counters."""

    def __init__(self, fds: list[int], spec: WanSpec, stats_path: Path | None, state_dir: Path | None):
        self.fds, self.stats_path = fds, stats_path
        self.links = {(x.a, x.b): x for x in spec.links}
        self.busy = {k: 0.0 for k in self.links}
        self.heap: list = []               # (when to write, sequence, dc, packet)
        self.seq = 0
        self.stats = {"packets": 0, "bytes": 0, "dropped": 0, "misrouted": 0, "fault_drops": 0,
                      "fault_holds": 0}
        self.faults = FaultTable(state_dir, spec.dcs, log=lambda m: print(m, file=sys.stderr, flush=True)) \
            if state_dir else None
        self.poller = select.poll()
        self.index = {}
        for i, fd in enumerate(fds):
            self.poller.register(fd, select.POLLIN)
            self.index[fd] = i
        self.prefix = bytes(map(int, SUBNET.split(".")))

    def run(self, stop: list) -> None:
        """Forward until ``stop`` is not empty; the counters last."""
        next_poll = next_stats = 0.0
        while not stop:
            now = time.monotonic()
            if self.faults and now >= next_poll:
                self.faults.poll()
                next_poll = now + 0.2
            if self.stats_path and now >= next_stats:
                _write_stats(self.stats_path, self.stats, self.faults)
                next_stats = now + 1.0
            self._deliver(now)
            timeout = max(0, (self.heap[0][0] - time.monotonic()) * 1e3) if self.heap else 200
            try:
                ready = self.poller.poll(min(timeout, 200))
            except InterruptedError:
                continue
            for fd, _ in ready:
                self._read(fd)
        if self.stats_path:
            _write_stats(self.stats_path, self.stats, self.faults)

    def _deliver(self, now: float) -> None:
        """Write every packet whose time has come to its datacenter."""
        while self.heap and self.heap[0][0] <= now:
            _, _, b, pkt = heapq.heappop(self.heap)
            try:
                os.write(self.fds[b], pkt)
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EIO, errno.EINVAL):
                    raise
                self.stats["dropped"] += 1

    def _read(self, fd: int) -> None:
        """Queue every packet waiting on ``fd`` for its datacenter (or drop it)."""
        a = self.index[fd]
        while True:
            try:
                pkt = os.read(fd, 65536)
            except BlockingIOError:
                break
            if len(pkt) < 20 or pkt[0] >> 4 != 4 or pkt[16:19] != self.prefix:
                self.stats["misrouted"] += 1      # not IPv4 to one of our dcs (e.g. IPv6 noise)
                continue
            b = pkt[19] - 1
            link = self.links.get((a, b))
            if link is None:
                self.stats["misrouted"] += 1
                continue
            self._queue(a, b, link, pkt)

    def _queue(self, a: int, b: int, link: Link, pkt: bytes) -> None:
        """A packet from dc a to dc b: the faults first, then the link's queue bound, rate and
        delay."""
        now = time.monotonic()
        ready_at = now
        if self.faults and self.faults.faults:
            wall = time.time()
            verdict, until = self.faults.verdict(a, b, wall)
            if verdict == "drop":
                self.stats["fault_drops"] += 1
                return
            if verdict == "hold":
                self.stats["fault_holds"] += 1
                ready_at = now + (until - wall)
        start = max(ready_at, self.busy[(a, b)])
        if (start - ready_at) * link.bytes_per_s + len(pkt) > link.queue_bytes:
            self.stats["dropped"] += 1
            return
        self.busy[(a, b)] = done = start + len(pkt) / link.bytes_per_s
        self.seq += 1
        heapq.heappush(self.heap, (done + link.delay_ms / 1e3, self.seq, b, pkt))
        self.stats["packets"] += 1
        self.stats["bytes"] += len(pkt)


def _write_stats(stats_path: Path, stats: dict, faults) -> None:
    """The forwarder's counters, replaced atomically (``lowcomm wan status`` reads them)."""
    out = dict(stats, by_fault={str(k): v for k, v in faults.counts.items()} if faults else {})
    tmp = stats_path.with_suffix(".tmp")
    tmp.write_text(json.dumps(out))
    os.replace(tmp, stats_path)


def _forwarder_main(argv: list[str]) -> None:
    """``python -m lowcomm.tools.wan forward STATE.json``: create the TUN devices, say ready on
    stdout, forward until SIGTERM."""
    state = json.loads(Path(argv[0]).read_text())
    spec = WanSpec(state["dcs"], state["delay_ms"], state["rate_mbit"], state["queue_kb"],
                   state["mtu"], [Link(**x) for x in state["links"]])
    fds = [open_tun(f"{DEV_PREFIX}{i}") for i in range(spec.dcs)]
    try:
        os.setpriority(os.PRIO_PROCESS, 0, -10)   # it stands in for a network device
    except OSError:
        pass
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    forward(fds, spec, STATE_DIR / "forwarder-stats.json", STATE_DIR)


# ---------------------------------------------------------------------------------------------
# up / down
# ---------------------------------------------------------------------------------------------
def require_root(what: str = "WAN emulation") -> None:
    if os.geteuid() != 0:
        raise WanError(f"{what} needs root (it creates network namespaces and TUN devices); "
                       "run as root, or use --wan model for the α–β virtual clock")
    missing = [t for t in ("ip", "unshare") if shutil.which(t) is None]
    if missing:
        raise WanError(f"{what} needs {' and '.join(missing)} (apt-get install iproute2 util-linux)")
    if not os.path.exists("/dev/net/tun"):
        raise WanError(f"{what} needs /dev/net/tun (the kernel's TUN driver)")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and p.returncode:
        raise WanError(f"'ip {' '.join(args)}' failed: {p.stderr.strip()}")
    return p


def state() -> dict | None:
    """The running WAN's description, or None."""
    f = STATE_DIR / "state.json"
    return json.loads(f.read_text()) if f.is_file() else None


def ours() -> dict:
    """What of ours exists now: namespaces, root-namespace devices, forwarder pid alive."""
    ns = [line.split()[0] for line in _ip("netns", "list", check=False).stdout.splitlines()
          if line.startswith(NS_PREFIX)]
    devs = [line.split(":")[1].strip() for line in _ip("-o", "link", "show", check=False).stdout.splitlines()
            if line.split(":")[1].strip().startswith(DEV_PREFIX)]
    s = state()
    alive = bool(s) and _alive(s.get("pid", 0))
    return {"namespaces": ns, "devices": devs, "forwarder": alive, "state_file": s is not None}


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:   # a zombie or a recycled pid is not our forwarder
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        return b"lowcomm.tools.wan" in cmd
    except OSError:
        return False


def up(spec: WanSpec, faults: list[Fault] = ()) -> dict:
    """Create the namespaces, TUN devices and the forwarder; undo everything on any failure.
    ``faults`` (times relative to the moment the WAN is up: :func:`lowcomm.tools.wan_faults.parse_spec`)
    are scheduled once it is."""
    require_root("lowcomm wan up")
    _check_links(faults, spec.dcs)
    if state() is not None or ours()["namespaces"]:
        raise WanError("an emulated WAN is already up (lowcomm wan down first)")
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    for f in ("faults.json", "forwarder-stats.json"):     # a previous WAN's
        (STATE_DIR / f).unlink(missing_ok=True)
    st = {"dcs": spec.dcs, "delay_ms": spec.delay_ms, "rate_mbit": spec.rate_mbit,
          "queue_kb": spec.queue_kb, "mtu": spec.mtu, "links": [asdict(x) for x in spec.links],
          "pid": 0, "namespaces": [namespace(i) for i in range(spec.dcs)],
          "addresses": [address(i) for i in range(spec.dcs)]}
    (STATE_DIR / "state.json").write_text(json.dumps(st, indent=1))
    try:
        for i in range(spec.dcs):
            _ip("netns", "add", namespace(i))
            _ip("-n", namespace(i), "link", "set", "lo", "up")
            # a long fat link's usual host tuning: keep the congestion window across idle gaps
            # (synchronisations every few seconds would otherwise restart slow start each time)
            subprocess.run(["ip", "netns", "exec", namespace(i), "sysctl", "-qw",
                            "net.ipv4.tcp_slow_start_after_idle=0"], check=True)
        log = open(STATE_DIR / "forwarder.log", "w")
        proc = subprocess.Popen([sys.executable, "-m", "lowcomm.tools.wan", "forward",
                                 str(STATE_DIR / "state.json")], stdout=subprocess.PIPE,
                                stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
                                text=True)
        st["pid"] = proc.pid
        (STATE_DIR / "state.json").write_text(json.dumps(st, indent=1))
        line = proc.stdout.readline().strip()
        if line != "ready":
            proc.wait(5)
            raise WanError(f"the forwarder did not start: {(STATE_DIR / 'forwarder.log').read_text()[-2000:]}")
        proc.stdout.close()
        for i in range(spec.dcs):
            dev, ns = f"{DEV_PREFIX}{i}", namespace(i)
            _ip("link", "set", dev, "netns", ns)
            _ip("-n", ns, "link", "set", dev, "mtu", str(spec.mtu))
            _ip("-n", ns, "addr", "add", f"{address(i)}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
        if faults:
            add_faults(STATE_DIR, [f.at(time.time()) for f in faults])
    except BaseException:
        down(quiet=True)
        raise
    return st


def _check_links(faults: list[Fault], dcs: int) -> None:
    """Every fault's link joins datacenters this WAN has (a fault may have been made for more)."""
    for f in faults:
        if any(not (0 <= a < dcs and 0 <= b < dcs) for a, b in f.directions(dcs)):
            raise WanError(f"fault on link {f.link}: the WAN has datacenters 0..{dcs - 1}")


def fault(faults: list[Fault], clear: bool = False) -> list[Fault]:
    """Schedule ``faults`` (times relative to now) on the running WAN; ``clear`` first ends
    every earlier fault. Returns the faults added, numbered. The forwarder picks them up within
    0.2 s (its control file, :mod:`lowcomm.tools.wan_faults`)."""
    require_root("lowcomm wan fault")
    s = state()
    if s is None or not _alive(s.get("pid", 0)):
        raise WanError("no emulated WAN is up (lowcomm wan up first)" if s is None else
                       f"the WAN's forwarder (pid {s.get('pid')}) is not running; "
                       "lowcomm wan down, then up again")
    _check_links(faults, s["dcs"])
    now = time.time()
    return add_faults(STATE_DIR, [f.at(now) for f in faults], clear=clear)


def faults_now() -> list[dict]:
    """The running WAN's faults with their state now and the packets each dropped or held so
    far (from the forwarder's counters, at most a second old)."""
    try:
        counts = json.loads((STATE_DIR / "forwarder-stats.json").read_text()).get("by_fault", {})
    except (OSError, ValueError):
        counts = {}
    now = time.time()
    return [{"id": f.id, "kind": f.kind, "link": f.link, "active": f.active(now),
             "packets": counts.get(str(f.id), 0), "what": f.describe(now)}
            for f in load_faults(STATE_DIR)]


def down(quiet: bool = False) -> list[str]:
    """Stop the forwarder and every process left in our namespaces, delete the namespaces (their
    TUN devices go with them) and the state; returns what was removed. Safe to run twice."""
    require_root("lowcomm wan down")
    removed = []
    s = state()
    if s and _alive(s.get("pid", 0)):
        os.kill(s["pid"], signal.SIGTERM)
        for _ in range(50):
            if not _alive(s["pid"]):
                break
            time.sleep(0.05)
        else:
            os.kill(s["pid"], signal.SIGKILL)
        removed.append(f"forwarder pid {s['pid']}")
    for ns in ours()["namespaces"]:
        pids = _ip("netns", "pids", ns, check=False).stdout.split()
        for pid in pids:          # processes of ours still inside (a failed run's ranks)
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        _ip("netns", "delete", ns, check=not quiet)
        removed.append(f"namespace {ns}")
    for dev in ours()["devices"]:   # devices never moved (a failed up)
        _ip("link", "delete", dev, check=False)
        removed.append(f"device {dev}")
    for f in ("state.json", "faults.json", "faults.lock"):
        if (STATE_DIR / f).exists():
            (STATE_DIR / f).unlink()
            removed.append(str(STATE_DIR / f))
    return removed


# ---------------------------------------------------------------------------------------------
# the virtual clock (--wan model)
# ---------------------------------------------------------------------------------------------
def model_seconds(rows: list[dict], delay_ms: float, rate_mbit: float, level: str = "dc",
                  group_size: int = 2) -> dict:
    """α–β time of the inter-datacenter traffic in a run's ledger ``rows`` (``Ledger.rows()``):
    each row of ``level`` costs ``calls·rounds·α + bytes_sent/β`` with α = ``delay_ms`` (one
    way), β = ``rate_mbit`` and the rounds of :func:`lowcomm.comm.ledger.latency_rounds` for a group
    of ``group_size`` ranks (the number of datacenters). Other levels are free.

    Returns ``{"seconds", "calls", "bytes_sent", "level", "link"}``; ``seconds`` is what a
    virtual clock adds to the run's measured time (one rank's view, no overlap assumed)."""
    alpha, beta = delay_ms / 1e3, rate_mbit * 1e6 / 8
    sel = [r for r in rows if r["level"] == level and r["op"] != "check"]
    calls = sum(r["calls"] for r in sel)
    sent = sum(r["bytes_sent"] for r in sel)
    secs = alpha_beta_seconds(sel, group_size, alpha, beta)
    return {"seconds": secs, "calls": calls, "bytes_sent": sent, "level": level,
            "link": f"{delay_ms:g} ms / {rate_mbit:g} Mbit/s (modelled)"}


if __name__ == "__main__":
    if len(sys.argv) >= 3 and sys.argv[1] == "forward":
        _forwarder_main(sys.argv[2:])
    else:
        sys.exit("usage: python -m lowcomm.tools.wan forward STATE.json")
