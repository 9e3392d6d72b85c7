"""Exceptions raised by lowcomm. Every one derives from :class:`LowcommError`."""
from __future__ import annotations


class LowcommError(Exception):
    """Base class of every error lowcomm raises on purpose."""


class ConfigError(LowcommError, ValueError):
    """A configuration key, value or type is wrong; the message names the key."""

    what = "config key"

    def __init__(self, key: str, message: str):
        self.key, self.reason = key, message
        super().__init__(f"{self.what} '{key}': {message}")

    @staticmethod
    def at(prefix: str, name: str, message: str) -> "ConfigError":
        """The error for setting ``name`` read under ``prefix``: a config key
        (``strategy.period``) where there is a prefix, else a Python argument (``period``)."""
        return ConfigError(prefix + name, message) if prefix else ArgumentError(name, message)


class ArgumentError(ConfigError):
    """A Python argument of a lowcomm method or function is wrong; the message names it. A
    :class:`ConfigError`, so one ``except`` catches both."""

    what = "argument"


def refuse_moved(given, moved: dict[str, str], what: str) -> None:
    """An argument ``what`` took once and no longer does: an :class:`ArgumentError` naming it
    and its new spelling (``moved``: old keyword -> the new one), not a TypeError deep inside."""
    for key in given:
        if key in moved:
            raise ArgumentError(key, f"{what} no longer takes {key}=; pass {moved[key]}")


class EnvError(ConfigError):
    """A ``LOWCOMM_*`` environment variable's value is wrong; the message names the variable
    (not a config key the user never set)."""

    def __init__(self, name: str, value: str, message: str):
        self.key, self.reason, self.value = name, message, value
        LowcommError.__init__(self, f"environment variable {name}={value!r}: {message}")


class CommError(LowcommError, RuntimeError):
    """A communication op cannot proceed; the message names the rank, the op and the bytes."""

    def __init__(self, op: str, rank: int, message: str, nbytes: int | None = None):
        self.op, self.rank, self.nbytes = op, rank, nbytes
        size = f", {nbytes} bytes" if nbytes is not None else ""
        super().__init__(f"rank {rank}, op {op}{size}: {message}")


class NonFiniteError(LowcommError, FloatingPointError):
    """A loss or gradient holds NaN or Inf; the message names the rank, the tensor and the step."""

    def __init__(self, rank: int, what: str, step: int | None = None):
        self.rank, self.what, self.step = rank, what, step
        at = f" at step {step}" if step is not None else ""
        super().__init__(f"rank {rank}{at}: non-finite values (NaN/Inf) in {what}; "
                         f"not sent (set on_nonfinite = \"skip\" to skip such steps on all ranks)")


class RunFolderError(LowcommError):
    """A run may not use its folder (or its checkpoint folder): it holds another run, another
    run holds its lock, or it cannot be written. A relaunch would meet the same."""
