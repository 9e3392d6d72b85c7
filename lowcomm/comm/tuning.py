"""``algorithm = "auto"``: pick the fastest all-reduce for each message size, rank count and level.

Autotuning from measurements in the manner of MPICH / Open MPI's tuned decision tables
(Vadhiyar, Fagg & Dongarra 2000, "Automatically tuned collective communications"; Pješivac-
Grbović et al. 2007, "Performance analysis of MPI collective operations"), with the α–β model
(Hockney 1994; Thakur, Rabenseifner & Gropp 2005) where nothing was measured.

The rule, for an all-reduce of n bytes over a Comm of K ranks:

1. **Table.** ``lowcomm bench allreduce --tune`` times every candidate (``mpi``, ``ring``,
   ``rabenseifner``, ``tree``, ``shm``; ``hierarchical`` when a topology with more than one
   level is given) at sizes 4 KiB .. 64 MiB on K ranks of one node and writes
   :func:`table_path` (``~/.cache/lowcomm/allreduce-<hostname>-<K>.json``; ``$XDG_CACHE_HOME``
   moves the folder, ``$LOWCOMM_ALLREDUCE_TABLE`` names a file or a folder instead). A Comm whose
   ranks share one node (:meth:`~lowcomm.comm.comm.Comm.node_local`) and whose size has a table
   uses it: the candidate with the least median time at the measured size nearest to n (in
   log₂ n), among those that can run here (``hierarchical`` only with the topology's
   communicators).
   Where the ranks share a node and no file exists, the first ``auto`` call measures the table
   itself (:func:`~lowcomm.comm.collectives.measure_table`: every candidate at every size, 3
   calls each; seconds) and writes it there: ``auto`` picks the fastest measured algorithm at
   every size from the first run on, and a resumed run decides as the first did
   (``$LOWCOMM_AUTOTUNE=0`` keeps the model below).
2. **Model**, where no table applies (ranks on several nodes, whose links the table never
   measured; or ``$LOWCOMM_AUTOTUNE=0`` and no file): the α–β time with the Comm's link (:attr:`Comm.link`, set by the
   topology; else the assumed intra-node link): ring 2(K-1)α + 2(K-1)/K·nβ, Rabenseifner
   2⌈log₂K⌉α + 2(K-1)/K·nβ, tree 2⌈log₂K⌉(α + nβ); ``mpi`` is modelled as the best of those
   three (the vendor has them all), and ties go to ``mpi``, so the model only leaves the vendor
   for what the vendor lacks: ``hierarchical`` given the topology (per level, the inner rings on
   the inner links and the outer all-reduce of n/g bytes on the outer links, by
   :meth:`Topology.predict`; the flat vendor all-reduce is charged the outermost link). The
   model never picks ``shm``: on paper (1 barrier for segments up to
   ``collectives.SHM_ONE_SYNC_BYTES``, else 2 per segment, each costing α, plus 2(K-1)/K·nβ) it
   beats the vendor at every size, but the vendor also reduces through shared memory, in C:
   measured on a 2-core machine, 4 ranks, the vendor was faster up to 1 MiB and shm from 4 MiB
   (0.43–0.97× and 1.12–2.34× the vendor's bus bandwidth, three runs). Only a measured table
   (rule 1) can say where shm wins on a given machine; :meth:`model_seconds` still gives its
   paper time.

All ranks must run the same algorithm, so the choice is never made from what one rank sees:
the first ``auto`` call on a Comm (collective) has rank 0 read the table and broadcast it with
the link and the node-local answer (:func:`agree`); every rank then decides from the same data.
"""
from __future__ import annotations

import json
import math
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import LowcommError

TABLE_ENV = "LOWCOMM_ALLREDUCE_TABLE"
#: "0": where no table exists, ``auto`` follows the α–β model instead of measuring one
AUTOTUNE_ENV = "LOWCOMM_AUTOTUNE"
#: every algorithm auto may pick, in the order ties are broken (vendor first)
CANDIDATES = ("mpi", "ring", "rabenseifner", "tree", "shm", "hierarchical")
#: the candidates of reduce-scatter's and all-gather's ``auto`` (a table names them "op.algorithm")
SCATTER_CANDIDATES = ("mpi", "ring", "shm")
SCATTER_OPS = ("reduce_scatter", "allgather")
#: the sizes ``lowcomm bench allreduce --tune`` measures (bytes): 4 KiB .. 64 MiB, ×4 apart
TUNE_SIZES = tuple(4096 << (2 * i) for i in range(8))
# the intra-node link assumed where the Comm has none (topology.ASSUMED_LINKS["rank"])
_LOCAL_ALPHA_S, _LOCAL_BYTES_PER_S = 2e-6, 5e9
# a link with at least this one-way latency joins different nodes (topology.ASSUMED_LINKS["node"]: 20 µs)
_NODE_ALPHA_S = 10e-6


