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

OPTIMIZERS = ("adamw", "adam", "sgd", "onebit-adam")
OUTER_OPTIMIZERS = ("nesterov", "sgd")
LR_SCHEDULES = ("constant", "cosine")


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
    # gossip (decentralized; issue 9)
    graph: str = "ring"            # ring | torus | exponential | one-peer-exponential | complete
    gossip_mode: str = "dpsgd"     # "dpsgd" (Lian 2017) | "push-sum" (SGP) | "async"
    gossip_order: str = "cta"      # "cta": mix then step, exchange overlapped | "atc": step then mix
    consensus_step: float = 1.0    # CHOCO's γ (with strategy.compressor)
    # asynchronous parameter server (issue 7; lowcomm/strategies/async_ps.py)
    servers: int = 1               # S: ranks 0..S-1 serve parameter shards, the rest train
    max_staleness: int = -1        # τ: -1 fully asynchronous, 0 synchronous, > 0 SSP
    staleness_lr: bool = False     # lr / staleness (Zhang et al. 2016)
    dc_lambda: float = 0.0         # DC-ASGD's λ (Zheng et al. 2017); 0 = off
    worker_timeout_s: float = 30.0  # a worker silent this long (owed nothing) is lost
    server_timeout_s: float = 10.0  # a server silent this long (owing a reply) ends the job


@dataclass
class CompressorConfig:
    name: str = "none"
    error_feedback: bool | None = None   # None: the method's own default (on for top-k)
    ratio: float = 0.01            # top-k / random-k: share of elements kept
    levels: int = 16               # QSGD quantisation levels s
    approx_rank: int = 2           # PowerSGD rank r
    start_iter: int = 10           # PowerSGD: dense all-reduce before this step
    min_compression_rate: float = 1.0   # PowerSGD: compress a matrix iff n·m > rate·r(n+m)
    bucket_size: int = 512         # QSGD: elements sharing one norm (the paper's bucket size d)
    seed: int = 0                  # qsgd / randomk / powersgd generators (saved in checkpoints)
    collective: str = "auto"       # all-gathered methods: "auto" (α–β) | "allgather" | "two-phase"


@dataclass
class OptimizerConfig:
    name: str = "adamw"
    weight_decay: float = 0.0
    momentum: float = 0.0          # sgd only
    beta1: float = 0.9
    beta2: float = 0.95
    freeze_step: int = 100         # onebit-adam: dense Adam warm-up steps
    schedule: str = "constant"     # lr over the run: "constant" | "cosine" (to min_lr_ratio * lr)
    warmup_steps: int = 0          # linear lr warm-up from lr/warmup_steps to lr
    min_lr_ratio: float = 0.1      # cosine: the lr at the last step, as a fraction of lr


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
    policy: dict[str, str] = field(default_factory=dict)   # level -> "NAME[:key=value,...]"
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
        if self.policy:
            return "policy(" + ";".join(f"{k}={v}" for k, v in self.policy.items()) + ")"
        s = self.strategy
        name = "syncdp(horovod)" if s.backend == "horovod" else f"{s.name}({s.algorithm})"
        if self.compressor.name != "none":
            name += f"+{self.compressor.name}"
        if s.compressor != "none":
            name += f"[{s.compressor}]"
        return name


def _set(obj, dotted: str, value, prefix: str = "") -> None:
    head, _, rest = dotted.partition(".")
    key = prefix + head
    hints = typing.get_type_hints(type(obj))
    if head not in hints:
        known = ", ".join(prefix + f.name for f in dataclasses.fields(obj))
        raise ConfigError(key, f"unknown key; known here: {known}")
    current = getattr(obj, head)
    if typing.get_origin(hints[head]) is dict:           # policy: level -> spec
        items = {rest: value} if rest else value
        if not isinstance(items, dict):
            raise ConfigError(key, f"is a table (level = spec), got {value!r}")
        for k, v in items.items():
            current[k] = _policy_spec(f"{key}.{k}", v)
        return
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


# keys a per-level policy spec may set (lowcomm/strategies/policy.py)
POLICY_KEYS = {
    "syncdp": ("algorithm", "bucket_mb", "overlap", "compressor"),
    "localsgd": ("period", "algorithm"),
    "diloco": ("period", "outer_optimizer", "outer_lr", "outer_momentum", "compressor", "algorithm"),
    "streaming-diloco": ("period", "outer_optimizer", "outer_lr", "outer_momentum", "compressor",
                         "algorithm", "fragments", "delay", "alpha"),
}


