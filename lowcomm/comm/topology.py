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

A topology is data: it makes no MPI call until :meth:`Topology.comms` builds, collectively and
once, the communicators of every level (a :class:`Levels`), which the callers that need them
(per-level policies, the ``hierarchical`` all-reduce) are handed explicitly::

    topo = Topology.parse("dc:2,rank:2")
    levels = topo.comms(comm)       # collective over comm
    inside = levels.group("dc")     # all ranks of my datacenter   (traffic filed under "rank")
    across = levels.peers("dc")     # my counterpart in every dc   (traffic filed under "dc")
    lowcomm.allreduce_(t, comm, "hierarchical", levels=levels)
    topo.predict("allreduce.ring", 16 << 20, "dc")   # α–β seconds on the dc links

The α–β model (Hockney 1994; Thakur, Rabenseifner & Gropp 2005): one message of n bytes on a
level costs ``α + n/β``; a collective costs ``rounds·α + bytes_sent/β`` with the rounds of
:func:`lowcomm.comm.ledger.latency_rounds`.
"""
from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from ..errors import ConfigError, EnvError
from .ledger import latency_rounds, wire_bytes
from .roles import LevelSet

if TYPE_CHECKING:   # a topology is data; only Topology.comms touches communicators
    from .comm import Comm
    from .ledger import Ledger

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
        split. Collective over ``comm`` when it has to ask the other ranks. An error in what an
        environment variable says names that variable (:class:`~lowcomm.errors.EnvError`)."""
        from_env = "" if spec else os.environ.get("LOWCOMM_TOPOLOGY", "")
        env = None                      # the environment variable the topology comes from
        try:
            if spec or from_env:
                env = "LOWCOMM_TOPOLOGY" if from_env else None
                topo = cls.parse(spec or from_env)
                if from_env:
                    topo.source = f"$LOWCOMM_TOPOLOGY={from_env}"
            elif "SLURM_NODEID" in os.environ:
                topo = cls.from_keys(comm.allgather_object(int(os.environ["SLURM_NODEID"])),
                                     source="SLURM_NODEID")
            elif os.environ.get("LOWCOMM_HOSTFILE"):
                env = "LOWCOMM_HOSTFILE"
                topo = cls.from_hostfile(os.environ["LOWCOMM_HOSTFILE"])
            else:
                topo = cls.discover(comm)
            topo.check_size(comm.size)
        except ConfigError as e:
            if env is None:
                raise
            raise EnvError(env, os.environ[env], e.reason) from None
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
        shared = comm.split_shared()
        leader = shared.bcast_object(comm.rank, root=0)   # the node's lowest rank names it
        shared.free()
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
    def comms(self, world: Comm) -> "Levels":
        """Build every level's communicators over ``world`` (collective; every rank calls it
        once, in the same order as its other collectives): see :class:`Levels`."""
        self.check_size(world.size)
        return Levels(self, world)


