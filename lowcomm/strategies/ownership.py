"""State-ownership tags: whose a method's ``state_dict()`` is (the method, its settings, and,
where the state differs between ranks, the rank and world size that saved it), so that a state
is never loaded into another method, other settings or another rank by mistake."""
from __future__ import annotations

import dataclasses

from ..errors import LowcommError

#: the key of a method's ``state_dict()`` that says whose state it is
STATE_TAG = "lowcomm"


def adopt(state: dict) -> dict:
    """``state`` (a method's ``state_dict()``, nested ones included) without the rank it was
    saved on, so that another rank may load it on purpose: a merged checkpoint of another rank
    count, a donor's state handed to a rejoining datacenter."""
    out = {k: adopt(v) if isinstance(v, dict) else v for k, v in state.items()}
    if isinstance(out.get(STATE_TAG), dict):
        out[STATE_TAG] = {k: v for k, v in out[STATE_TAG].items() if k not in ("rank", "world")}
    return out


def _text(settings: dict | None) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in (settings or {}).items()) or "no settings"


def tag_of(method) -> dict:
    """The tag of ``method``'s state: its name and settings, and (per-rank state) the rank and
    world size."""
    s = method.settings
    tag = {"method": method.name,
           "settings": dataclasses.asdict(s) if dataclasses.is_dataclass(s) else {}}
    if method.per_rank_state:
        tag.update(rank=method.comm.rank, world=method.comm.size)
    return tag


def check_tag(method, tag: dict) -> None:
    """Refuse a state tagged ``tag`` that ``method`` must not load, naming both."""
    mine, name = tag_of(method), method.name
    if tag.get("method") != name:
        raise LowcommError(
            f"load_state_dict: the state was saved by {tag.get('method')} "
            f"({_text(tag.get('settings'))}), this method is {name} "
            f"({_text(mine['settings'])}): build {tag.get('method')} with those "
            "settings to resume it")
    theirs = tag.get("settings") or {}
    differ = {k: (theirs.get(k), v) for k, v in mine["settings"].items()
              if k in theirs and theirs[k] != v}
    if differ:
        raise LowcommError(
            f"load_state_dict: the state was saved by {name} with "
            f"{_text({k: a for k, (a, _) in differ.items()})}, this {name} has "
            f"{_text({k: b for k, (_, b) in differ.items()})}: build it with the "
            "saved settings to resume")
    if method.per_rank_state and "rank" in tag and \
            (tag["rank"], tag["world"]) != (method.comm.rank, method.comm.size):
        raise LowcommError(
            f"load_state_dict: rank {method.comm.rank} of {method.comm.size} was given the state "
            f"that rank {tag['rank']} of {tag['world']} saved, but {name}'s state differs "
            "between ranks: each rank loads the state_dict() it saved itself (rank 0's on "
            "every rank, torch DDP's habit, resumes the others inexactly), e.g. "
            "torch.save(method.state_dict(), f\"method-rank{rank}.pt\") on every rank; "
            "lowcomm.adopt(state) takes another rank's on purpose")
