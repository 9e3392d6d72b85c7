"""Membership by credential (lowcomm.run.fleet.trust): every value in the fleet's store sealed
with AES-256-GCM under a key derived from the fleet's secret and the coordinator's session,
bound to its key's name; a fleet across machines refuses to start without a secret. (A live
fleet, whose gloo groups meet through the sealed store, with an outsider writing into it:
tests/test_fleet.py.)"""
import os

import pytest
from torch.distributed import HashStore

from conftest import cli
from lowcomm.errors import ConfigError
from lowcomm.run.fleet.trust import (SECRET_ENV, SESSION_ENV, Forged, Seal, SealedStore,
                                     fleet_secret, parse_secret, read_secret, session_env)

SECRET = bytes(range(32))


def test_a_sealed_value_opens_under_its_own_name_and_session_only():
    a, b = Seal(SECRET, "s1"), Seal(SECRET, "s2")
    blob = a.seal("in/0/0/3", b'{"type": "ready"}')
    assert a.open("in/0/0/3", blob) == b'{"type": "ready"}'
    assert b'ready' not in blob, "the value crosses encrypted"
    for seal, name, value in [(a, "in/0/0/4", blob),                 # copied to another key
                              (b, "in/0/0/3", blob),                 # of an earlier session
                              (Seal(bytes(32), "s1"), "in/0/0/3", blob),   # another secret
                              (a, "in/0/0/3", blob[:-1] + bytes([blob[-1] ^ 1])),  # changed
                              (a, "in/0/0/3", b'{"type": "failed"}')]:       # plain JSON
        with pytest.raises(Forged, match="does not authenticate"):
            seal.open(name, value)


def test_the_store_keeps_forged_values_apart_until_the_writer_replaces_them(monkeypatch):
    """A forged value is dropped once (Forged), then skipped (``again``) without deleting it —
    the writer's own value replaces it and opens."""
    monkeypatch.setattr("lowcomm.run.fleet.trust.RECHECK_S", 0.1)
    inner = HashStore()
    store = SealedStore(inner, Seal(SECRET, "s"))
    inner.set("out/0/0/0", b"outsider")
    with pytest.raises(Forged) as first:
        store.get("out/0/0/0")
    with pytest.raises(Forged) as second:
        store.get("out/0/0/0")
    assert not first.value.again and second.value.again
    store.set("out/0/0/0", b"mine")
    assert store.get("out/0/0/0") == b"mine" and inner.get("out/0/0/0") != b"mine"
    store.count("hb/1/0", 7)
    assert store.counted("hb/1/0") == 7 and store.counted("hb/2/0") is None
    inner.set("hb/1/0", b"999999")
    assert store.counted("hb/1/0") is None, "an outsider's counter is no heartbeat"


def test_a_fleet_across_machines_needs_a_secret_and_a_local_one_makes_its_own(tmp_path):
    with pytest.raises(ConfigError, match="fleet.secret_file.*needs a secret") as e:
        fleet_secret("", "10.0.0.5", remote=True, env={})
    assert e.value.key == "fleet.secret_file"
    a, b = fleet_secret("", "127.0.0.1", False, {}), fleet_secret("", "127.0.0.1", False, {})
    assert len(a) == 32 and a != b, "a new secret for each run"
    r = cli("fleet", "key", tmp_path / "k")
    assert r.returncode == 0, r.output
    assert (tmp_path / "k").stat().st_mode & 0o777 == 0o600
    assert fleet_secret(str(tmp_path / "k"), "10.0.0.5", True, {}) == read_secret(tmp_path / "k")
    env = {"LOWCOMM_FLEET_SECRET_FILE": str(tmp_path / "k")}
    assert fleet_secret("", "10.0.0.5", True, env) == read_secret(tmp_path / "k")
    r = cli("fleet", "key", tmp_path / "k")
    assert r.returncode != 0 and "never replaced" in r.output


def test_a_bad_secret_is_an_error_naming_where_it_came_from(tmp_path):
    with pytest.raises(ConfigError, match="no secret file"):
        read_secret(tmp_path / "missing")
    short = tmp_path / "short"
    short.write_text("ab" * 16)
    os.chmod(short, 0o600)
    with pytest.raises(ConfigError, match="64 hex digits"):
        read_secret(short)
    open_file = tmp_path / "open"
    open_file.write_text("ab" * 32)
    os.chmod(open_file, 0o644)
    with pytest.raises(ConfigError, match="readable by others"):
        read_secret(open_file)
    with pytest.raises(ConfigError, match="64 hex digits") as e:
        parse_secret("zz" * 32, SECRET_ENV)
    assert e.value.key == SECRET_ENV
    with pytest.raises(ConfigError, match=SESSION_ENV):
        Seal.from_env({SECRET_ENV: SECRET.hex()})
    assert set(session_env(SECRET)) == {SECRET_ENV, SESSION_ENV}
