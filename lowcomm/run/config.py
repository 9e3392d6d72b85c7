"""One validated configuration tree: defaults, then a TOML file, then ``--set a.b=value``.

This module is generic: it knows the run's own keys (steps, lr, [optimizer], [checkpoint], ...)
and keeps the method tables as the user wrote them. ``[strategy]`` (``name`` plus that
strategy's options) and ``policy.<level>`` specs are checked against the settings that each
strategy module owns by :func:`lowcomm.run.api.load_config`, which also checks ``[compressor]``;
this module imports no strategy.

Unknown keys and values of the wrong type are :class:`~lowcomm.errors.ConfigError` naming the
key. Every table is a :class:`~lowcomm.settings.Settings` that checks its own values
(``validate(prefix)``, as the methods' settings do); :func:`validate` adds only the rules
between tables. Values given with ``--set`` are read as TOML literals (``3``, ``0.5``, ``true``, ``"x"``);
anything that is not a literal is taken as a string.

Example::

    cfg = load_config("run.toml", ["strategy.algorithm=ring", "steps=500"])
    cfg.strategy["algorithm"]     # 'ring'
"""
from __future__ import annotations

import dataclasses
import math
import tomllib
import typing
from dataclasses import dataclass, field
from pathlib import Path

from ..compress.settings import CompressorSettings as CompressorConfig
from ..comm import watchdog
from ..comm.ledger import Link
from ..errors import ConfigError
from ..settings import NonFinite, Settings, coerce

LR_SCHEDULES = ("constant", "cosine")
#: the task every run trains unless ``task`` says otherwise
DEFAULT_TASK = "lowcomm.tasks.bytelm"


@dataclass
class DataConfig(Settings):
    path: str = ""                 # text file or directory; "" = the Python standard library
    glob: str = ""                 # files of a directory to read; "" = all (the stdlib: *.py)
    seq_len: int = 64              # bytes per training window (the model's context)
    max_bytes: int = 8_000_000     # read at most this much text (train + eval)
    eval_fraction: float = 0.05    # share of files held out for evaluation

    def validate(self, prefix: str = "data.") -> None:
        _at_least(self, prefix, 1, "seq_len", "max_bytes")
        if not 0 < self.eval_fraction < 1:
            raise ConfigError(prefix + "eval_fraction", f"must be in (0, 1), got {self.eval_fraction}")
        if self.path and not Path(self.path).exists():
            raise ConfigError(prefix + "path", f"{self.path!r} does not exist")


@dataclass
class ModelConfig(Settings):
    name: str = "tinygpt"          # the built-in byte-level GPT (the only one)
    d_model: int = 128             # width
    n_layers: int = 2              # transformer blocks
    n_heads: int = 4               # attention heads (a divisor of d_model)

    def validate(self, prefix: str = "model.") -> None:
        _at_least(self, prefix, 1, "d_model", "n_layers", "n_heads")
        if self.d_model % self.n_heads:
            raise ConfigError(prefix + "n_heads", f"must divide {prefix}d_model={self.d_model}")


@dataclass
class OptimizerConfig(Settings):
    name: str = "adamw"            # any torch.optim class, lower case ("sgd", "nadam", …); "muon": Muon + AdamW
    weight_decay: float = 0.0      # L2 or decoupled weight decay, as the optimizer defines it
    momentum: float | None = None  # unset: the optimizer's own default (sgd: 0, muon: 0.95)
    beta1: float = 0.9             # Adam family: first-moment decay
    beta2: float = 0.95            # Adam family: second-moment decay
    schedule: str = "constant"     # lr over the run: "constant" | "cosine" (to min_lr_ratio * lr)
    warmup_steps: int = 0          # linear lr warm-up from lr/warmup_steps to lr
    min_lr_ratio: float = 0.1      # cosine: the lr at the last step, as a fraction of lr
    options: dict = field(default_factory=dict)   # further constructor arguments of the optimizer

    def validate(self, prefix: str = "optimizer.") -> None:
        _at_least(self, prefix, 0, "warmup_steps")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(prefix + "min_lr_ratio", f"must be in [0, 1], got {self.min_lr_ratio}")
        if self.schedule not in LR_SCHEDULES:
            raise ConfigError(prefix + "schedule", f"unknown value {self.schedule!r}; known: "
                              f"{', '.join(LR_SCHEDULES)}")
        from .optimizers import check_optimizer      # imports torch: only when a config is checked
        check_optimizer(self)


