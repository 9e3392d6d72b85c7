"""Membership by credential: every value a fleet keeps in its coordinator's store is sealed.

A fleet's datacenters and its coordinator talk through the coordinator's ``TCPStore``, which
takes any client that reaches its port. So every value written into it — the members' messages
(``inbox/``, ``mailbox/``), their heartbeats, asynchronous DiLoCo's arrivals and answers, a
donor's state, the round groups' rendezvous (``pg/``) — is sealed with AES-256-GCM (NIST SP
800-38D, through the ``cryptography`` library): encrypted, and authenticated together with its
key's name. The sealing key is derived with HKDF-SHA256 (RFC 5869) from the fleet's secret,
salted by the coordinator's session (a fresh random value each time a coordinator starts), so

* a value an outsider writes (without the secret) fails to open: it is dropped and logged, never
  acted on;
* a value copied to another key, or kept from an earlier session and written again, fails too
  (the name and the session are part of what is authenticated); names carry a counter
  (``inbox/<dc>/<inc>/<k>``), so a message read once is never read again;
* the model and its updates cross encrypted.

The secret: 32 random bytes, written as 64 hex digits by ``lowcomm fleet key FILE`` (readable by
its owner only) and named by ``fleet.secret_file`` or ``$LOWCOMM_FLEET_SECRET_FILE``; a fleet on
this machine or the emulated WAN makes its own for the run when none is given. The supervisor
hands it to the coordinator and the members in their environment
(``$LOWCOMM_FLEET_SECRET``), never on a command line.

The rounds' own traffic between the members crosses TLS 1.3 connections that only holders of
the same secret can open (:mod:`lowcomm.comm.tls`; ``fleet.transport = "gloo"`` makes it plain
TCP, for a trusted network).

What this does not stop: an outsider who reaches the port can still delete or overwrite keys
(the run then treats the member as silent and heals it) — a denial of service, not a forged
message (docs/security.md).
"""
from __future__ import annotations

import functools
import os
import secrets
import stat
import time
from pathlib import Path

import torch.distributed as dist

from ...errors import ConfigError, LowcommError

SECRET_BYTES = 32
NONCE_BYTES = 12
#: how long a get waits for a forged value to be replaced before it raises again
RECHECK_S = 1.0
#: the environment variables a fleet's processes read the secret and the session from
SECRET_ENV, SESSION_ENV, SECRET_FILE_ENV = ("LOWCOMM_FLEET_SECRET", "LOWCOMM_FLEET_SESSION",
                                            "LOWCOMM_FLEET_SECRET_FILE")


class Forged(LowcommError):
    """A value in the fleet's store that does not open with the fleet's key."""

    def __init__(self, name: str, again: bool = False):
        super().__init__(f"the value at {name!r} in the fleet's store does not authenticate "
                         "(written without the fleet's secret, or copied from elsewhere): dropped")
        self.name, self.again = name, again


def parse_secret(text: str, where: str) -> bytes:
    """The secret from its 64 hex digits; a clear error naming ``where`` otherwise."""
    text = text.strip()
    try:
        raw = bytes.fromhex(text)
    except ValueError:
        raw = b""
    if len(raw) != SECRET_BYTES:
        raise ConfigError(where, f"a fleet secret is {2 * SECRET_BYTES} hex digits "
                          f"({SECRET_BYTES} bytes; 'lowcomm fleet key FILE' writes one), got "
                          f"{len(text)} characters")
    return raw


def read_secret(path: str | Path, where: str = "fleet.secret_file") -> bytes:
    p = Path(path)
    if not p.is_file():
        raise ConfigError(where, f"no secret file at {p} ('lowcomm fleet key {p}' writes one)")
    if p.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(where, f"{p} is readable by others than its owner: chmod 600 {p}")
    return parse_secret(p.read_text(), where)


def write_secret(path: str | Path) -> Path:
    """A new secret in ``path`` (mode 600); an existing file is never replaced."""
    p = Path(path)
    fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(SECRET_BYTES) + "\n")
    return p


def given_secret(secret_file: str, env=os.environ) -> bytes | None:
    """The secret the user gave (``fleet.secret_file``, else ``$LOWCOMM_FLEET_SECRET_FILE``),
    or None."""
    if secret_file:
        return read_secret(secret_file)
    if env.get(SECRET_FILE_ENV):
        return read_secret(env[SECRET_FILE_ENV], SECRET_FILE_ENV)
    return None


def fleet_secret(secret_file: str, host: str, remote: bool, env=os.environ) -> bytes:
    """The fleet's secret: the one the user gave, else (every job on this machine) a new one
    for the run; a fleet across machines without one is refused, naming the setting."""
    given = given_secret(secret_file, env)
    if given is not None:
        return given
    if remote:
        raise ConfigError("fleet.secret_file", f"a fleet across machines (its coordinator "
                          f"listening on {host}) needs a secret every member holds: 'lowcomm "
                          "fleet key FILE', copy FILE to each machine, then --set "
                          "fleet.secret_file=FILE (or $LOWCOMM_FLEET_SECRET_FILE)")
    return secrets.token_bytes(SECRET_BYTES)