def table_path(size: int, host: str | None = None) -> Path:
    """Where the table for ``size`` ranks on ``host`` (default: this one) lives."""
    name = f"allreduce-{host or socket.gethostname()}-{size}.json"
    given = os.environ.get(TABLE_ENV)
    if given:
        p = Path(given).expanduser()
        return p / name if p.is_dir() or given.endswith("/") else p
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "lowcomm" / name


def load_table(path: Path, size: int) -> dict | None:
    """The table at ``path`` (``{"ranks": K, "times_us": {bytes: {algorithm: µs}}}``), or None
    if there is no file. A file that cannot be read, or was measured on another rank count, is
    an error naming the path (never silently ignored)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise LowcommError(f"all-reduce table {path}: {e.strerror}") from None
    try:
        table = json.loads(text)
        times = {int(k): {a: float(t) for a, t in v.items()} for k, v in table["times_us"].items()}
        ranks = int(table["ranks"])
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise LowcommError(f"all-reduce table {path} is malformed ({e!r}); re-run "
                           f"'lowcomm bench allreduce --tune' or delete it") from None
    if ranks != size:
        raise LowcommError(f"all-reduce table {path} was measured on {ranks} ranks, this "
                           f"communicator has {size}; ${TABLE_ENV} names the wrong file?")
    known = {*CANDIDATES, *(f"{op}.{a}" for op in SCATTER_OPS for a in SCATTER_CANDIDATES)}
    unknown = {a for row in times.values() for a in row} - known
    if unknown or not times:
        raise LowcommError(f"all-reduce table {path}: {'no sizes' if not times else 'unknown algorithms ' + ', '.join(sorted(unknown))}")
    return {"path": str(path), "ranks": ranks, "times_us": times}


def save_table(path: Path, size: int, times_us: dict[int, dict[str, float]], about: dict) -> None:
    """Write a table (atomically: a reader never sees half a file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"ranks": size, **about, "times_us": {str(k): v for k, v in sorted(times_us.items())}}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(body, indent=1) + "\n")
    tmp.replace(path)


@dataclass
class Policy:
    """What every rank of one Comm decides ``auto`` from (identical on all of them)."""
    size: int
    node_local: bool
    alpha_s: float
    bytes_per_s: float
    table: dict | None = None
    shm_segment_bytes: int = 16 << 20      # the shm algorithm's parameters, for its model
    shm_one_sync_bytes: int = 256 << 10
    _cache: dict = field(default_factory=dict, repr=False)

    @property
    def source(self) -> str:
        return f"table {self.table['path']}" if self.table else "α–β model"

    def choose(self, nbytes: int, levels=None) -> str:
        """The algorithm for an all-reduce of ``nbytes`` (``levels``: the topology's
        communicators, making ``hierarchical`` a candidate)."""
        key = (nbytes, levels is not None)
        if key not in self._cache:
            self._cache[key] = self._choose(nbytes, levels)
        return self._cache[key]

    def candidates(self, levels) -> list[str]:
        out = ["mpi", "ring", "rabenseifner", "tree"]
        if self.node_local:
            out.append("shm")
        if levels is not None and len(levels.names) > 1 and levels.size == self.size:
            out.append("hierarchical")
        return out

    def _choose(self, nbytes: int, levels) -> str:
        if self.size == 1 or nbytes == 0:
            return "mpi"
        can = self.candidates(levels)
        if self.table:
            times = self.table["times_us"]
            near = min(times, key=lambda s: (abs(math.log2(s) - math.log2(max(nbytes, 1))), s))
            row = {a: t for a, t in times[near].items() if a in can}
            if row:
                return min(row, key=lambda a: (row[a], CANDIDATES.index(a)))
        # shm only from a measured table: the model cannot tell lowcomm's Python-level
        # shared-memory reduction from the vendor's C one (module docstring, rule 2)
        model = {a: self.model_seconds(a, nbytes, levels) for a in can if a != "shm"}
        return min(model, key=lambda a: (model[a], CANDIDATES.index(a)))

    def choose_scatter(self, op: str, nbytes: int) -> str:
        """The algorithm for a reduce-scatter or all-gather (``op``) of a ``nbytes`` buffer on
        one node's CPU: the fastest measured one at the nearest size where the table has ``op``'s
        rows, else ``shm`` (the α–β model cannot tell it from the vendor's; measured here it was
        the faster from 4 MiB, module docstring)."""
        key = (op, nbytes)
        if key not in self._cache:
            row = {}
            if self.table:
                sized = {s: r for s, r in self.table["times_us"].items()
                         if any(a.startswith(op + ".") for a in r)}
                if sized:
                    near = min(sized, key=lambda s: (abs(math.log2(s) - math.log2(max(nbytes, 1))), s))
                    row = {a.split(".", 1)[1]: t for a, t in sized[near].items()
                           if a.startswith(op + ".") and (self.node_local or a != op + ".shm")}
            self._cache[key] = min(row, key=lambda a: (row[a], SCATTER_CANDIDATES.index(a))) \
                if row else "shm"
        return self._cache[key]

    def model_seconds(self, algorithm: str, nbytes: int, levels=None) -> float:
        """α–β seconds of one all-reduce of ``nbytes`` with ``algorithm`` (see the module)."""
        K, a, b = self.size, self.alpha_s, 1.0 / self.bytes_per_s
        lg = max(1, (K - 1).bit_length())
        bw = 2 * (K - 1) / K * nbytes * b
        ring = 2 * (K - 1) * a + bw
        rab = 2 * lg * a + bw
        tree = 2 * lg * (a + nbytes * b)
        if algorithm == "ring":
            return ring
        if algorithm == "rabenseifner":
            return rab
        if algorithm == "tree":
            return tree
        if algorithm == "mpi":
            if levels is not None and len(levels.names) > 1:   # crosses the outermost links
                t = levels.topology
                return min(t.predict(f"allreduce.{x}", nbytes, t.names[0], size=K)
                           for x in ("ring", "rabenseifner"))
            return min(ring, rab, tree)
        if algorithm == "shm":
            segs = max(1, math.ceil(nbytes / self.shm_segment_bytes))
            syncs = 1 if nbytes <= self.shm_one_sync_bytes else 2 * segs
            return syncs * a + bw
        if algorithm == "hierarchical":
            return _hierarchical_seconds(levels.topology, nbytes)
        raise ValueError(f"auto cannot model algorithm {algorithm!r}")