@dataclass
class CommConfig:
    """How the run's communicators check and watch their calls. Not a Settings: its key
    ``validate`` takes the checking method's name; :func:`check_comm` checks it."""
    validate: bool = True          # per-call shape/dtype agreement check (one small all-gather)
    # watchdog (lowcomm/watchdog.py): a call waiting longer than
    #   max(timeout_s, watchdog_factor × its α–β prediction) + outage_s (wide-area links only)
    # ends the job; defaults from $LOWCOMM_TIMEOUT_S, $LOWCOMM_WATCHDOG_FACTOR,
    # $LOWCOMM_WATCHDOG_OUTAGE_S, else 60 s, 10, 30 s
    timeout_s: float = field(default_factory=lambda: watchdog.default_timeout_s())   # floor; 0 = off
    watchdog_factor: float = field(default_factory=lambda: watchdog.default_factor())  # × α–β time
    outage_s: float = field(default_factory=lambda: watchdog.default_outage_s())   # WAN links: extra wait


def check_comm(c: CommConfig, prefix: str = "comm.") -> None:
    """The [comm] table's values (each watchdog limit a finite number >= 0)."""
    for key in ("timeout_s", "watchdog_factor", "outage_s"):
        v = getattr(c, key)
        if not 0 <= v < float("inf"):
            raise ConfigError(prefix + key, f"must be a number >= 0"
                              f"{' (0 = no watchdog)' if key == 'timeout_s' else ''}, got {v}")


@dataclass
class CheckpointConfig(Settings):
    every: int = 0                 # write a checkpoint every N steps (0 = never)
    keep: int = 2                  # keep the newest N checkpoints
    dir: str = ""                  # "" = <out>/checkpoints
    format: str = "torch"          # "torch": per-rank files; "dcp": the model through torch.distributed.checkpoint

    def validate(self, prefix: str = "checkpoint.") -> None:
        from .dcp import FORMATS
        _at_least(self, prefix, 1, "keep")
        _at_least(self, prefix, 0, "every")
        self.one_of(prefix, "format", FORMATS)


@dataclass
class CompareConfig(Settings):
    """What ``lowcomm compare --config FILE`` runs (``lowcomm train`` ignores this table)."""
    question: str = ""             # what the experiment asks
    expect: str = ""               # the outcome we expect, in words
    methods: str = "main"          # comma list, "main" or "all"
    np: int = 4                    # ranks per method
    link: str = "25,100"           # DELAY_MS,RATE_MBIT of the modelled wall-clock
    repeat: int = 1                # runs of every method, interleaved (wall s: their median)
    relative_to: str = ""          # a method whose wall-clock the others' is divided by

    def validate(self, prefix: str = "compare.") -> None:
        _at_least(self, prefix, 1, "repeat")


