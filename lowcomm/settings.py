"""Settings: small dataclasses that read themselves from a table and check their own values.

Every strategy and the run itself keep their knobs in a :class:`Settings` subclass next to the
code that uses them. :meth:`Settings.from_options` takes a plain ``{key: value}`` table (from
TOML, ``--set`` or a ``NAME:key=value`` spec string), coerces each value to the field's type
and calls :meth:`Settings.validate`; every error is a :class:`~lowcomm.errors.ConfigError`
naming the key as the user wrote it (``prefix`` + field, e.g. ``policy.dc.period``).

Example::

    @dataclass
    class LocalSGDSettings(Settings):
        period: int = 1
        def validate(self, prefix=""):
            self.at_least(prefix, "period", 1)

    LocalSGDSettings.from_options({"period": "8"}, "strategy.")   # ConfigError: expects int
"""
from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing

from .errors import ConfigError


class NonFinite(enum.StrEnum):
    """The NaN policy: what a NaN/Inf loss or gradient does to a step (the run's
    ``on_nonfinite``, ``nonfinite`` of :func:`lowcomm.build` and of the methods that send
    gradients). Read once from its setting (:meth:`parse`); everything after holds a member."""

    ABORT = "abort"    # never send a non-finite value: the job ends naming rank, step and tensor
    SKIP = "skip"      # every rank skips the step (a method zeroes what it would have sent)

    @classmethod
    def parse(cls, value, key: str = "on_nonfinite", error=ConfigError) -> NonFinite:
        """``value`` (a member or its value) as a member, or ``error`` (a ConfigError; an
        ArgumentError for a Python argument) naming ``key``."""
        try:
            return cls(value)
        except ValueError:
            raise error(key, f"unknown value {value!r}; known: "
                              f"{', '.join(m.value for m in cls)}") from None


def coerce(key: str, kind, value):
    """``value`` as ``kind`` (bool, int, float, str, an enum by its value, ``T | None``; an int is
    a valid float, inf and NaN are not), or ConfigError naming ``key``. ``"none"``/``"auto"``
    give None for ``T | None``."""
    if typing.get_origin(kind) in (typing.Union, types.UnionType):   # ``T | None``
        options = [k for k in typing.get_args(kind) if k is not type(None)]
        if len(options) == 1:
            if value is None or (isinstance(value, str) and value.lower() in ("none", "auto")):
                return None
            return coerce(key, options[0], value)
    if kind is NonFinite:
        return NonFinite.parse(value, key)
    if kind is bool:
        if isinstance(value, bool):
            return value
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if not math.isfinite(value):
                raise ConfigError(key, f"must be a finite number, got {value}")
            return float(value)
    elif kind is str:
        if isinstance(value, str):
            return value
    raise ConfigError(key, f"expects {getattr(kind, '__name__', kind)}, got {type(value).__name__} {value!r}")


@dataclasses.dataclass
class Settings:
    """Base of a method's settings (fields with defaults). Subclasses override :meth:`validate`
    and use the small checkers below, which name ``prefix + field`` in their errors."""

    @classmethod
    def fields(cls) -> dict[str, object]:
        """``{field: type}`` of this settings class."""
        return typing.get_type_hints(cls)

    @classmethod
    def from_options(cls, options: dict, prefix: str = "", what: str | None = None):
        """Build from ``{key: value}``; unknown keys and wrong types are ConfigErrors naming
        ``prefix + key``; then :meth:`validate`."""
        hints = cls.fields()
        kwargs = {}
        for key, value in options.items():
            if key not in hints:
                raise ConfigError.at(prefix, key, f"not an option of {what or cls.__name__}; known: "
                                  f"{', '.join(hints) or '(none)'}")
            try:
                kwargs[key] = coerce(key, hints[key], value)
            except ConfigError as e:
                raise ConfigError.at(prefix, key, e.reason) from None
        out = cls(**kwargs)
        out.validate(prefix)
        return out

    def validate(self, prefix: str = "") -> None:
        """Check values that types alone cannot (override)."""

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    # checkers ---------------------------------------------------------------------------------
    def at_least(self, prefix: str, name: str, low: float) -> None:
        if getattr(self, name) < low:
            raise ConfigError.at(prefix, name, f"must be >= {low:g}, got {getattr(self, name)}")

    def within(self, prefix: str, name: str, low: float, high: float, *, low_open: bool = False,
               high_open: bool = False) -> None:
        v = getattr(self, name)
        ok = (v > low if low_open else v >= low) and (v < high if high_open else v <= high)
        if not ok:
            lb, rb = "(" if low_open else "[", ")" if high_open else "]"
            raise ConfigError.at(prefix, name, f"must be in {lb}{low:g}, {high:g}{rb}, got {v}")

    def one_of(self, prefix: str, name: str, known) -> None:
        if getattr(self, name) not in known:
            raise ConfigError.at(prefix, name, f"unknown value {getattr(self, name)!r}; known: "
                              f"{', '.join(known)}")