def _hierarchical_seconds(topo, nbytes: int) -> float:
    """α–β time of the hierarchical all-reduce: ring reduce-scatter and all-gather of the bytes
    left at each level, inside its groups, then the outermost all-reduce of what remains."""
    total, left = 0.0, float(nbytes)
    for i in range(len(topo.names) - 1, 0, -1):
        level = topo.names[i]
        g = topo.group_size(level)
        if g > 1:
            total += topo.predict("reduce_scatter.ring", int(left), level, size=g)
            total += topo.predict("allgather.ring", int(left / g), level, size=g)
        left /= max(g, 1)
    return total + topo.predict("allreduce.ring", int(left), topo.names[0])


def agree(comm, measure=None, **shm) -> Policy:
    """The Comm's :class:`Policy`, agreed once (collective on first use; cached on the Comm):
    rank 0 reads the table for ``comm.size`` ranks if the ranks share a node and broadcasts
    it with its link, so every rank decides from the same data. Where the ranks share a node
    and no table exists, ``measure(comm)`` (collective: ``{bytes: {algorithm: µs}}``) measures
    one now and rank 0 writes it where the table is looked for, so that later runs (a resumed
    one) decide as this one (``$LOWCOMM_AUTOTUNE=0``: the α–β model instead). ``shm``: the
    shared-memory algorithm's ``shm_segment_bytes`` / ``shm_one_sync_bytes``."""
    if comm.auto_policy is not None:
        return comm.auto_policy
    node_local = comm.node_local()      # collective: every rank asks
    # a link slower than a node's (set by the topology: these ranks are on different nodes or
    # datacenters, e.g. an emulated WAN whose namespaces share this machine's memory) is never
    # crossed through shared memory, whatever MPI can map
    if comm.link is not None and comm.link.alpha_s >= _NODE_ALPHA_S:
        node_local = False
    mine = None
    if comm.rank == 0:
        link = comm.link
        alpha, bps = (link.alpha_s, link.bytes_per_s) if link is not None else \
            (_LOCAL_ALPHA_S, _LOCAL_BYTES_PER_S)
        error = None
        table = None
        if node_local and comm.size > 1:
            try:
                table = load_table(table_path(comm.size), comm.size)
            except LowcommError as e:
                error = str(e)
        mine = (alpha, bps, table, error)
    alpha, bps, table, error = comm.bcast_object(mine, root=0) if comm.size > 1 else mine
    if error:
        raise LowcommError(error)
    if table is None and node_local and comm.size > 1 and measure is not None and \
            os.environ.get(AUTOTUNE_ENV, "1") != "0":
        table = _measured(comm, measure)
    comm.auto_policy = Policy(comm.size, node_local, alpha, bps, table, **shm)
    return comm.auto_policy


def _measured(comm, measure) -> dict:
    """A table measured now by ``measure`` (collective), written by rank 0 (see :func:`agree`)."""
    import logging
    import time
    t0 = time.perf_counter()
    times = measure(comm)
    path = table_path(comm.size)
    if comm.rank == 0:
        try:
            save_table(path, comm.size, times, {"host": socket.gethostname(), "measured":
                                                time.strftime("%Y-%m-%d %H:%M:%S"),
                                                "by": "auto's first use", "loadavg": os.getloadavg()})
            where = f"written to {path}"
        except OSError as e:
            where = f"not written ({path}: {e.strerror})"
        logging.getLogger("lowcomm.tuning").info(
            "algorithm=auto: no all-reduce table for %d ranks on this node; measured one in %.1f s, "
            "%s (%s=0: the α–β model instead)", comm.size, time.perf_counter() - t0, where, AUTOTUNE_ENV)
    return {"path": str(path), "ranks": comm.size, "times_us": times}