def _policy_spec(key: str, value) -> str:
    """A policy entry as its spec string: ``"diloco:period=50"`` or a TOML table
    ``{name = "diloco", period = 50}``."""
    if isinstance(value, dict):
        value = dict(value)
        name = value.pop("name", None)
        if not isinstance(name, str):
            raise ConfigError(key + ".name", "a policy table needs name = \"syncdp\" | \"localsgd\" | ...")
        opts = ",".join(f"{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in value.items())
        value = name + (":" + opts if opts else "")
    if not isinstance(value, str):
        raise ConfigError(key, f"expects a spec string like \"diloco:period=50,compressor=int8\", "
                          f"got {type(value).__name__} {value!r}")
    parse_policy(key.removeprefix("policy."), value)
    return value


def parse_policy(level: str, spec: str) -> tuple[str, dict]:
    """``"diloco:period=50,compressor=int8"`` -> ``("diloco", {"period": 50, "compressor": "int8"})``;
    values read as TOML literals where they are one, else as strings."""
    name, _, rest = spec.partition(":")
    name = name.strip()
    if name not in POLICY_KEYS:
        raise ConfigError(f"policy.{level}", f"unknown policy {name!r} in {spec!r}; known: "
                          f"{', '.join(POLICY_KEYS)}")
    opts: dict = {}
    for item in filter(None, (x.strip() for x in rest.split(","))):
        k, eq, raw = item.partition("=")
        k = k.strip()
        if not eq:
            raise ConfigError(f"policy.{level}", f"option {item!r} in {spec!r} must look like key=value")
        if k not in POLICY_KEYS[name]:
            raise ConfigError(f"policy.{level}.{k}", f"not an option of {name}; known: "
                              f"{', '.join(POLICY_KEYS[name])}")
        opts[k] = parse_override(f"v={raw}")[1]
    return name, opts


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
                "compressor.start_iter", "optimizer.freeze_step", "optimizer.warmup_steps"):
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
    _validate_compressor(cfg.compressor)
    if cfg.comm.timeout_s < 0:
        raise ConfigError("comm.timeout_s", f"must be >= 0 (0 = no watchdog), got {cfg.comm.timeout_s}")
    if cfg.eval_every < 0 or (cfg.eval_every and cfg.eval_every % cfg.log_every):
        raise ConfigError("eval_every", f"must be 0 or a multiple of log_every={cfg.log_every}, "
                          f"got {cfg.eval_every}")
    if cfg.eval_batches < 0:
        raise ConfigError("eval_batches", f"must be >= 0, got {cfg.eval_batches}")
    if not cfg.lr > 0:
        raise ConfigError("lr", f"must be > 0, got {cfg.lr}")
    if cfg.optimizer.warmup_steps >= cfg.steps:
        raise ConfigError("optimizer.warmup_steps", f"must be < steps={cfg.steps}, "
                          f"got {cfg.optimizer.warmup_steps}")
    if not 0 <= cfg.optimizer.min_lr_ratio <= 1:
        raise ConfigError("optimizer.min_lr_ratio", f"must be in [0, 1], got {cfg.optimizer.min_lr_ratio}")
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
    one_of("optimizer.schedule", cfg.optimizer.schedule, LR_SCHEDULES)
    if s.backend != "mpi" and s.name != "syncdp":
        raise ConfigError("strategy.backend", f"{s.name} sends lowcomm's own messages; only "
                          f"syncdp runs on the {s.backend!r} backend (use backend = \"mpi\")")
    _validate_gossip(cfg, one_of)
    _validate_async_ps(cfg)
    _validate_outer(cfg)
    one_of("optimizer.name", cfg.optimizer.name, OPTIMIZERS)
    one_of("model.name", cfg.model.name, list(MODELS))
    if cfg.topology:   # level spec, e.g. "dc:2,rank:2" (lowcomm/topology.py); ConfigError names it
        from .topology import Topology
        levels = Topology.parse(cfg.topology).names
    if cfg.policy:     # each level's strategy checked as a config of its own
        from .strategies.policy import level_config, levels_plan
        if cfg.strategy.name != "syncdp":
            raise ConfigError("policy", f"give either strategy.name ({cfg.strategy.name!r}) or "
                              "policy.<level>, not both")
        if cfg.topology:       # else the levels come from the environment when the job starts
            levels_plan(cfg, levels)
        for level, spec in cfg.policy.items():
            level_config(cfg, level, *parse_policy(level, spec))
    if cfg.data.path and not Path(cfg.data.path).exists():
        raise ConfigError("data.path", f"{cfg.data.path!r} does not exist")
    return cfg


def _validate_compressor(c: CompressorConfig) -> None:
    """The [compressor] keys (whether approx_rank fits the model's matrices: at the first step)."""
    if not 0 < c.ratio <= 1:
        raise ConfigError("compressor.ratio", f"must be in (0, 1], got {c.ratio}")
    if not 1 <= c.levels <= 127:
        raise ConfigError("compressor.levels", f"must be in [1, 127] (levels are sent as int8), "
                          f"got {c.levels}")
    if c.bucket_size < 1:
        raise ConfigError("compressor.bucket_size", f"must be >= 1, got {c.bucket_size}")
    if not c.min_compression_rate >= 0:
        raise ConfigError("compressor.min_compression_rate", f"must be >= 0, got {c.min_compression_rate}")
    from .compress import check
    check(c)


