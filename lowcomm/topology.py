"""Topology: who sits where (ranks in nodes in datacenters), one Comm per level, and the α–β
model of each level's links.

A topology is a list of named levels, outermost first, e.g. ``dc:2,node:2,rank:2``: two
datacenters, each with two nodes, each with two ranks (8 ranks). Each entry counts the units of
that level *inside one unit of the level above*: either one integer (every parent has that many)
or one count per parent joined by ``+`` for unequal groups::

    dc:2,rank:3+1          # dc 0 holds 3 ranks, dc 1 holds 1
    dc:2,node:2+1,rank:2   # dc 0: 2 nodes, dc 1: 1 node; every node 2 ranks (6 ranks)
    dc:2@25ms/100mbit,rank:2   # α and β of the inter-dc links given inline

Spec strings place ranks in world-rank order (rank 0.. fill the first unit first). The
environment can also say where ranks are (:meth:`Topology.from_env`): ``$LOWCOMM_TOPOLOGY``,
Slurm's ``SLURM_NODEID``, a hostfile (``$LOWCOMM_HOSTFILE``), or MPI's shared-memory split
(``MPI_COMM_TYPE_SHARED``: ranks that can share memory form one node).

Ledger levels: traffic is filed under the name of the outermost level at which the two ends
differ: messages between datacenters under ``dc``, between nodes of one datacenter under
``node``, between ranks of one node under the innermost level's name (``rank``).

Communicators for a per-level policy (e.g. dense all-reduce inside a datacenter, DiLoCo across)::

    topo = Topology.parse("dc:2,rank:2").attach(comm)
    inside = topo.group("dc")     # all ranks of my datacenter   (traffic filed under "rank")
    across = topo.peers("dc")     # my counterpart in every dc   (traffic filed under "dc")
    topo.predict("allreduce.ring", 16 << 20, "dc")   # α–β seconds on the dc links

The α–β model (Hockney 1994; Thakur, Rabenseifner & Gropp 2005): one message of n bytes on a
level costs ``α + n/β``; a collective costs ``rounds·α + bytes_sent/β`` with the rounds of
:func:`lowcomm.ledger.latency_rounds`.
"""
from __future__ import annotations

import os
import re
import weakref
from dataclasses import dataclass, field

from .errors import ConfigError, LowcommError
from .ledger import latency_rounds, wire_bytes

_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]*$")
_LINK = re.compile(r"^(?P<a>[0-9.]+(?:e-?[0-9]+)?)(?P<au>us|ms|s)/(?P<b>[0-9.]+(?:e-?[0-9]+)?)"
                   r"(?P<bu>kbit|mbit|gbit|mb|gb)$", re.IGNORECASE)
_TIME_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
_RATE_UNITS = {"kbit": 1e3 / 8, "mbit": 1e6 / 8, "gbit": 1e9 / 8, "mb": 1 << 20, "gb": 1 << 30}


@dataclass(frozen=True)
class LinkModel:
    """α–β model of one level's links: ``alpha_s`` seconds per message, ``bytes_per_s`` per byte.

    ``source`` says where the figures come from: "assumed", "config", "probe" or "wan"."""
    alpha_s: float
    bytes_per_s: float
    source: str = "assumed"

    def seconds(self, nbytes: float, rounds: int = 1) -> float:
        return rounds * self.alpha_s + nbytes / self.bytes_per_s

    def __str__(self) -> str:
        return (f"α={self.alpha_s * 1e6:.1f} µs, β={self.bytes_per_s * 8 / 1e6:.1f} Mbit/s "
                f"({self.source})")

    @classmethod
    def parse(cls, text: str, source: str = "config") -> "LinkModel":
        """``"25ms/100mbit"`` -> α = 25 ms, β = 100 Mbit/s (units: us|ms|s / kbit|mbit|gbit|mb|gb)."""
        m = _LINK.match(text.strip())
        if not m:
            raise ValueError(f"cannot read link {text!r}; use e.g. 25ms/100mbit or 2us/5gb")
        a = float(m["a"]) * _TIME_UNITS[m["au"].lower()]
        b = float(m["b"]) * _RATE_UNITS[m["bu"].lower()]
        if b <= 0 or a < 0:
            raise ValueError(f"link {text!r}: needs α >= 0 and β > 0")
        return cls(a, b, source)


