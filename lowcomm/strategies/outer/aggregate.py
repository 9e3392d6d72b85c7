"""Robust aggregation of the members' pseudo-gradients: one bad member cannot wreck the model.

An outer loop's ``aggregate`` setting says how the K members' pseudo-gradients Δ_1..Δ_K (one
row each, gathered: an all-gather over the level instead of an all-reduce, K times the bytes a
member receives, charged to the ledger as ``allgather``) become the one the outer step takes:

* ``mean``: (1/K) Σ_k Δ_k — today's all-reduce, nothing gathered;
* ``clip``: norm-clipped mean (as Templar clips to the median norm, Covenant 2025): with
  m = median_k ‖Δ_k‖ and c = ``clip``, Δ = (1/K) Σ_k min(1, c·m/‖Δ_k‖) · Δ_k;
* ``trim``: coordinate-wise trimmed mean (Yin et al. 2018, arXiv 1803.01498): per coordinate,
  the b = ``trim`` largest and b smallest values dropped, the K − 2b others averaged;
* ``median``: coordinate-wise median (Yin et al. 2018): per coordinate the middle value (the
  mean of the two middle ones for even K); needs K ≥ 3 (the median of two is their mean).

Whatever the rule, a row with a non-finite value is never applied: it is left out (``mean``:
an average that is not finite is dropped whole, the outer step skipped). The member score
(:class:`Strikes`, as Covenant's Gauntlet scores members, here by the norm alone: how often
and how far each member was clipped): a member strikes in a round when its row is non-finite
or its norm exceeds c·m; after ``strikes`` strikes in a row it is fenced —
its rows are left out of every rule until it sends a sane one again (one round below c·m, finite),
which clears its strikes. Every member gathers the same rows and computes the same verdict.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ...errors import ConfigError

#: the rules an outer loop's ``aggregate`` setting names (module docstring)
RULES = ("mean", "clip", "trim", "median")


def check_rule(rule: str, members: int, trim: int, key: str = "aggregate") -> None:
    """Refuse a rule that ``members`` contributions cannot carry, naming ``key``."""
    if rule == "median" and members < 3:
        raise ConfigError(key, f"the coordinate-wise median of {members} members is their mean; "
                          "use at least 3 datacenters, or aggregate = \"clip\"")
    if rule == "trim" and members <= 2 * trim:
        raise ConfigError(key, f"trim = {trim} drops {2 * trim} of each coordinate's "
                          f"{members} values: leave at least one (trim < {members / 2:g})")


def finite_rows(rows: torch.Tensor) -> torch.Tensor:
    """Whether each row (member) of ``rows`` (K × n) is finite throughout."""
    return torch.isfinite(rows).all(dim=1)


def norms(rows: torch.Tensor) -> torch.Tensor:
    """‖Δ_k‖ of each row, in float64 (∞ for a non-finite row)."""
    out = rows.double().norm(dim=1)
    return torch.where(torch.isnan(out), torch.full_like(out, float("inf")), out)


def clipped_mean(rows: torch.Tensor, c: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(1/K) Σ_k min(1, c·m/‖Δ_k‖)·Δ_k with m the median norm; returns it and each row's factor."""
    n = norms(rows)
    m = n.median() if rows.shape[0] % 2 else n.sort().values[rows.shape[0] // 2 - 1:
                                                             rows.shape[0] // 2 + 1].mean()
    factor = torch.where(n > c * m, (c * m) / n, torch.ones_like(n))
    return (rows.double() * factor[:, None]).mean(dim=0).to(rows.dtype), factor


def trimmed_mean(rows: torch.Tensor, b: int) -> torch.Tensor:
    """Per coordinate, the mean of the K − 2b middle values."""
    k = rows.shape[0]
    s = rows.sort(dim=0).values
    return s[b:k - b].mean(dim=0)


def coordinate_median(rows: torch.Tensor) -> torch.Tensor:
    """Per coordinate, the middle value (the mean of the two middle ones for even K)."""
    k = rows.shape[0]
    s = rows.sort(dim=0).values
    return s[k // 2] if k % 2 else (s[k // 2 - 1] + s[k // 2]) / 2


@dataclass
class Verdict:
    """What a round's aggregation did: the rows used (members' indices), each member's clip
    factor against c·m (1: not clipped), the members that struck and those fenced."""
    used: list[int]
    factors: list[float]
    struck: list[int] = field(default_factory=list)
    fenced: list[int] = field(default_factory=list)


@dataclass
class Strikes:
    """The member score (module docstring): strikes in a row per member id; ``limit`` strikes
    fence a member (0: never), a sane round clears them."""
    limit: int = 3
    count: dict = field(default_factory=dict)
    fenced: set = field(default_factory=set)
    clipped: dict = field(default_factory=dict)      # rounds each member was clipped, in all
    cut: dict = field(default_factory=dict)          # how far: Σ (1 − its clip factor), in all

    def score(self, ids: list, sane: list[bool], factors: list[float] | None = None) -> list:
        """Record one round (``sane[i]`` and clip factor ``factors[i]``, 0 for a non-finite
        row, for member ``ids[i]``); returns the members struck."""
        struck = []
        for n, (i, ok) in enumerate(zip(ids, sane)):
            if ok:
                self.count[i] = 0
                self.fenced.discard(i)
                continue
            struck.append(i)
            self.count[i] = self.count.get(i, 0) + 1
            self.clipped[i] = self.clipped.get(i, 0) + 1
            self.cut[i] = self.cut.get(i, 0.0) + 1.0 - (factors[n] if factors is not None else 0.0)
            if self.limit and self.count[i] >= self.limit:
                self.fenced.add(i)
        return struck

    def state_dict(self) -> dict:
        return {"fenced": sorted(self.fenced),
                **{name: {str(k): v for k, v in getattr(self, name).items()}
                   for name in ("count", "clipped", "cut")}}

    def load_state_dict(self, state: dict) -> None:
        self.fenced = set(state["fenced"])
        for name in ("count", "clipped", "cut"):
            setattr(self, name, {int(k): v for k, v in state[name].items()})


class Aggregator:
    """A rule with its settings and score: :meth:`__call__` turns the gathered rows of members
    ``ids`` into the pseudo-gradient applied (None: no row may be applied)."""

    def __init__(self, rule: str = "mean", clip: float = 2.0, trim: int = 1, strikes: int = 3):
        if rule not in RULES:
            raise ConfigError("aggregate", f"unknown rule {rule!r}; known: {', '.join(RULES)}")
        self.rule, self.clip, self.trim = rule, float(clip), int(trim)
        self.strikes = Strikes(strikes)
        self.last: Verdict | None = None

    @property
    def gathers(self) -> bool:
        """Whether the rule needs every member's row (all but ``mean``)."""
        return self.rule != "mean"

    def __call__(self, rows: torch.Tensor, ids: list) -> torch.Tensor | None:
        fin = finite_rows(rows)
        _, factor = clipped_mean(rows[fin], self.clip) if bool(fin.any()) else (None, None)
        factors = torch.zeros(len(ids), dtype=torch.float64)
        if factor is not None:
            factors[fin] = factor
        sane = [bool(f) and float(x) >= 1.0 for f, x in zip(fin, factors)]
        struck = self.strikes.score(ids, sane, factors.tolist())
        keep = [i for i, k in enumerate(ids) if fin[i] and k not in self.strikes.fenced]
        self.last = Verdict([ids[i] for i in keep], factors.tolist(), struck,
                            sorted(self.strikes.fenced))
        if not keep:
            return None
        return self._rule(rows[keep])

    def _rule(self, rows: torch.Tensor) -> torch.Tensor:
        """The rule on the rows kept; ``trim`` drops at most (k − 1)//2 a side of the k rows
        left when members were fenced or non-finite (one value always remains)."""
        if self.rule == "clip":
            return clipped_mean(rows, self.clip)[0]
        if self.rule == "trim":
            return trimmed_mean(rows, min(self.trim, (rows.shape[0] - 1) // 2))
        if self.rule == "median":
            return coordinate_median(rows)
        return rows.mean(dim=0)

    def mean_of(self, avg: torch.Tensor) -> torch.Tensor | None:
        """Rule ``mean`` on an all-reduced average: None when it is not finite (never applied)."""
        return avg if bool(torch.isfinite(avg).all()) else None


__all__ = ["Aggregator", "RULES", "Strikes", "Verdict", "check_rule", "clipped_mean",
           "coordinate_median", "finite_rows", "norms", "trimmed_mean"]