def session_env(secret: bytes) -> dict[str, str]:
    """The environment of one coordinator's session: the secret and a fresh salt."""
    return {SECRET_ENV: secret.hex(), SESSION_ENV: secrets.token_hex(16)}


def secret_from_env(env=os.environ) -> tuple[bytes, str]:
    """(the fleet's secret, the coordinator's session) a fleet's process was started with."""
    if not env.get(SECRET_ENV) or not env.get(SESSION_ENV):
        raise ConfigError(SECRET_ENV, "a fleet's process needs the fleet's secret and "
                          f"session (${SECRET_ENV}, ${SESSION_ENV}; set by the fleet's "
                          "supervisor, 'lowcomm train --dcs')")
    return parse_secret(env[SECRET_ENV], SECRET_ENV), env[SESSION_ENV]


class Seal:
    """AES-256-GCM under a key derived from the fleet's secret and the session (module
    docstring); a sealed value is ``nonce ‖ ciphertext ‖ tag``, authenticated with its name."""

    def __init__(self, secret: bytes, session: str):
        from cryptography.hazmat.primitives import hashes
        from cryptography.hazmat.primitives.ciphers.aead import AESGCM
        from cryptography.hazmat.primitives.kdf.hkdf import HKDF
        key = HKDF(hashes.SHA256(), 32, salt=session.encode(),
                   info=b"lowcomm fleet store").derive(secret)
        self._aead = AESGCM(key)

    @classmethod
    def from_env(cls, env=os.environ) -> "Seal":
        """The process's seal: derived once per secret and session, shared by every store
        client (the watchers', the heartbeat's reconnects); AES-GCM keeps no per-call state."""
        return _seal(*secret_from_env(env))

    def seal(self, name: str, data: bytes | str) -> bytes:
        if isinstance(data, str):
            data = data.encode()
        nonce = secrets.token_bytes(NONCE_BYTES)
        return nonce + self._aead.encrypt(nonce, bytes(data), name.encode())

    def open(self, name: str, blob: bytes) -> bytes:
        from cryptography.exceptions import InvalidTag
        try:
            if len(blob) < NONCE_BYTES + 16:
                raise InvalidTag
            return self._aead.decrypt(blob[:NONCE_BYTES], blob[NONCE_BYTES:], name.encode())
        except InvalidTag:
            raise Forged(name) from None


@functools.lru_cache(maxsize=4)
def _seal(secret: bytes, session: str) -> Seal:
    return Seal(secret, session)


class SealedStore(dist.Store):
    """A store whose values are sealed (module docstring): what lowcomm and gloo's rendezvous
    ``set`` is sealed under its full name, what they ``get`` is opened (:class:`Forged` when it
    does not open). Counters are sealed values too (:meth:`count`, :meth:`counted`); the
    server-side ``add`` is refused. Keep a reference to it while torch holds it (a Python store
    that only torch holds loses its methods)."""

    def __init__(self, inner: dist.Store, seal: Seal, host: str = "127.0.0.1"):
        super().__init__()
        self.inner, self.seal_, self.host = inner, seal, host
        self._forged: dict[str, bytes] = {}      # key -> the outsider's value seen there

    @property
    def port(self) -> int:
        return self.inner.port

    def set(self, key: str, value) -> None:
        self.inner.set(key, self.seal_.seal(key, value))

    def get(self, key: str) -> bytes:
        """The value at ``key``, opened. A forged value is left in place (deleting it could
        delete the writer's own value, written meanwhile) and remembered: the next gets wait
        up to :data:`RECHECK_S` for the writer's own to replace it, then raise
        :class:`Forged` (``again``) as a timeout would."""
        raw = self.inner.get(key)
        t0 = time.monotonic()
        while raw == self._forged.get(key) and time.monotonic() - t0 < RECHECK_S:
            time.sleep(0.05)
            raw = self.inner.get(key)
        try:
            value = self.seal_.open(key, raw)
        except Forged:
            again = self._forged.get(key) == raw
            self._forged[key] = raw
            raise Forged(key, again) from None
        self._forged.pop(key, None)
        return value

    def add(self, key: str, value: int) -> int:
        raise LowcommError(f"a fleet's store holds sealed values only: {key!r} is no counter "
                           "(use count/counted)")

    def count(self, key: str, n: int) -> None:
        """Set the counter ``key`` to ``n`` (a heartbeat)."""
        self.set(key, str(n))

    def counted(self, key: str) -> int | None:
        """The counter ``key`` (None when unset or forged: an outsider's write is no beat)."""
        if not self.inner.check([key]):
            return None
        try:
            return int(self.get(key))
        except (Forged, ValueError):
            return None

    def wait(self, keys, timeout=None) -> None:
        if timeout is None:
            self.inner.wait(keys)
        else:
            self.inner.wait(keys, timeout)

    def check(self, keys) -> bool:
        return self.inner.check(keys)

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout) -> None:
        self.inner.set_timeout(timeout)