# Used where nothing was measured or given; `lowcomm topo` marks them "assumed".
ASSUMED_LINKS = {"rank": LinkModel(2e-6, 5e9), "node": LinkModel(20e-6, 1.25e9),
                 "dc": LinkModel(25e-3, 100e6 / 8)}
_DEFAULT_LINK = LinkModel(20e-6, 1.25e9)


@dataclass
class Topology:
    """Named levels (outermost first) and the unit path of every world rank.

    Args:
        names: level names, outermost first; the last names the ranks themselves.
        paths: for world rank r, ``paths[r]`` holds the global id of its unit at every level but
            the last (``len(names) - 1`` ints).
        links: α–β model per level name (missing levels use :data:`ASSUMED_LINKS`).
        source: how the topology was found (for ``lowcomm topo``).
    """
    names: tuple[str, ...]
    paths: list[tuple[int, ...]]
    links: dict[str, LinkModel] = field(default_factory=dict)
    source: str = "spec"

    def __post_init__(self):
        self.names = tuple(self.names)
        self.paths = [tuple(p) for p in self.paths]
        if not self.names:
            raise ConfigError("topology", "needs at least one level")
        for n in self.names:
            if not _NAME.match(n):
                raise ConfigError("topology", f"bad level name {n!r} (letters, digits, _ and -)")
        if len(set(self.names)) != len(self.names):
            raise ConfigError("topology", f"level names repeat: {','.join(self.names)}")
        for r, p in enumerate(self.paths):
            if len(p) != len(self.names) - 1:
                raise ConfigError("topology", f"rank {r} has a path of {len(p)} units for "
                                  f"{len(self.names)} levels")
        self._world = None        # the Comm it is attached to (weak)
        self._comms: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()

    # construction -----------------------------------------------------------------------------
    @classmethod
    def parse(cls, spec: str, links: dict[str, LinkModel] | None = None) -> "Topology":
        """Read ``"dc:2,node:1,rank:2"`` (see the module docstring). Raises ConfigError naming
        ``topology``."""
        names, counts, given = [], [], dict(links or {})
        for entry in spec.replace(" ", "").split(","):
            name, colon, rest = entry.partition(":")
            if not colon or not name or not rest:
                raise ConfigError("topology", f"{spec!r}: entry {entry!r} must look like name:count "
                                  "(e.g. dc:2,rank:2)")
            count, at, link = rest.partition("@")
            try:
                parts = [int(c) for c in count.split("+")]
            except ValueError:
                raise ConfigError("topology", f"{spec!r}: count {count!r} of level {name!r} must "
                                  "be an integer or counts joined by '+'") from None
            if any(c < 1 for c in parts):
                raise ConfigError("topology", f"{spec!r}: level {name!r} counts must be >= 1")
            if at:
                try:
                    given[name] = LinkModel.parse(link)
                except ValueError as e:
                    raise ConfigError("topology", f"{spec!r}: level {name!r}: {e}") from None
            names.append(name)
            counts.append(parts)
        # expand: units[i] = list of parent unit ids, one per unit of level i
        parents = [0]            # level -1: the world
        unit_paths: list[tuple[int, ...]] = [()]
        for i, (name, parts) in enumerate(zip(names, counts)):
            if len(parts) == 1:
                parts = parts * len(parents)
            if len(parts) != len(parents):
                above = names[i - 1] if i else "world"
                raise ConfigError("topology", f"{spec!r}: level {name!r} lists {len(parts)} counts "
                                  f"for {len(parents)} units of {above!r}")
            new_paths = []
            for path, c in zip(unit_paths, parts):
                for _ in range(c):
                    new_paths.append((*path, len(new_paths)))
            parents, unit_paths = list(range(len(new_paths))), new_paths
        return cls(tuple(names), [p[:-1] for p in unit_paths], given, source=f"spec {spec}")

    @classmethod
    def from_env(cls, comm, spec: str = "") -> "Topology":
        """The run's topology: ``spec`` if given, else ``$LOWCOMM_TOPOLOGY``, else Slurm's
        ``SLURM_NODEID``, else the hostfile in ``$LOWCOMM_HOSTFILE``, else MPI's shared-memory
        split. Collective over ``comm`` when it has to ask the other ranks."""
        spec = spec or os.environ.get("LOWCOMM_TOPOLOGY", "")
        if spec:
            topo = cls.parse(spec)
            if os.environ.get("LOWCOMM_TOPOLOGY") == spec:
                topo.source = f"$LOWCOMM_TOPOLOGY={spec}"
        elif "SLURM_NODEID" in os.environ:
            topo = cls.from_keys(comm.allgather_object(int(os.environ["SLURM_NODEID"])),
                                 source="SLURM_NODEID")
        elif os.environ.get("LOWCOMM_HOSTFILE"):
            topo = cls.from_hostfile(os.environ["LOWCOMM_HOSTFILE"])
        else:
            topo = cls.discover(comm)
        topo.check_size(comm.size)
        return topo

    @classmethod
    def from_keys(cls, keys: list, names: tuple[str, str] = ("node", "rank"),
                  source: str = "keys") -> "Topology":
        """Two levels from one key per world rank (ranks with equal keys share a node)."""
        ids: dict = {}
        return cls(names, [(ids.setdefault(k, len(ids)),) for k in keys], source=source)

    @classmethod
    def discover(cls, comm) -> "Topology":
        """Nodes = groups of ranks that can share memory (``MPI_Comm_split_type`` with
        ``MPI_COMM_TYPE_SHARED``); collective over ``comm``."""
        from .comm import mpi
        MPI = mpi()
        shared = comm.mpi.Split_type(MPI.COMM_TYPE_SHARED, comm.rank)
        leader = shared.bcast(comm.rank, root=0)   # the node's lowest rank names it
        shared.Free()
        return cls.from_keys(comm.allgather_object(leader), source="MPI_COMM_TYPE_SHARED")

    @classmethod
    def from_hostfile(cls, path: str) -> "Topology":
        """Nodes from an Open MPI hostfile (``host slots=N`` lines, by-slot placement)."""
        counts = []
        try:
            lines = open(path).read().splitlines()
        except OSError as e:
            raise ConfigError("topology", f"hostfile {path!r}: {e.strerror}") from None
        for line in lines:
            line = line.split("#")[0].strip()
            if not line:
                continue
            m = re.search(r"slots\s*=\s*(\d+)", line)
            counts.append(int(m.group(1)) if m else 1)
        if not counts:
            raise ConfigError("topology", f"hostfile {path!r} names no host")
        topo = cls.parse(f"node:{len(counts)},rank:{'+'.join(map(str, counts))}")
        topo.source = f"hostfile {path}"
        return topo

    def check_size(self, size: int) -> None:
        if len(self.paths) != size:
            raise ConfigError("topology", f"{self.spec()!r} places {len(self.paths)} ranks but "
                              f"the job has {size}")

    # description ------------------------------------------------------------------------------
    @property
    def size(self) -> int:
        return len(self.paths)

    def units(self, level: str) -> list[list[int]]:
        """The world ranks of every unit of ``level`` (for the innermost level: one rank each)."""
        i = self._index(level)
        if i == len(self.names) - 1:
            return [[r] for r in range(self.size)]
        out: dict[int, list[int]] = {}
        for r, p in enumerate(self.paths):
            out.setdefault(p[i], []).append(r)
        return list(out.values())

    def spec(self) -> str:
        """The canonical spec string (counts per parent, ``+`` where they differ)."""
        parts = []
        for i, name in enumerate(self.names):
            if i == len(self.names) - 1:
                per_parent = [len(u) for u in self.units(self.names[i - 1])] if i else [self.size]
            else:
                kids: dict = {}
                for p in self.paths:
                    kids.setdefault(p[:i], set()).add(p[i])
                per_parent = [len(v) for v in kids.values()]
            counts = str(per_parent[0]) if len(set(per_parent)) == 1 else "+".join(map(str, per_parent))
            parts.append(f"{name}:{counts}")
        return ",".join(parts)

    def link(self, level: str) -> LinkModel:
        self._index(level)
        return self.links.get(level) or ASSUMED_LINKS.get(level, _DEFAULT_LINK)

    def level_of(self, a: int, b: int) -> str:
        """The level whose links a message from world rank ``a`` to ``b`` crosses."""
        for i, (x, y) in enumerate(zip(self.paths[a], self.paths[b])):
            if x != y:
                return self.names[i]
        return self.names[-1]

    def _index(self, level: str) -> int:
        if level not in self.names:
            raise ConfigError("topology", f"no level {level!r}; levels: {', '.join(self.names)}")
        return self.names.index(level)

    def __str__(self) -> str:
        return self.spec()

    # the α–β model ----------------------------------------------------------------------------
    def group_size(self, level: str) -> int:
        """Ranks in the largest peer group of ``level`` (units of ``level`` in one parent)."""
        i = self._index(level)
        if i == len(self.names) - 1:
            return max(len(u) for u in (self.units(self.names[i - 1]) if i else [range(self.size)]))
        kids: dict = {}
        for p in self.paths:
            kids.setdefault(p[:i], set()).add(p[i])
        return max(len(v) for v in kids.values())

    def predict(self, op: str, nbytes: int, level: str, size: int | None = None) -> float:
        """α–β seconds of one ``op`` (e.g. ``"allreduce.ring"``, ``"send"``) on ``nbytes`` per
        rank among ``size`` ranks (default: the level's peer group) joined by ``level``'s links."""
        k = size or self.group_size(level)
        family = op.split(".")[0]
        if family in ("send", "recv", "sendrecv"):
            sent = nbytes
        else:
            sent = wire_bytes(family, nbytes, k)[0]
        return self.link(level).seconds(sent, latency_rounds(op, k))

    def model_seconds(self, rows: list[dict]) -> dict[str, float]:
        """Modelled seconds of ledger ``rows`` (``Ledger.rows()``) per level, plus ``"total"``:
        Σ rounds·α + bytes_sent/β with each row's level's α, β and peer-group size. Rows of
        levels this topology does not know (``world``, ``control``) are left out."""
        out = {n: 0.0 for n in self.names}
        for r in rows:
            if r["level"] not in out:
                continue
            k = self.group_size(r["level"])
            out[r["level"]] += self.link(r["level"]).seconds(
                r["bytes_sent"], latency_rounds(r["op"], k) * r["calls"])
        out["total"] = sum(out.values())
        return out

    # communicators ----------------------------------------------------------------------------
    def attach(self, comm) -> "Topology":
        """Make this the topology of ``comm`` (and of its duplicates): ``hierarchical``
        all-reduces on them use it, and :meth:`group`/:meth:`peers` default to it."""
        self.check_size(comm.size)
        comm.topology = self
        self._world = weakref.ref(comm)
        _ATTACHED[:] = [self]
        return self

    def _comm(self, comm):
        comm = comm or (self._world() if self._world else None)
        if comm is None:
            raise LowcommError("topology: no communicator given and none attached (call attach)")
        self.check_size(comm.size)
        return comm

    def group(self, level: str, comm=None):
        """Comm of every rank in my unit of ``level`` (``group("dc")``: my datacenter), filed
        under the next level inward. Collective over ``comm`` on first use; cached."""
        comm = self._comm(comm)
        i = self._index(level)
        if i == len(self.names) - 1:
            raise ConfigError("topology", f"group({level!r}): the innermost level is one rank")
        key = ("group", level)
        cache = self._comms.setdefault(comm, {})
        if key not in cache:
            cache[key] = comm.split(self.paths[comm.rank][i], comm.rank, level=self.names[i + 1])
        return cache[key]

    def peers(self, level: str, comm=None):
        """Comm of the ranks at my position in each unit of ``level`` inside my parent unit
        (``peers("dc")``: my counterpart in every datacenter), filed under ``level``. With
        unequal units, ranks past a smaller unit's size have no counterpart there (use the
        ``hierarchical`` all-reduce for a full reduction). Collective; cached."""
        comm = self._comm(comm)
        i = self._index(level)
        key = ("peers", level)
        cache = self._comms.setdefault(comm, {})
        if key not in cache:
            unit = (lambda r: self.paths[r][i]) if i < len(self.names) - 1 else (lambda r: r)
            seen: dict[int, int] = {}          # ranks counted so far per unit: the position
            colors: dict[tuple, int] = {}
            for r in range(self.size):
                position = seen[unit(r)] = seen.get(unit(r), -1) + 1
                c = colors.setdefault((self.paths[r][:i], position), len(colors))
                if r == comm.rank:
                    color = c
            cache[key] = comm.split(color, comm.rank, level=level)
        return cache[key]

    def plan(self, comm) -> "_Plan":
        """The hierarchical all-reduce's communicators for ``comm`` (built once; collective)."""
        comm = self._comm(comm)
        cache = self._comms.setdefault(comm, {})
        if "plan" not in cache:
            cache["plan"] = _Plan(comm, self.names, self.paths)
        return cache["plan"]