def _validate_gossip(cfg: Config, one_of) -> None:
    """Gossip keys (whether a graph fits the rank count is checked when the job starts)."""
    from .strategies.gossip import MODES, ORDERS
    from .strategies.graphs import GRAPHS
    s = cfg.strategy
    one_of("strategy.graph", s.graph, GRAPHS)
    one_of("strategy.gossip_mode", s.gossip_mode, MODES)
    one_of("strategy.gossip_order", s.gossip_order, ORDERS)
    if not 0 < s.consensus_step <= 1:
        raise ConfigError("strategy.consensus_step", f"must be in (0, 1], got {s.consensus_step}")
    if s.name != "gossip":
        return
    if cfg.compressor.name != "none":
        raise ConfigError("compressor.name", "gossip exchanges parameters, not gradients; name the "
                          "parameter compressor in strategy.compressor")
    if s.compressor != "none" and (s.gossip_mode != "dpsgd" or s.graph == "one-peer-exponential"):
        raise ConfigError("strategy.compressor", "compressed (CHOCO) gossip needs gossip_mode = "
                          "\"dpsgd\" on a static graph")
    if s.compressor == "none" and s.consensus_step != 1:
        raise ConfigError("strategy.consensus_step", "is CHOCO's γ: it needs strategy.compressor")


def _validate_outer(cfg: Config) -> None:
    """Local SGD / DiLoCo / streaming DiLoCo keys (fragments vs. the model: at construction)."""
    s = cfg.strategy
    if s.name not in ("localsgd", "diloco", "streaming-diloco"):
        return
    if cfg.compressor.name != "none" and s.warmup_steps == 0:
        raise ConfigError("compressor.name", f"compresses gradients, which {s.name} exchanges only "
                          "during strategy.warmup_steps (0 here); the pseudo-gradient's compressor "
                          "is strategy.compressor")
    if s.name == "localsgd" and s.compressor != "none":
        raise ConfigError("strategy.compressor", "localsgd averages parameters; to compress, use "
                          "strategy.name=\"diloco\" with outer_optimizer=\"sgd\", outer_lr=1, "
                          "outer_momentum=0 (the same update on a compressed pseudo-gradient)")
    if s.name != "localsgd" and s.outer_optimizer == "nesterov" and s.outer_momentum == 0:
        raise ConfigError("strategy.outer_momentum", "Nesterov needs a momentum > 0; for none use "
                          "strategy.outer_optimizer=\"sgd\"")


def _validate_async_ps(cfg: Config) -> None:
    """Asynchronous parameter-server keys (whether ``servers`` fits the rank count is checked
    when the job starts)."""
    s = cfg.strategy
    if s.servers < 1:
        raise ConfigError("strategy.servers", f"must be >= 1, got {s.servers}")
    if s.max_staleness < -1:
        raise ConfigError("strategy.max_staleness", f"must be >= -1 (-1 = fully asynchronous), "
                          f"got {s.max_staleness}")
    if s.dc_lambda < 0:
        raise ConfigError("strategy.dc_lambda", f"must be >= 0 (0 = off), got {s.dc_lambda}")
    for key in ("worker_timeout_s", "server_timeout_s"):
        if not getattr(s, key) > 0:
            raise ConfigError(f"strategy.{key}", f"must be > 0, got {getattr(s, key)}")
    if s.name != "async-ps":
        return
    if s.compressor != "none":
        raise ConfigError("strategy.compressor", "async-ps pushes gradients: name their "
                          "compressor in compressor.name")
    if s.backward_passes_per_step != 1:
        raise ConfigError("strategy.backward_passes_per_step", "async-ps pushes after every "
                          "backward pass; gradient accumulation is not supported")
    if cfg.optimizer.name == "onebit-adam":
        raise ConfigError("optimizer.name", "onebit-adam owns its exchange; async-ps servers step "
                          "sgd, adam or adamw")
    for key, value, constant in (("schedule", cfg.optimizer.schedule, "constant"),
                                 ("warmup_steps", cfg.optimizer.warmup_steps, 0)):
        if value != constant:
            raise ConfigError(f"optimizer.{key}", "async-ps servers step at a constant lr (their "
                              "updates are not numbered by one global step); use "
                              "optimizer.schedule = \"constant\" and optimizer.warmup_steps = 0")
    if cfg.checkpoint.every and s.max_staleness != 0:
        raise ConfigError("checkpoint.every", "async-ps checkpoints only with "
                          "strategy.max_staleness = 0 (synchronous): asynchronous servers and "
                          "workers never pass a common step whose state could be saved")
    if cfg.eval_every and s.servers != 1:
        raise ConfigError("eval_every", "async-ps evaluates during the run only with "
                          "strategy.servers = 1 (rank 0 then holds the whole model); use 0 to "
                          "evaluate at the end")


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
