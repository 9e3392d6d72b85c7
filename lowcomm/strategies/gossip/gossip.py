"""Decentralized gossip SGD: every step each rank averages parameters with a few graph neighbours."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ...comm.collectives import broadcast_
from ...comm.comm import Comm
from ...errors import ArgumentError, ConfigError
from ...settings import Settings
from ..base import Strategy
from ..method import Context, Method, check_compressor_name
from ..buffers import Buffers, persistent_buffers
from .graphs import GRAPHS, Graph, build_graph
from .message import Layout, consensus_distance

MODES = ("dpsgd", "push-sum", "async")
ORDERS = ("cta", "atc")
TAG = 90_000                 # on the strategy's own duplicated communicator


@dataclass
class GossipOptions(Settings):
    """How :class:`Gossip` mixes (its keyword arguments ``mode``, ``order``, ``consensus_step``;
    the registry's :class:`GossipSettings` name them ``gossip_mode``, ``gossip_order``)."""
    mode: str = "dpsgd"            # "dpsgd" | "push-sum" | "async"
    order: str = "cta"             # "cta" | "atc"
    consensus_step: float = 1.0    # CHOCO's γ (with a compressor)

    def validate(self, prefix: str = "") -> None:
        if self.mode not in MODES:
            raise ConfigError.at(prefix, "mode", f"unknown gossip mode {self.mode!r}; known: "
                                 f"{', '.join(MODES)}")
        if self.order not in ORDERS:
            raise ConfigError.at(prefix, "order", f"unknown gossip order {self.order!r}; known: "
                                 f"{', '.join(ORDERS)}")
        if not 0 < self.consensus_step <= 1:
            raise ConfigError.at(prefix, "consensus_step", f"must be in (0, 1], got "
                                 f"{self.consensus_step}")


class Gossip(Strategy):
    """Gossip SGD over a peer graph: D-PSGD (Lian et al. 2017, arXiv 1705.09056), Stochastic
    Gradient Push (push-sum; Assran et al. 2019, arXiv 1811.10792), an asynchronous variant in the
    spirit of AD-PSGD (Lian et al. 2018, arXiv 1710.06952), and CHOCO compressed gossip
    (Koloskova et al. 2019, arXiv 1902.00340). No global collective: each rank talks only to its
    graph neighbours (:mod:`~lowcomm.strategies.gossip.graphs`) with non-blocking point-to-point messages,
    so its traffic per step is ``degree × model bytes`` whatever the number of ranks.

    Update on rank i in round t, with W the graph's doubly stochastic mixing matrix, ``N_in(i)``
    its in-peers and ``u(g)`` the wrapped optimizer's update for gradient g:

    ``mode="dpsgd"``, ``order="cta"`` (combine-then-adapt, Lian et al. 2017, the default):

      1. at ``zero_grad()``, post ``isend(x_i)`` to the out-peers and ``irecv`` from the in-peers,
         so the exchange runs while forward and backward compute ``g_i = ∇F_i(x_i)``;
      2. at ``step()``, wait and mix: ``x_i ← Σ_{j ∈ {i} ∪ N_in(i)} W_ij x_j``;
      3. ``x_i ← x_i − u(g_i)`` (the gradient of the pre-mix ``x_i``, as in the paper).

    ``order="atc"`` (adapt-then-combine): 1. ``x_i ← x_i − u(g_i)``; 2. exchange and mix; the
    exchange cannot overlap this step's compute. On the complete graph with (momentum) SGD this is
    exactly SyncDP.

    ``mode="push-sum"`` (SGP; any strongly connected digraph, weights need no doubly stochastic W):
    each rank keeps a numerator ``x_i`` and a weight ``w_i`` (start 1), the model holds
    ``z_i = x_i / w_i``:

      1. (atc) ``z_i ← z_i − u(∇F_i(z_i))``, ``x_i = w_i z_i``;
      2. send ``(x_i, w_i)/(d_out+1)`` to each out-peer, keep one share;
      3. ``x_i ← Σ received shares``, ``w_i ← Σ received weights``, ``z_i = x_i / w_i``.

    (``order="cta"`` sends at ``zero_grad()`` and steps after mixing, as for D-PSGD.) On regular
    graphs every ``w_i`` stays 1 and this is D-PSGD; messages carry 8 extra bytes for ``w``.

    ``mode="async"`` (never waits for a neighbour): rank i, each step,

      1. takes whatever ``(x_j, w_j)`` messages have arrived since the last step and adds them:
         ``x_i ← w_i z_i + Σ x_j``, ``w_i ← w_i + Σ w_j`` (the model it computed its gradient on
         is therefore stale by up to the messages absorbed, as in AD-PSGD);
      2. ``z_i ← z_i − u(g_i)``;
      3. if its previous message to this round's peer has been delivered, sends it half of its
         mass ``(w_i z_i/2, w_i/2)`` and keeps the other half (one peer per step, cycling
         through the graph's out-peers).

    Unlike AD-PSGD's atomic pairwise average (which needs a responder thread on the passive
    side), the push-sum weights keep the network average exact however messages are delayed.
    The trajectory depends on timing, so a resumed async run is not bit-identical to an
    uninterrupted one; a checkpoint drains the messages in flight into the saved state.

    Compressed gossip (``compressor`` given; CHOCO-SGD, Koloskova et al. 2019; D-PSGD mode on a
    static graph): every rank keeps a public copy ``x̂_i`` that its neighbours track and
    ``s_i = Σ_j W_ij x̂_j``;

      1. ``q_i = Q(x_i − x̂_i)``, sent to the neighbours (the compressor's payload);
      2. ``x̂_i ← x̂_i + q_i``, ``s_i ← s_i + Σ_{j ∈ {i} ∪ N_in(i)} W_ij q_j``;
      3. ``x_i ← x_i + γ (s_i − x̂_i)`` with ``γ = consensus_step``.

    With the identity compressor and γ = 1 this is plain D-PSGD.

    The method's parameters (:meth:`~lowcomm.strategies.base.Strategy.members`: the trainable
    ones and the frozen ones the optimizer holds; a frozen one costs its bytes every round, and
    unfrozen later it is gossiped like the others) and floating-point buffers (BatchNorm's running
    statistics) are gossiped — buffers are mixed like parameters, plus (``cta``) their own
    update by the forward pass that ran while the exchange was in flight; integer buffers are
    rank 0's at :meth:`finish`; initial parameters
    and buffers are broadcast from rank 0. Gossip traffic is charged in the ledger as one op
    ``gossip.<mode>`` (``gossip.choco``) call per round.

    Args:
        model, optimizer: the user's torch objects.
        comm: communicator (default: world); gossip runs on a duplicate of it (same ledger).
        graph: a name from ``GRAPHS`` or a :class:`~lowcomm.strategies.gossip.graphs.Graph`.
        mode: "dpsgd", "push-sum" or "async".
        order: "cta" (exchange overlapped with forward/backward) or "atc" (after the local step).
        compressor: a :class:`~lowcomm.compress.Compressor` for CHOCO gossip (None: dense).
        consensus_step: CHOCO's γ in (0, 1]; only with a compressor.

    Example::

        opt = Gossip(model, torch.optim.SGD(model.parameters(), lr=0.1), graph="one-peer-exponential")
        for x, y in batches:
            opt.zero_grad()                       # posts this round's exchange
            loss_fn(model(x), y).backward()       # ... which runs meanwhile
            opt.step()                            # mix with the neighbours, then the SGD step
    """

    name = "gossip"
    unfreezes = True
    Settings = GossipOptions

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 comm: Comm | None = None, graph: str | Graph = "ring", *, compressor=None,
                 settings: GossipOptions | None = None, **options):
        super().__init__(model, optimizer, comm, settings=settings, **options)
        mode, order, consensus_step = self.settings.mode, self.settings.order, \
            self.settings.consensus_step
        self.graph = build_graph(graph, self.comm.size) if isinstance(graph, str) else graph
        if not isinstance(self.graph, Graph):
            raise ArgumentError("graph", f"must be a name ({', '.join(GRAPHS)}) or a Graph, got "
                                f"{type(graph).__name__}")
        if self.graph.size != self.comm.size:
            raise ArgumentError("graph", f"{self.graph.name!r} is on {self.graph.size} ranks but the "
                                f"communicator has {self.comm.size}")
        self.graph.check()
        if mode == "dpsgd" and not self.graph.regular:
            raise ArgumentError("mode", f"graph {self.graph.name!r} is not regular, so no uniform "
                                "doubly stochastic mixing exists for D-PSGD; use mode='push-sum'")
        if compressor is not None and (mode != "dpsgd" or self.graph.period != 1):
            raise ArgumentError("compressor", "compressed (CHOCO) gossip needs mode='dpsgd' on a "
                                f"static graph (every rank tracks its fixed neighbours' public "
                                f"copies); got mode={mode!r} on {self.graph.name!r}")
        if compressor is None and consensus_step != 1:
            raise ArgumentError("consensus_step", "is CHOCO's γ and needs a compressor")
        self.mode, self.order, self.compressor = mode, order, compressor
        self.consensus_step = float(consensus_step)
        self._buffers = [b for _, b in persistent_buffers(model) if b.is_floating_point()]
        named = self.members() + \
            [(n, b) for n, b in persistent_buffers(model) if b.is_floating_point()]
        broadcast_(self.comm, list(model.state_dict().values()), root=0)
        self._g = self.comm.dup()           # own message space: tags cannot meet other traffic
        self.rank = self._g.rank
        self.op = "gossip.choco" if compressor is not None else f"gossip.{mode}"
        self._layout = Layout(named, weight=mode != "dpsgd")
        self.t = 0                          # gossip rounds done (the graph's phase)
        self.steps = 0                      # optimizer steps done
        self.w = 1.0                        # push-sum weight (dpsgd: always 1)
        self.history: list[list[float]] = []     # [steps, consensus distance] per log line
        self._pending: dict | None = None   # a synchronous round in flight
        if compressor is not None:
            self._segments = self._layout.segments
            self._xhat = [torch.zeros_like(f) for f in self._layout.flats()]
            self._s = [torch.zeros_like(f) for f in self._xhat]
        self._inbox: list[torch.Tensor] = []     # async: arrived, not yet absorbed
        self._rx: dict[int, tuple] = {}          # async: source -> (buffer, posted irecv)
        self._tx: dict[int, tuple] = {}          # async: dest -> (buffer, isend in flight)
        self.skipped_sends = 0
        self._started = False                    # async: this rank has taken part in a round

    # synchronous rounds -----------------------------------------------------------------------
    def degree(self, t: int | None = None) -> int:
        """Out-degree of this rank in round ``t`` (default: the next round)."""
        return len(self.graph.out_peers(self.rank, self.t if t is None else t))

    def _post(self) -> None:
        outs = self.graph.out_peers(self.rank, self.t)
        ins = self.graph.in_peers(self.rank, self.t)
        if self.compressor is not None:
            self._post_choco(outs, ins)
            return
        send = self._layout.pack(self._layout.new())
        if self.mode == "push-sum":
            share = self.w / (len(outs) + 1)
            for v in self._layout.views(send):
                v.mul_(share)
            self._layout.set_weight(send, share)
        recvs = {j: self._layout.new() for j in ins}
        reqs = [self._g.irecv_(b, j, TAG) for j, b in recvs.items()]
        reqs += [self._g.isend(send, j, TAG) for j in outs]
        # buffers change in the forward pass after this snapshot (cta): that progress is kept
        base = [b.detach().clone() for b in self._buffers]
        self._pending = {"send": send, "recvs": recvs, "reqs": reqs, "base": base}

    def _post_choco(self, outs, ins) -> None:
        payloads, ctxs, own = [], [], []
        for k, (x, xhat) in enumerate(zip(self._layout.flats(), self._xhat)):
            payload, ctx = self.compressor.compress(x - xhat, f"gossip.{k}", self._segments[k])
            payload = [t.detach().cpu().contiguous() for t in payload]
            payloads.append(payload)
            ctxs.append(ctx)
            own.append(self.compressor.decompress(payload, ctx).to(x.dtype).clone())
        flat = [t for p in payloads for t in p]
        recvs = {j: [[torch.empty_like(t) for t in p] for p in payloads] for j in ins}
        reqs = []
        for j, bufs in recvs.items():
            reqs += [self._g.irecv_(b, j, TAG + n) for n, b in enumerate(b for p in bufs for b in p)]
        for j in outs:
            reqs += [self._g.isend(t, j, TAG + n) for n, t in enumerate(flat)]
        self._pending = {"payloads": payloads, "ctxs": ctxs, "own": own, "recvs": recvs, "reqs": reqs}

    def _wait(self) -> None:
        with self._g.ledger.scope(self.op, self._g.level):
            for r in self._pending["reqs"]:
                r.wait()
        self._pending["reqs"] = []

    def _mix(self) -> None:
        """Wait for the round in flight and write the mixed parameters into the model."""
        self._wait()
        p, self._pending = self._pending, None
        L = self._layout
        local = [b - base for b, base in zip(self._buffers, p.get("base", ()))]
        if self.compressor is not None:
            a = 1.0 / (len(p["recvs"]) + 1)
            x = L.flats()
            for k, ctx in enumerate(p["ctxs"]):
                self._xhat[k].add_(p["own"][k])
                self._s[k].add_(p["own"][k], alpha=a)
                for bufs in p["recvs"].values():
                    self._s[k].add_(self.compressor.decompress(bufs[k], ctx).to(x[k].dtype), alpha=a)
                x[k].add_(self._s[k] - self._xhat[k], alpha=self.consensus_step)
            L.unpack(x)
        elif self.mode == "dpsgd":
            a = 1.0 / (len(p["recvs"]) + 1)
            mixed = [v * a for v in L.views(p["send"])]
            for buf in p["recvs"].values():
                for m, v in zip(mixed, L.views(buf)):
                    m.add_(v, alpha=a)
            L.unpack(mixed)
        else:                                  # push-sum
            x = [v.clone() for v in L.views(p["send"])]
            w = L.get_weight(p["send"])
            for buf in p["recvs"].values():
                for m, v in zip(x, L.views(buf)):
                    m.add_(v)
                w += L.get_weight(buf)
            self.w = w
            L.unpack([m.div_(w) for m in x])
        with torch.no_grad():
            for b, d in zip(self._buffers, local):   # the buffers' own update since the snapshot
                b.add_(d)
        self.t += 1

    # the optimizer interface ------------------------------------------------------------------
    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        if self.order == "cta" and self.mode != "async" and self._pending is None:
            self._post()

    def _step(self, closure=None, update: bool = True):
        """One round; ``update=False``: the round without this rank's optimizer update (a step
        skipped for non-finite gradients under AMP: the exchange goes on with the neighbours)."""
        local = (lambda: self.optimizer.step(closure)) if update else self._drop_gradients
        if self.mode == "async":
            loss = self._step_async(local)
        elif self.order == "cta":
            if self._pending is None:          # the loop did not call zero_grad() first
                self._post()
            self._mix()
            loss = local()
        else:
            loss = local()
            self._post()
            self._mix()
        self.steps += 1
        return loss

    def _drop_gradients(self) -> None:
        self.optimizer.zero_grad()

    def _skip_step(self) -> None:
        self._step(update=False)

    def skip(self) -> None:
        # every rank drops the round together: no one mixes, so push-sum mass and CHOCO's
        # public copies stay consistent (a compressor's own error memory has seen the round)
        if self._pending is not None:
            self._wait()
            self._pending = None
            self.t += 1
        self.optimizer.zero_grad()

    # asynchronous ------------------------------------------------------------------------------
    def _post_rx(self, src: int, buf: torch.Tensor | None = None) -> None:
        buf = self._layout.new() if buf is None else buf
        self._rx[src] = (buf, self._g.irecv_(buf, src, TAG))

    def _ensure_rx(self) -> None:
        for src in self.graph.all_in_peers(self.rank):
            if src not in self._rx:
                self._post_rx(src)

    def _poll(self) -> None:
        for src in list(self._rx):
            buf, req = self._rx[src]
            while req.test():
                self._inbox.append(buf)
                self._post_rx(src)
                buf, req = self._rx[src]

    def _absorb(self) -> None:
        if not self._inbox:
            return
        L = self._layout
        x = [f.mul_(self.w) for f in L.flats()]
        w = self.w
        for buf in self._inbox:
            for m, v in zip(x, L.views(buf)):
                m.add_(v)
            w += L.get_weight(buf)
        self._inbox = []
        self.w = w
        L.unpack([m.div_(w) for m in x])

    def _send_async(self) -> None:
        outs = self.graph.out_peers(self.rank, self.t)
        if not outs:
            return
        dst = outs[(self.t // self.graph.period) % len(outs)]
        buf, req = self._tx.get(dst, (None, None))
        if req is not None and not req.test():
            self.skipped_sends += 1            # the last message has not left: keep the mass
            return
        buf = self._layout.pack(buf if buf is not None else self._layout.new())
        half = self.w / 2
        for v in self._layout.views(buf):
            v.mul_(half)
        self._layout.set_weight(buf, half)
        self.w = half                          # z = x/w is unchanged by giving half away
        self._tx[dst] = (buf, self._g.isend(buf, dst, TAG))

    def _step_async(self, local):
        self._started = True
        with self._g.ledger.scope(self.op, self._g.level):
            self._ensure_rx()
            self._poll()
            self._absorb()
            loss = local()
            self._send_async()
        self.t += 1
        return loss

    def _drain(self, final: bool) -> None:
        """Bring every async message in flight into ``_inbox``: each rank sends an end marker
        (weight −1) to every possible out-peer and reads each in-peer up to its marker."""
        L = self._layout
        with self._g.ledger.scope(self.op, self._g.level):
            self._ensure_rx()
            markers = []
            for dst in self.graph.all_out_peers(self.rank):
                _, req = self._tx.pop(dst, (None, None))
                if req is not None:
                    req.wait()
                marker = L.new()
                marker.zero_()
                L.set_weight(marker, -1.0)
                markers.append(self._g.isend(marker, dst, TAG))
            for src in sorted(self._rx):
                buf, req = self._rx.pop(src)
                req.wait()
                while L.get_weight(buf) >= 0:
                    self._inbox.append(buf)
                    buf = L.new()
                    self._g.irecv_(buf, src, TAG).wait()
                if not final:
                    self._post_rx(src, buf)
            for r in markers:
                r.wait()

    # state, metrics, teardown ------------------------------------------------------------------
    def _state_dict(self) -> dict:
        state = super()._state_dict()
        state["gossip"] = {"t": self.t, "steps": self.steps, "w": self.w,
                           "history": [list(h) for h in self.history],
                           "skipped_sends": self.skipped_sends}
        if self.mode == "async":
            self._drain(final=False)
            self._started = True
            state["inbox"] = [b.clone() for b in self._inbox]
        if self._pending is not None:         # completed and kept, so nothing is resent on resume
            self._wait()
            state["pending"] = {k: v for k, v in self._pending.items() if k != "reqs"}
        if self.compressor is not None:
            state["choco"] = {"xhat": self._xhat, "s": self._s,
                              "compressor": self.compressor.state_dict()}
        return state

    def reshard(self, old: list[dict]) -> dict:
        """The network average of the old ranks' models becomes every new rank's model: with
        push-sum weights, ``z = (Σ_k w_k z_k + Σ m_x) / (Σ_k w_k + Σ m_w)`` over the ranks and
        the async messages ``m`` that were in flight (drained into the checkpoint), i.e. the
        exact average the gossip converges to; with every ``w_k = 1`` and nothing in flight
        (D-PSGD, regular graphs) the plain average ``(1/K_old) Σ_k z_k``. Weights restart at 1;
        a synchronous round posted but not mixed is dropped (it carries copies, no mass). The
        optimizer's state is averaged; the round and step counters and the consensus history
        are rank 0's. CHOCO's public copies x̂, s and its compressor restart from zero, as at
        the start of a run (a warning says so)."""
        from ..reshard import average_dicts, average_optimizer, reset_compressor
        st = [s["strategy"] for s in old]
        models = [s["model"] for s in old]
        ws = [float(g["gossip"]["w"]) for g in st]
        inbox = [buf for g in st for buf in g.get("inbox", [])]
        if all(w == 1.0 for w in ws) and not inbox:
            model = average_dicts(models)
        else:
            model = dict(models[0])
            L = self._layout
            total = sum(ws) + sum(L.get_weight(b) for b in inbox)
            views = [L.views(b) for b in inbox]          # per message: one view per block
            for g, (f, _) in enumerate(L.groups):
                for name, p, a, b in f.members:
                    x = sum(w * m[name].to(torch.float64) for w, m in zip(ws, models))
                    for v in views:
                        x = x + v[g][a:b].view(p.shape).to(torch.float64)
                    model[name] = (x / total).to(models[0][name].dtype)
        state = {"optimizer": average_optimizer([g["optimizer"] for g in st]),
                 "gossip": dict(st[0]["gossip"], w=1.0,
                                skipped_sends=sum(g["gossip"]["skipped_sends"] for g in st))}
        if self.mode == "async":
            state["inbox"] = []
        if self.compressor is not None:
            state["choco"] = {"xhat": [torch.zeros_like(t) for t in self._xhat],
                              "s": [torch.zeros_like(t) for t in self._s],
                              "compressor": reset_compressor([g["choco"] for g in st],
                                                             self.compressor.state_dict(), self.name)}
        return {"model": model, "strategy": state}

    def _load_state_dict(self, state: dict) -> None:
        if self._pending is not None or self._rx:
            raise RuntimeError("load_state_dict() on a gossip strategy with messages in flight")
        super()._load_state_dict(state)
        g = state["gossip"]
        self.t, self.steps, self.w = g["t"], g["steps"], g["w"]
        self.history = [list(h) for h in g["history"]]
        self.skipped_sends = g["skipped_sends"]
        self._inbox = list(state.get("inbox", []))
        if "pending" in state:
            self._pending = {**state["pending"], "reqs": []}
        if self.compressor is not None:
            c = state["choco"]
            self._xhat, self._s = [t.clone() for t in c["xhat"]], [t.clone() for t in c["s"]]
            self.compressor.load_state_dict(c["compressor"])

    def consensus_distance(self, ctl: Comm) -> float:
        """Mean over ranks of ``‖θ_i − θ̄‖`` (all trainable parameters, float64), over ``ctl``."""
        return consensus_distance(self._layout, ctl)

    def metrics(self, ctl: Comm, final: bool = False) -> dict:
        if final:
            return self._summary(ctl)
        d = self.consensus_distance(ctl)
        self.history.append([self.steps, d])
        return {"consensus_distance": d}

    def gossip_bytes(self) -> int:
        """Bytes this rank has sent in gossip rounds (from the ledger)."""
        return self._g.ledger.get(self.op, self._g.level).bytes_sent

    def _summary(self, ctl: Comm) -> dict:
        sent = torch.tensor([float(self.gossip_bytes())], dtype=torch.float64)
        total = float(ctl.allreduce_(sent)) if ctl.size > 1 else float(sent)
        period = self.graph.period
        degree = sum(self.degree(t) for t in range(period)) / period
        out = {"graph": self.graph.name, "gossip_mode": self.mode, "gossip_order": self.order,
               "degree": degree, "gossip_bytes_per_rank_per_step": total / ctl.size / max(self.steps, 1),
               "consensus_distance": self.consensus_distance(ctl),
               "consensus_distance_by_step": [list(h) for h in self.history]}
        if self.mode != "dpsgd":
            w = torch.tensor([self.w], dtype=torch.float64)
            out["push_sum_weights"] = [float(x) for x in ctl.allgather(w).reshape(-1)]
        if self.mode == "async":
            out["async_skipped_sends"] = self.skipped_sends
        return out

    def _finish(self) -> None:
        """Deliver the average of the ranks' models, x̄ = (1/K) Σ_i x_i (the model D-PSGD's
        analysis is about, and the one Lian et al. 2017 evaluate): one dense all-reduce of the
        model, charged to the run (K·model bytes once, against degree·model bytes per step)."""
        from ...comm.collectives import allreduce_
        flats = self._layout.flats()
        w = torch.tensor([self.w if self.mode != "dpsgd" else 1.0], dtype=torch.float64)
        for f in flats:   # push-sum: x̄ = Σ w_i z_i / Σ w_i (w_i = 1 for D-PSGD)
            allreduce_(f.mul_(float(w)), self.comm, "mpi", op="sum")
        allreduce_(w, self.comm, "mpi", op="sum")
        self._layout.unpack([f.div_(float(w)) for f in flats])
        Buffers(self.model).broadcast_other(self.comm)     # num_batches_tracked: rank 0's

    def _close(self) -> None:
        if self._pending is not None:
            self._wait()
            self._pending = None
        if self.mode == "async" and self._started:
            self._drain(final=True)
            self._absorb()


@dataclass
class GossipSettings(Settings):
    """``[strategy]`` keys of ``gossip`` (whether a graph fits the rank count: at the start)."""
    graph: str = "ring"            # ring | torus | exponential | one-peer-exponential | complete
    gossip_mode: str = "dpsgd"     # "dpsgd" (Lian 2017) | "push-sum" (SGP) | "async"
    gossip_order: str = "cta"      # "cta": mix then step, exchange overlapped | "atc"
    compressor: str = "none"       # CHOCO: the parameters' compressor
    consensus_step: float = 1.0    # CHOCO's γ (with compressor)

    def validate(self, prefix: str = "") -> None:
        self.one_of(prefix, "graph", GRAPHS)
        self.one_of(prefix, "gossip_mode", MODES)
        self.one_of(prefix, "gossip_order", ORDERS)
        self.within(prefix, "consensus_step", 0, 1, low_open=True)
        check_compressor_name(self, prefix)
        if self.compressor != "none" and (self.gossip_mode != "dpsgd" or self.graph == "one-peer-exponential"):
            raise ConfigError.at(prefix, "compressor", "compressed (CHOCO) gossip needs gossip_mode = "
                              "\"dpsgd\" on a static graph")
        if self.compressor == "none" and self.consensus_step != 1:
            raise ConfigError.at(prefix, "consensus_step", "is CHOCO's γ: it needs a compressor")


def check_run(s: GossipSettings, cfg, prefix: str) -> None:
    if cfg.compressor.name != "none":
        raise ConfigError("compressor.name", "gossip exchanges parameters, not gradients; name the "
                          "parameter compressor in strategy.compressor")


def build(s: GossipSettings, model, optimizer, comm: Comm, ctx: Context) -> Gossip:
    """CHOCO takes the bare compressor: its x̂ already is an error memory."""
    compressor = ctx.bare_compressor(s.compressor) if s.compressor != "none" else None
    try:
        graph = build_graph(s.graph, comm.size)
    except ValueError as e:
        raise ConfigError("strategy.graph", str(e)) from None
    try:
        return Gossip(model, optimizer, comm, graph=graph, mode=s.gossip_mode, order=s.gossip_order,
                      compressor=compressor, consensus_step=s.consensus_step)
    except ArgumentError as e:          # from a config: name the key the user wrote
        key = {"mode": "gossip_mode", "order": "gossip_order"}.get(e.key, e.key)
        raise ConfigError("strategy." + key, e.reason) from None


METHOD = Method("gossip", GossipSettings, build, "decentralized gossip (D-PSGD, SGP, AD-PSGD, "
                "CHOCO): average with graph neighbours", check=check_run, python="Gossip",
                example="gossip:graph=ring", compare=("strategy.graph=one-peer-exponential",))