_ATTACHED: list[Topology] = []       # the run's topology (one per process)


def topology_of(comm) -> Topology:
    """The topology of ``comm``: its own (``attach``), the run's one when ``comm`` holds the same
    ranks in the same order (a ``dup`` of the attached world), else one read from the
    environment (:meth:`Topology.from_env`, collective) and attached."""
    topo = getattr(comm, "topology", None)
    if topo is not None:
        return topo
    if _ATTACHED and _ATTACHED[0]._world is not None:
        world = _ATTACHED[0]._world()
        if world is not None and world.size == comm.size:
            from .comm import mpi
            MPI = mpi()
            if MPI.Group.Compare(world.mpi.Get_group(), comm.mpi.Get_group()) == MPI.IDENT:
                comm.topology = _ATTACHED[0]
                return _ATTACHED[0]
    topo = Topology.from_env(comm)
    comm.topology = topo
    if topo._world is None:
        topo._world = weakref.ref(comm)
    return topo


class _Plan:
    """One step of the hierarchical all-reduce over ``comm`` whose ranks sit at ``paths``.

    ``inner``: the ranks of my innermost group (level ``names[-1]``). The buffer is cut into
    S = (largest group) shards; in a group of s ranks, local rank l owns shards j ≡ l (mod s).
    ``cross``: one entry per distinct owner pattern: the shards, and the Comm of their owners
    (one rank per group, ordered by group) with the next step of the plan over it.
    """

    def __init__(self, comm, names: tuple[str, ...], paths: list[tuple[int, ...]]):
        self.names = names
        if len(names) == 1:       # one level left: a flat all-reduce among these ranks
            self.flat = comm.split(0, comm.rank, level=names[0])
            return
        self.flat = None
        groups: dict[tuple, list[int]] = {}
        for r, p in enumerate(paths):
            groups.setdefault(p, []).append(r)
        order = list(groups)
        gi = order.index(paths[comm.rank])
        sizes = [len(groups[p]) for p in order]
        self.inner = comm.split(gi, comm.rank, level=names[-1])
        self.shards = max(sizes)
        local = self.inner.rank
        sigs: dict[tuple, list[int]] = {}
        for j in range(self.shards):
            sigs.setdefault(tuple(j % s for s in sizes), []).append(j)
        # blocks[l]: the shards local rank l of my group owns
        self.owned = [[j for j in range(self.shards) if j % sizes[gi] == l] for l in range(sizes[gi])]
        self.cross = []
        sub_paths = [p[:-1] for p in order]
        for sig, shards in sigs.items():
            member = sig[gi] == local
            sub = comm.split(0 if member else -1, gi, level=names[-2])
            if member:
                self.cross.append((shards, _Plan(sub, names[:-1], sub_paths)))

    def run(self, buf):
        import torch

        from .collectives import chunk_bounds, ring
        if self.flat is not None:
            f = self.flat
            if f.size == 2:    # two parties: swap whole buffers and add: the ring's bytes, one round
                with f.ledger.scope("allreduce.exchange", f.level):
                    tmp = torch.empty_like(buf)
                    f.sendrecv_(buf, 1 - f.rank, tmp, 1 - f.rank)
                    buf.add_(tmp)
            else:
                with f.ledger.scope("allreduce.ring", f.level):
                    ring(f, buf)
            return buf
        b = chunk_bounds(buf.numel(), self.shards)
        blocks = [[(b[j], b[j + 1]) for j in owned] for owned in self.owned]
        inner = self.inner
        if inner.size > 1:
            with inner.ledger.scope("reduce_scatter.ring", inner.level):
                _ring_reduce_scatter(inner, buf, blocks)
        for shards, sub in self.cross:
            ranges = [(b[j], b[j + 1]) for j in shards]
            if len(ranges) == 1:
                sub.run(buf[ranges[0][0]:ranges[0][1]])
            else:
                tmp = _gather(buf, ranges)
                sub.run(tmp)
                _scatter(buf, ranges, tmp)
        if inner.size > 1:
            with inner.ledger.scope("allgather.ring", inner.level):
                _ring_allgather(inner, buf, blocks)
        return buf