@dataclass
class FleetConfig(Settings):
    """A fleet of datacenters (``lowcomm train --dcs D``, :mod:`lowcomm.run.fleet`): one MPI job
    per datacenter, the outer level across them through a coordinator."""
    dcs: int = 0                   # datacenters (0: one MPI job, no fleet)
    min_dcs: int = 0               # datacenters a round needs (0: a majority, dcs // 2 + 1)
    heartbeat_s: float = 0.5       # seconds between a datacenter leader's heartbeats
    max_failures: int = 3          # a datacenter failing more often is left out of the run
    heal_inner: str = "copy"       # a rejoining datacenter's inner optimizer state: "copy" | "reset"
    backoff_s: float = 1.0         # seconds before a failed datacenter is relaunched
    join_s: float = 600.0          # how long a relaunched datacenter waits to be admitted
    # a round may go ahead with `quorum` datacenters (0: it waits for every one) once the others
    # are `grace` × the median interval between rounds late; a late one's steps merge next round
    quorum: int = 0
    grace: float = 0.0
    # the fleet's secret (`lowcomm fleet key FILE` writes one; else $LOWCOMM_FLEET_SECRET_FILE):
    # "" on this machine or the emulated WAN makes one for the run; needed across hosts
    secret_file: str = ""
    # the rounds' traffic between datacenters: "tls" (TLS 1.3, only holders of the fleet's secret
    # connect; encrypted) | "gloo" (plain TCP, for a network the fleet trusts)
    transport: str = "tls"

    def validate(self, prefix: str = "fleet.") -> None:
        if self.dcs < 0 or self.dcs == 1:
            raise ConfigError(prefix + "dcs", f"must be 0 (no fleet) or >= 2 datacenters, got {self.dcs}")
        if not 0 <= self.min_dcs <= self.dcs:
            raise ConfigError(prefix + "min_dcs", f"must be in [0, {prefix}dcs={self.dcs}] (0: a "
                              f"majority), got {self.min_dcs}")
        for key in ("heartbeat_s", "backoff_s", "join_s"):
            v = getattr(self, key)
            if not 0 <= v < float("inf") or (key == "heartbeat_s" and v == 0):
                raise ConfigError(prefix + key, f"must be a finite number of seconds "
                                  f"{'> 0' if key == 'heartbeat_s' else '>= 0'}, got {v}")
        _at_least(self, prefix, 0, "max_failures")
        self.one_of(prefix, "heal_inner", ("copy", "reset"))
        self.one_of(prefix, "transport", ("tls", "gloo"))
        self._check_quorum(prefix)

    def _check_quorum(self, prefix: str) -> None:
        need = self.min_dcs or self.dcs // 2 + 1
        if self.quorum and not need <= self.quorum < self.dcs:
            raise ConfigError(prefix + "quorum", f"a round may go ahead with at least "
                              f"{prefix}min_dcs={need} and fewer than the fleet's {self.dcs} "
                              f"datacenters (0: every one), got {self.quorum}")
        if self.quorum and not 0 < self.grace < float("inf"):
            raise ConfigError(prefix + "grace", "the grace window is this share of the median "
                              "interval between rounds, > 0 (a round never leaves a datacenter "
                              f"out at once), got {self.grace}")
        if self.grace and not self.quorum:
            raise ConfigError(prefix + "grace", f"{self.grace} waits once {prefix}quorum "
                              f"datacenters are ready, but {prefix}quorum = 0 (every round waits "
                              f"for every datacenter); set {prefix}quorum")


@dataclass
class BudgetConfig(Settings):
    """A time budget: train until the run's modelled wall-clock on ``link`` — its computation's
    CPU seconds plus the α–β time of its traffic — reaches ``seconds`` (``steps`` is then a cap)."""
    seconds: float = 0.0           # modelled seconds to train for (0 = no budget: train `steps`)
    link: str = "25,100"           # DELAY_MS,RATE_MBIT of the link the budget is spent on
    evals: int = 10                # evaluations spread evenly over the budget (the curve to a target)

    def validate(self, prefix: str = "budget.") -> None:
        if not 0 <= self.seconds < float("inf"):
            raise ConfigError(prefix + "seconds", f"must be a number >= 0 (0 = no budget), got "
                              f"{self.seconds}")
        try:
            Link.parse(self.link)
        except ValueError as e:
            raise ConfigError(prefix + "link", str(e)) from None
        _at_least(self, prefix, 1, "evals")


@dataclass
class TaskConfig(Settings):
    """What to train (:mod:`lowcomm.tasks`): ``name`` is a Python file (``path/to/task.py``) or an
    importable module (``package.module``); ``options`` is everything else of the ``[task]``
    table, handed to the task as it is (``cfg.task.options``)."""
    name: str = DEFAULT_TASK       # a task file (path/to/task.py) or module (package.module)
    options: dict = field(default_factory=dict)   # the rest of [task], for the task (cfg.task.options)

    def validate(self, prefix: str = "task.") -> None:
        if not self.name:
            raise ConfigError(prefix.rstrip("."), "names no task (a file path.py or a module, "
                              f"e.g. {DEFAULT_TASK!r})")