class Levels(LevelSet):
    """The communicators of a :class:`Topology` over one world communicator, built collectively
    by :meth:`Topology.comms`. Traffic goes to ``world``'s ledger, filed under each level's name.

    * :meth:`group` (level): every rank in my unit of ``level`` (``group("dc")``: my datacenter),
      filed under the next level inward;
    * :meth:`peers` (level): the ranks at my position in each unit of ``level`` inside my parent
      unit (``peers("dc")``: my counterpart in every datacenter), filed under ``level``. With
      unequal units, ranks past a smaller unit's size have no counterpart there (use the
      ``hierarchical`` all-reduce for a full reduction);
    * :attr:`hierarchy`: the hierarchical all-reduce's communicators (:class:`Hierarchy`), for
      :func:`lowcomm.comm.collectives.hierarchical`.

    ``levels[level]`` is ``peers(level)``: the Comm whose traffic crosses that level's links.
    A :class:`~lowcomm.comm.roles.LevelSet`.
    """

    whole = None             # every rank of every unit is ``world``

    def __init__(self, topology: Topology, world: Comm):
        self.topology, self.world = topology, world
        names, i_last = topology.names, len(topology.names) - 1
        world.link = topology.link(names[0])     # a world collective crosses the outermost links
        self._groups = {lvl: world.split(topology.paths[world.rank][i], world.rank, level=names[i + 1])
                        for i, lvl in enumerate(names) if i < i_last}
        self._peers = {lvl: world.split(self._peer_color(i), world.rank, level=lvl)
                       for i, lvl in enumerate(names)}
        self.hierarchy = Hierarchy.build(world, names, topology.paths,
                                         {lvl: topology.link(lvl) for lvl in names})
        for i, lvl in enumerate(names):          # the links each communicator's traffic crosses
            if self._peers[lvl] is not None:
                self._peers[lvl].link = topology.link(lvl)
            if lvl in self._groups and self._groups[lvl] is not None:
                self._groups[lvl].link = topology.link(names[i + 1])
        world.link = topology.link(names[0])     # a world collective crosses the outermost links

    def _peer_color(self, i: int) -> int:
        t, me = self.topology, self.world.rank
        unit = (lambda r: t.paths[r][i]) if i < len(t.names) - 1 else (lambda r: r)
        seen: dict[int, int] = {}          # ranks counted so far per unit: the position
        colors: dict[tuple, int] = {}
        for r in range(t.size):
            position = seen[unit(r)] = seen.get(unit(r), -1) + 1
            c = colors.setdefault((t.paths[r][:i], position), len(colors))
            if r == me:
                color = c
        return color

    def group(self, level: str) -> Comm:
        self.topology._index(level)
        if level not in self._groups:
            raise ConfigError("topology", f"group({level!r}): the innermost level is one rank")
        return self._groups[level]

    def peers(self, level: str) -> Comm:
        self.topology._index(level)
        return self._peers[level]

    def rank_peers(self, level: str) -> Comm:
        """Rank i of every unit at ``level``: :meth:`peers` (a unit's ranks are placed alike)."""
        return self.peers(level)

    def __getitem__(self, level: str) -> Comm:
        return self.peers(level)

    def dup(self, ledger: Ledger | None = None) -> "Levels":
        """The same levels over a duplicate of ``world`` (collective): a separate message space
        (e.g. for a reduction thread), charged to ``ledger`` if given."""
        return Levels(self.topology, self.world.dup(ledger))


class Hierarchy:
    """The communicators of one step of the hierarchical all-reduce over ranks at ``paths``
    (built by :meth:`build`; run by :func:`lowcomm.comm.collectives.hierarchical`).

    ``flat``: with one level left, the Comm of all these ranks (a flat all-reduce), else None.
    ``inner``: the ranks of my innermost group (level ``names[-1]``). The buffer is cut into
    ``shards`` = (largest group) shards; in a group of s ranks, local rank l owns shards
    j ≡ l (mod s): ``owned[l]``. ``cross``: one entry per distinct owner pattern that I belong
    to: the shards, and the :class:`Hierarchy` one level up over their owners (one rank per
    group, ordered by group).
    """

    def __init__(self, names, flat=None, inner=None, shards=0, owned=(), cross=()):
        self.names, self.flat, self.inner = names, flat, inner
        self.shards, self.owned, self.cross = shards, list(owned), list(cross)

    @classmethod
    def build(cls, comm: Comm, names: tuple[str, ...], paths: list[tuple[int, ...]],
              links: dict | None = None) -> "Hierarchy":
        """Split ``comm`` (whose rank r sits at ``paths[r]``) into the step's communicators
        (collective over ``comm``); ``links``: each level's α–β link, set on the communicators
        whose traffic crosses it (the watchdog's limits read them)."""
        def linked(c, level):
            if c is not None and links and level in links:
                c.link = links[level]
            return c
        if len(names) == 1:       # one level left: a flat all-reduce among these ranks
            return cls(names, flat=linked(comm.split(0, comm.rank, level=names[0]), names[0]))
        groups: dict[tuple, list[int]] = {}
        for r, p in enumerate(paths):
            groups.setdefault(p, []).append(r)
        order = list(groups)
        gi = order.index(paths[comm.rank])
        sizes = [len(groups[p]) for p in order]
        inner = linked(comm.split(gi, comm.rank, level=names[-1]), names[-1])
        shards = max(sizes)
        local = inner.rank
        sigs: dict[tuple, list[int]] = {}
        for j in range(shards):
            sigs.setdefault(tuple(j % s for s in sizes), []).append(j)
        owned = [[j for j in range(shards) if j % sizes[gi] == l] for l in range(sizes[gi])]
        cross = []
        sub_paths = [p[:-1] for p in order]
        for sig, mine in sigs.items():
            member = sig[gi] == local
            sub = linked(comm.split(0 if member else -1, gi, level=names[-2]), names[-2])
            if member:
                cross.append((mine, cls.build(sub, names[:-1], sub_paths, links)))
        return cls(names, inner=inner, shards=shards, owned=owned, cross=cross)