def _gather(buf, ranges):
    import torch
    if len(ranges) == 1:
        return buf[ranges[0][0]:ranges[0][1]]
    return torch.cat([buf[lo:hi] for lo, hi in ranges]) if ranges else buf[:0]


def _scatter(buf, ranges, src, add: bool = False) -> None:
    off = 0
    for lo, hi in ranges:
        part = src[off:off + hi - lo]
        buf[lo:hi].add_(part) if add else buf[lo:hi].copy_(part)
        off += hi - lo


def _count(ranges) -> int:
    return sum(hi - lo for lo, hi in ranges)


def _ring_reduce_scatter(comm, buf, blocks) -> None:
    """Ring reduce-scatter over blocks of any sizes (Thakur, Rabenseifner & Gropp 2005 §4.5):
    for s = 0..K-2 rank r sends block (r-s-1) mod K to r+1 and adds block (r-s-2) mod K from
    r-1 into its own copy; rank r then holds the sum of block r."""
    import torch
    K, r = comm.size, comm.rank
    right, left = (r + 1) % K, (r - 1) % K
    tmp = torch.empty(max(_count(x) for x in blocks), dtype=buf.dtype)
    for s in range(K - 1):
        out = _gather(buf, blocks[(r - s - 1) % K]).contiguous()
        into = blocks[(r - s - 2) % K]
        got = tmp[:_count(into)]
        comm.sendrecv_(out, right, got, left)
        _scatter(buf, into, got, add=True)


def _ring_allgather(comm, buf, blocks) -> None:
    """Ring all-gather: for s = 0..K-2 rank r sends block (r-s) mod K to r+1 and stores block
    (r-s-1) mod K from r-1."""
    import torch
    K, r = comm.size, comm.rank
    right, left = (r + 1) % K, (r - 1) % K
    tmp = torch.empty(max(_count(x) for x in blocks), dtype=buf.dtype)
    for s in range(K - 1):
        out = _gather(buf, blocks[(r - s) % K]).contiguous()
        into = blocks[(r - s - 1) % K]
        if len(into) == 1:
            comm.sendrecv_(out, right, buf[into[0][0]:into[0][1]], left)
        else:
            got = tmp[:_count(into)]
            comm.sendrecv_(out, right, got, left)
            _scatter(buf, into, got)
