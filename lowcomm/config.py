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
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ConfigError

OPTIMIZERS = ("adamw", "adam", "sgd")
OUTER_OPTIMIZERS = ("nesterov", "sgd")


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
    # Local SGD / DiLoCo / streaming DiLoCo (issue: outer loops)
    period: int = 1                # H: inner steps between synchronisations
    warmup_steps: int = 0          # dense SyncDP steps first (post-local SGD)
    outer_optimizer: str = "nesterov"   # "nesterov" | "sgd" (DiLoCo's outer step)
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    fragments: int = 1             # streaming DiLoCo: P parameter fragments
    delay: int = 0                 # streaming DiLoCo: τ steps between start and apply
    alpha: float = 0.0             # streaming DiLoCo: mixing of local into synced parameters
    compressor: str = "none"       # compressor of the pseudo-gradient (outer loops)


@dataclass
class CompressorConfig:
    name: str = "none"
    error_feedback: bool | None = None   # None: the method's own default (on for top-k)
    ratio: float = 0.01            # top-k / random-k: share of elements kept
    levels: int = 16               # QSGD quantisation levels s
    approx_rank: int = 2           # PowerSGD rank r
    start_iter: int = 10           # PowerSGD: dense all-reduce before this step


@dataclass
class OptimizerConfig:
    name: str = "adamw"
    weight_decay: float = 0.0
    momentum: float = 0.0          # sgd only
    beta1: float = 0.9
    beta2: float = 0.95
    freeze_step: int = 100         # onebit-adam: dense Adam warm-up steps


@dataclass
class CommConfig:
    validate: bool = True          # per-call shape/dtype agreement check (one small all-gather)
    timeout_s: float = 60.0        # watchdog: one call waiting longer ends the job (0 = off)


@dataclass
class CheckpointConfig:
    every: int = 0                 # write a checkpoint every N steps (0 = never)
    keep: int = 2                  # keep the newest N checkpoints
    dir: str = ""                  # "" = <out>/checkpoints


@dataclass
class CompareConfig:
    """What ``lowcomm compare --config FILE`` runs (``lowcomm train`` ignores this table)."""
    question: str = ""             # what the experiment asks
    expect: str = ""               # the outcome we expect, in words
    methods: str = "main"          # comma list, "main" or "all"
    np: int = 4
    link: str = "25,100"           # DELAY_MS,RATE_MBIT of the modelled wall-clock


@dataclass
class Config:
    steps: int = 300
    seed: int = 0
    batch_size: int = 16           # sequences per rank per step
    lr: float = 3e-3
    log_every: int = 10
    eval_batches: int = 16
    eval_every: int = 0            # also evaluate every N steps (a multiple of log_every; 0 = end only)
    topology: str = ""
    on_nonfinite: str = "abort"    # NaN/Inf loss or gradient: "abort" or "skip" the step
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    strategy: StrategyConfig = field(default_factory=StrategyConfig)
    compressor: CompressorConfig = field(default_factory=CompressorConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    compare: CompareConfig = field(default_factory=CompareConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @property
    def method(self) -> str:
        s = self.strategy
        name = "syncdp(horovod)" if s.backend == "horovod" else f"{s.name}({s.algorithm})"
        if self.compressor.name != "none":
            name += f"+{self.compressor.name}"
        return name


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
        raise ConfigError(key + "." + rest, f"'{key}' is a value, not a table")
    setattr(obj, head, _coerce(key, hints[head], value))


def _coerce(key: str, kind, value):
    if typing.get_origin(kind) in (typing.Union, types.UnionType):   # ``T | None``
        options = [k for k in typing.get_args(kind) if k is not type(None)]
        if len(options) == 1:
            if value is None or (isinstance(value, str) and value.lower() in ("none", "auto")):
                return None
            return _coerce(key, options[0], value)
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
    raise ConfigError(key, f"expects {getattr(kind, '__name__', kind)}, got {type(value).__name__} {value!r}")


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
    from .compress import COMPRESSORS
    from .models import MODELS
    from .strategies import STRATEGIES
    from .strategies.syncdp import BACKENDS

    def one_of(key, value, known):
        if value not in known:
            raise ConfigError(key, f"unknown value {value!r}; known: {', '.join(known)}")

    for key in ("steps", "batch_size", "log_every", "data.seq_len", "data.max_bytes",
                "model.d_model", "model.n_layers", "model.n_heads",
                "strategy.backward_passes_per_step", "strategy.period", "strategy.fragments",
                "checkpoint.keep", "compressor.levels", "compressor.approx_rank"):
        obj = cfg
        for part in key.split("."):
            obj = getattr(obj, part)
        if obj < 1:
            raise ConfigError(key, f"must be >= 1, got {obj}")
    for key in ("strategy.warmup_steps", "strategy.delay", "checkpoint.every",
                "compressor.start_iter", "optimizer.freeze_step"):
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name) < 0:
            raise ConfigError(key, f"must be >= 0, got {getattr(getattr(cfg, section), name)}")
    s = cfg.strategy
    if s.name == "streaming-diloco" and s.delay >= s.period:
        raise ConfigError("strategy.delay", f"must be < strategy.period={s.period} (a fragment's "
                          f"reduction has to land before its next synchronisation), got {s.delay}")
    if not 0 <= s.alpha <= 1:
        raise ConfigError("strategy.alpha", f"must be in [0, 1], got {s.alpha}")
    if not s.outer_lr > 0:
        raise ConfigError("strategy.outer_lr", f"must be > 0, got {s.outer_lr}")
    if not 0 <= s.outer_momentum < 1:
        raise ConfigError("strategy.outer_momentum", f"must be in [0, 1), got {s.outer_momentum}")
    if not 0 < cfg.compressor.ratio <= 1:
        raise ConfigError("compressor.ratio", f"must be in (0, 1], got {cfg.compressor.ratio}")
    if cfg.comm.timeout_s < 0:
        raise ConfigError("comm.timeout_s", f"must be >= 0 (0 = no watchdog), got {cfg.comm.timeout_s}")
    if cfg.eval_every < 0 or (cfg.eval_every and cfg.eval_every % cfg.log_every):
        raise ConfigError("eval_every", f"must be 0 or a multiple of log_every={cfg.log_every}, "
                          f"got {cfg.eval_every}")
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
    one_of("compressor.name", cfg.compressor.name, list(COMPRESSORS))
    one_of("strategy.compressor", cfg.strategy.compressor, list(COMPRESSORS))
    one_of("strategy.outer_optimizer", cfg.strategy.outer_optimizer, OUTER_OPTIMIZERS)
    one_of("on_nonfinite", cfg.on_nonfinite, ("abort", "skip"))
    one_of("optimizer.name", cfg.optimizer.name, OPTIMIZERS)
    one_of("model.name", cfg.model.name, list(MODELS))
    if cfg.topology:
        raise ConfigError("topology", f"{cfg.topology!r}: only the flat world ('') is supported "
                          "until topology-aware levels land")
    if cfg.data.path and not Path(cfg.data.path).exists():
        raise ConfigError("data.path", f"{cfg.data.path!r} does not exist")
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = (),
                base: dict | None = None) -> Config:
    """Defaults (or ``base``, a saved ``Config.to_dict()``), updated by the TOML file at ``path``
    and then by ``key=value`` overrides."""
    cfg = Config()
    for k, v in (base or {}).items():
        _set(cfg, k, v)
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
