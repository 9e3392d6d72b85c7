"""One validated configuration tree: defaults, then a TOML file, then ``--set a.b=value``.

Unknown keys and values of the wrong type are :class:`~lowcomm.errors.ConfigError` naming the
key. Values given with ``--set`` are read as TOML literals (``3``, ``0.5``, ``true``, ``"x"``);
anything that is not a literal is taken as a string.

Example::

    cfg = load_config("run.toml", ["strategy.algorithm=ring", "steps=500"])
    cfg.strategy.algorithm     # 'ring'
"""
from __future__ import annotations

import dataclasses
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ConfigError

OPTIMIZERS = ("adamw", "adam", "sgd")
COMPRESSORS = ("none",)


@dataclass
class DataConfig:
    path: str = ""                 # text file or directory; "" = the Python standard library
    seq_len: int = 64
    max_bytes: int = 8_000_000     # read at most this much text (train + eval)
    eval_fraction: float = 0.05    # share of files held out for evaluation


@dataclass
class ModelConfig:
    name: str = "tinygpt"
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4


@dataclass
class StrategyConfig:
    name: str = "syncdp"
    algorithm: str = "mpi"
    bucket_mb: float = 4.0
    backward_passes_per_step: int = 1
    overlap: bool = True
    backend: str = "mpi"


@dataclass
class CompressorConfig:
    name: str = "none"


@dataclass
class OptimizerConfig:
    name: str = "adamw"
    weight_decay: float = 0.0
    momentum: float = 0.0          # sgd only
    beta1: float = 0.9
    beta2: float = 0.95


@dataclass
class CommConfig:
    validate: bool = True          # per-call shape/dtype agreement check (one small all-gather)
    timeout_s: float = 60.0        # watchdog: one call waiting longer ends the job (0 = off)


@dataclass
class Config:
    steps: int = 300
    seed: int = 0
    batch_size: int = 16           # sequences per rank per step
    lr: float = 3e-3
    log_every: int = 10
    eval_batches: int = 16
    topology: str = ""
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    compressor: CompressorConfig = field(default_factory=CompressorConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    comm: CommConfig = field(default_factory=CommConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def method(self) -> str:
        s = self.strategy
        if s.backend == "horovod":
            return "syncdp(horovod)"
        return f"{s.name}({s.algorithm})"


def _set(obj, dotted: str, value, prefix: str = "") -> None:
    head, _, rest = dotted.partition(".")
    key = prefix + head
    hints = typing.get_type_hints(type(obj))
    if head not in hints:
        known = ", ".join(prefix + f.name for f in dataclasses.fields(obj))
        raise ConfigError(key, f"unknown key; known here: {known}")
    current = getattr(obj, head)
    if dataclasses.is_dataclass(current):
        if rest:
            _set(current, rest, value, key + ".")
            return
        if not isinstance(value, dict):
            raise ConfigError(key, f"is a table, got {value!r}")
        for k, v in value.items():
            _set(current, k, v, key + ".")
        return
    if rest:
        raise ConfigError(key + "." + rest, f"'{key}' is a {hints[head].__name__}, not a table")
    setattr(obj, head, _coerce(key, hints[head], value))


def _coerce(key: str, kind: type, value):
    if kind is bool:
        if isinstance(value, bool):
            return value
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif kind is str:
        if isinstance(value, str):
            return value
    raise ConfigError(key, f"expects {kind.__name__}, got {type(value).__name__} {value!r}")


def parse_override(text: str) -> tuple[str, object]:
    """``"a.b=value"`` -> ``("a.b", value)`` with value read as a TOML literal when it is one."""
    key, eq, raw = text.partition("=")
    key = key.strip()
    if not eq or not key:
        raise ConfigError(text, "an override must look like key=value")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return key, value


def validate(cfg: Config) -> Config:
    """Check values that types alone cannot; raise ConfigError naming the key."""
    from .collectives import ALGORITHMS
    from .models import MODELS
    from .strategies import STRATEGIES
    from .strategies.syncdp import BACKENDS

    def one_of(key, value, known):
        if value not in known:
            raise ConfigError(key, f"unknown value {value!r}; known: {', '.join(known)}")

    for key in ("steps", "batch_size", "log_every", "data.seq_len", "data.max_bytes",
                "model.d_model", "model.n_layers", "model.n_heads",
                "strategy.backward_passes_per_step"):
        obj = cfg
        for part in key.split("."):
            obj = getattr(obj, part)
        if obj < 1:
            raise ConfigError(key, f"must be >= 1, got {obj}")
    if cfg.comm.timeout_s < 0:
        raise ConfigError("comm.timeout_s", f"must be >= 0 (0 = no watchdog), got {cfg.comm.timeout_s}")
    if cfg.eval_batches < 0:
        raise ConfigError("eval_batches", f"must be >= 0, got {cfg.eval_batches}")
    if not cfg.lr > 0:
        raise ConfigError("lr", f"must be > 0, got {cfg.lr}")
    if not 0 < cfg.data.eval_fraction < 1:
        raise ConfigError("data.eval_fraction", f"must be in (0, 1), got {cfg.data.eval_fraction}")
    if not cfg.strategy.bucket_mb > 0:
        raise ConfigError("strategy.bucket_mb", f"must be > 0, got {cfg.strategy.bucket_mb}")
    if cfg.model.d_model % cfg.model.n_heads:
        raise ConfigError("model.n_heads", f"must divide model.d_model={cfg.model.d_model}")
    one_of("strategy.name", cfg.strategy.name, list(STRATEGIES))
    one_of("strategy.algorithm", cfg.strategy.algorithm, list(ALGORITHMS))
    one_of("strategy.backend", cfg.strategy.backend, BACKENDS)
    one_of("compressor.name", cfg.compressor.name, COMPRESSORS)
    one_of("optimizer.name", cfg.optimizer.name, OPTIMIZERS)
    one_of("model.name", cfg.model.name, list(MODELS))
    if cfg.topology:
        raise ConfigError("topology", f"{cfg.topology!r}: only the flat world ('') is supported "
                          "until topology-aware levels land")
    if cfg.data.path and not Path(cfg.data.path).exists():
        raise ConfigError("data.path", f"{cfg.data.path!r} does not exist")
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> Config:
    """Defaults, updated by the TOML file at ``path`` and then by ``key=value`` overrides."""
    cfg = Config()
    if path:
        try:
            with open(path, "rb") as f:
                table = tomllib.load(f)
        except FileNotFoundError:
            raise ConfigError("--config", f"file {str(path)!r} not found") from None
        except tomllib.TOMLDecodeError as e:
            raise ConfigError("--config", f"{path}: {e}") from None
        for k, v in table.items():
            _set(cfg, k, v)
    for text in overrides:
        _set(cfg, *parse_override(text))
    return validate(cfg)