@dataclass
class Config(Settings):
    steps: int = 300               # training steps (the parameter server: step-equivalents)
    seed: int = 0                  # seeds torch, Python's random and NumPy on every rank
    batch_size: int = 16           # samples per rank per step
    lr: float = 3e-3               # the inner optimizer's learning rate (peak, with a schedule)
    log_every: int = 10            # a metrics.jsonl line every N steps
    eval_batches: int = 16         # held-out batches evaluated (0 = none)
    eval_every: int = 0            # also evaluate every N steps (a multiple of log_every; 0 = end only)
    topology: str = ""             # e.g. "dc:2,rank:2"; "" = $LOWCOMM_TOPOLOGY or one level
    policy: dict[str, str] = field(default_factory=dict)   # level -> "NAME[:key=value,...]"
    on_nonfinite: NonFinite = NonFinite.ABORT   # NaN/Inf loss or gradient: "abort" or "skip" the step
    max_memory_gib: float = 0.0    # fail when a rank's peak memory after a step is above this (0: no cap)
    task: TaskConfig = field(default_factory=TaskConfig)
    data: DataConfig = field(default_factory=DataConfig)       # the built-in bytelm task's data
    model: ModelConfig = field(default_factory=ModelConfig)    # the built-in bytelm task's model
    strategy: dict = field(default_factory=lambda: {"name": "syncdp"})  # name + its options
    compressor: CompressorConfig = field(default_factory=CompressorConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    comm: CommConfig = field(default_factory=CommConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    compare: CompareConfig = field(default_factory=CompareConfig)
    fleet: FleetConfig = field(default_factory=FleetConfig)
    budget: BudgetConfig = field(default_factory=BudgetConfig)

    def validate(self, prefix: str = "") -> None:
        """The run's own keys, then every table's (each checks itself, named under its key)."""
        _at_least(self, prefix, 1, "steps", "batch_size", "log_every")
        _at_least(self, prefix, 0, "eval_batches")
        if "name" in self.strategy and not isinstance(self.strategy["name"], str):
            raise ConfigError(prefix + "strategy.name", f"expects str, got {self.strategy['name']!r}")
        if self.eval_every < 0 or (self.eval_every and self.eval_every % self.log_every):
            raise ConfigError(prefix + "eval_every", f"must be 0 or a multiple of "
                              f"log_every={self.log_every}, got {self.eval_every}")
        if not (self.lr > 0 and math.isfinite(self.lr)):
            raise ConfigError(prefix + "lr", f"must be a finite number > 0, got {self.lr}")
        if not 0 <= self.max_memory_gib < float("inf"):
            raise ConfigError(prefix + "max_memory_gib", f"must be a number of GiB >= 0 (0: no "
                              f"cap), got {self.max_memory_gib}")
        if self.topology:   # level spec, e.g. "dc:2,rank:2" (lowcomm/topology.py); ConfigError names it
            from ..comm.topology import Topology
            Topology.parse(self.topology)
        check_comm(self.comm, prefix + "comm.")
        for f in dataclasses.fields(self):
            table = getattr(self, f.name)
            if isinstance(table, Settings):
                table.validate(f"{prefix}{f.name}.")

    @property
    def method(self) -> str:
        """A short name of the method, e.g. ``syncdp(ring)+int8`` or ``diloco(mpi)[int8]``."""
        if self.policy:
            return "policy(" + ";".join(f"{k}={v}" for k, v in self.policy.items()) + ")"
        s = self.strategy
        name = s.get("name", "syncdp")
        name = "syncdp(horovod)" if s.get("backend") == "horovod" else f"{name}({s.get('algorithm', 'mpi')})"
        if self.compressor.name != "none":
            name += f"+{self.compressor.name}"
        if s.get("compressor", "none") not in ("none", ""):
            name += f"[{s['compressor']}]"
        return name


#: keys that moved, with what to write instead (read by :func:`_set`)
MOVED = {
    "optimizer.freeze_step": "1-bit Adam is a strategy: strategy.name = \"onebit-adam\" with "
                             "strategy.freeze_step = N (or the spec \"onebit-adam:freeze_step=N\")",
    "optimizer.name=onebit-adam": "1-bit Adam is a strategy: write strategy.name = \"onebit-adam\" "
                                  "(strategy.freeze_step = N) with optimizer.name = \"adam\" or "
                                  "\"adamw\"",
}


def _set(obj, dotted: str, value, prefix: str = "") -> None:
    head, _, rest = dotted.partition(".")
    key = prefix + head
    for moved in (key, f"{key}={value}"):
        if moved in MOVED and not rest:
            raise ConfigError(key, MOVED[moved])
    hints = typing.get_type_hints(type(obj))
    if head not in hints:
        known = ", ".join(prefix + f.name for f in dataclasses.fields(obj))
        raise ConfigError(key, f"unknown key; known here: {known}")
    current = getattr(obj, head)
    if isinstance(current, TaskConfig):
        _set_task(current, key, rest, value)
        return
    if typing.get_origin(hints[head]) is dict or hints[head] is dict:   # policy, strategy
        items = {rest: value} if rest else value
        if not isinstance(items, dict):
            raise ConfigError(key, f"is a table, got {value!r}")
        for k, v in items.items():
            if "." in k:
                raise ConfigError(f"{key}.{k}", "options of this table are not tables")
            current[k] = _policy_spec(f"{key}.{k}", v) if head == "policy" else v
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
    setattr(obj, head, coerce(key, hints[head], value))


def _set_task(task: TaskConfig, key: str, rest: str, value) -> None:
    """``task = "x.py"`` or ``--set task=x.py`` names the task; ``[task]`` with ``name`` and
    options, or ``task.<option> = value`` (also ``task.options.<option>``, as a saved config.json
    spells it), sets its options."""
    if not rest:
        if isinstance(value, str):
            task.name = value
            return
        if not isinstance(value, dict):
            raise ConfigError(key, f"is a task file, a module or a table, got {value!r}")
        for k, v in value.items():
            _set_task(task, key, k, v)
        return
    if rest == "name":
        task.name = coerce(f"{key}.name", str, value)
    elif rest == "options" and isinstance(value, dict):   # a saved config.json
        task.options.update(value)
    elif rest.startswith("options."):   # task.options.x: the option x, as config.json shows it
        _set_task(task, key, rest[len("options."):], value)
    else:
        task.options[rest] = value


def _policy_spec(key: str, value) -> str:
    """A policy entry as its spec string: ``"diloco:period=50"`` or a TOML table
    ``{name = "diloco", period = 50}`` (checked by :mod:`lowcomm.run.registry`)."""
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
    return value


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


def _at_least(table, prefix: str, low: int, *keys: str) -> None:
    for key in keys:
        v = getattr(table, key)
        if v < low:
            raise ConfigError(prefix + key, f"must be >= {low}, got {v}")


def validate(cfg: Config) -> Config:
    """Check the config: every table checks itself (:meth:`Config.validate`), then the rules
    between tables (the method tables: :func:`lowcomm.run.api.load_config`)."""
    cfg.validate()
    if cfg.optimizer.warmup_steps >= cfg.steps:
        raise ConfigError("optimizer.warmup_steps", f"must be < steps={cfg.steps}, "
                          f"got {cfg.optimizer.warmup_steps}")
    if cfg.budget.seconds and cfg.optimizer.schedule != "constant":
        raise ConfigError("budget.seconds", f"needs optimizer.schedule = \"constant\", got "
                          f"{cfg.optimizer.schedule!r}: under a time budget every method stops at "
                          "its own step, so a schedule over `steps` would leave each at another "
                          "point of it (warm-up steps are fine)")
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


def apply_comm_settings(cfg, comm) -> None:
    """``cfg.comm`` on ``comm``: shape validation and the watchdog's floor, factor and outage
    allowance. Before the run's first collective (the topology's communicators included), so
    that none of them waits under another run's limits."""
    comm.validate, comm.watchdog.timeout_s = cfg.comm.validate, cfg.comm.timeout_s
    comm.watchdog.factor, comm.watchdog.outage_s = cfg.comm.watchdog_factor, cfg.comm.outage_s
