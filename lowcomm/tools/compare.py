"""``lowcomm compare``: every method on one model and one data order, one command.

Each method is its own ``mpirun`` of ``lowcomm train`` with the same config, seed, data order
and sample count, differing only in the method's overrides (:func:`methods`). The driver runs
outside MPI, shows one progress bar over all steps, and writes into ``--out``:

* ``<method>/``: each run's config.json, metrics.jsonl, summary.json, stdout/stderr logs;
* ``results.json``: one object per method (failed ones with their error);
* ``eval_loss_vs_bytes.png``, ``eval_loss_vs_wall.png``, ``eval_loss_vs_modelled_wall.png``,
  ``eval_loss_vs_steps.png``.

Modelled wall-clock answers "what would this cost on link L?": the run's computation plus the
α–β time of its traffic on L (:func:`lowcomm.comm.ledger.alpha_beta_seconds`: message rounds·α +
bytes/β, no overlap assumed). The computation is the run's ``compute_cpu_s``: CPU seconds of
the training steps minus those spent inside communication calls
(:func:`lowcomm.comm.ledger.compute_cpu_clock`, summed step by step; the slowest rank's). It is CPU
time, not wall-clock, so other processes on a busy machine do not inflate it (they took cores
from the run; they did not add work to it); only cache and memory-bandwidth contention still
shows. The table's header and footnote say so. A run that did not record it (a summary from
before) is an error, never replaced by wall-clock.

Measured wall-clock depends on the machine's load, which drifts (one method took 9.0 to 11.8 s
over an hour of runs on a 2-core machine). ``--repeat N`` runs the methods N times
interleaved (every method once, then every method again, …; runs 2…N in
``repeats/<k>/<method>``): a method's ``wall_s`` is the median of its runs, ``wall_s_runs``
all of them, and ``--relative-to METHOD`` divides each run's wall-clock by that method's in the
same round (a ratio of neighbours in time), the table giving the median ratio and its range.
Losses, bytes, curves and plots are the first run's; every run's ``state_sha256`` is compared
(``repeats_agree``).

Each method at its own settings (``--tune KEY=V1,V2,...``, :mod:`lowcomm.tools.tune`): a short
sweep per method into ``tune/<method>/<point>/``, the method then run at the point with the
lowest eval loss; ``tuning.json`` and the table's tuning section state what the sweeps cost.

By time budget (``--budget SECONDS``): every method trains until its modelled wall-clock on
the link reaches the budget (``[budget]``, :class:`lowcomm.run.lockstep.Budget`; ``--steps``
is then a cap), so the table ranks the methods by eval loss at equal modelled time. Either way
the table gives each method's modelled time to reach a target eval loss (``--target``, by
default ddp's final one), read off its eval-loss curve (linear between evaluations).
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

from . import compare_folder
from . import tune as tuning
from .compare_report import add_time_to_target, add_wall_ratios, modelled_wall, plot, table
from ..comm.ledger import Link
from ..errors import RunFolderError
from ..run.folder import close_run, json_text, lock, write_text
from ..run.supervise import Attempts, supervise

#: The comparisons that are not one registered method on its own: compositions of registered
#: pieces (a backend, an inner optimizer, a per-level policy, a topology-aware collective).
#: Every registered method and every compressor join them by themselves (:func:`methods`).
VARIANTS: dict[str, list[str]] = {
    "horovod": ["strategy.backend=horovod"],
    "muloco": ["strategy.name=diloco", "strategy.period=50", "optimizer.name=muon"],
    # ZeRO++'s quantized gradients and weights: about a quarter of SyncDP's bytes
    "zero2-qgz": ["strategy.name=zero2", "strategy.qgz=int8", "strategy.qwz=int8"],
    # sharded inside each datacenter, DiLoCo between them on the shards
    "dc-diloco-zero2": ["policy.rank=zero2", "policy.dc=diloco:period=50"],
    # the compute floor: every rank trains alone, one average at the end (one-shot averaging,
    # Zinkevich et al. 2010) -- the seconds per step of a run that does not communicate
    "no-comm": ["strategy.name=localsgd", "strategy.period=1000000000"],
    # topology-aware (run on a dc:D,rank:… topology: see default_topology)
    "ddp-hier": ["strategy.algorithm=hierarchical"],
    "dc-diloco": ["policy.dc=diloco:period=50,compressor=int8"],
    # SyncDP inside a datacenter (its buckets reduced after backward: with every core computing,
    # a reducer thread only competes with it -- said explicitly, since the emulated WAN's
    # datacenters share one machine's cores); across, streaming DiLoCo: one int8 fragment of 4
    # every eighth step (H = 32), sent while the next steps compute, its average landing two
    # steps later on top of their progress (merge = "add-local", DaSGD); the int8 exchange by
    # the α–β model's choice (compressor.collective = "auto": one all-gather round over a WAN at
    # few datacenters, where the two-phase exchange's second round trip would not hide)
    "dc-streaming": ["policy.rank=syncdp:overlap=false", "compressor.collective=auto",
                     "policy.dc=streaming-diloco:period=32,fragments=4,delay=2,merge=add-local,"
                     "outer_optimizer=sgd,outer_lr=1.0,outer_momentum=0,compressor=int8"],
}


def methods() -> dict[str, list[str]]:
    """Compare's name -> the config overrides that select it (on top of the shared config):
    every registered method one MPI job runs (:func:`lowcomm.run.registry.in_one_job`, under its
    ``compare_name`` with its ``compare`` overrides; user-registered ones included), SyncDP with
    every registered compressor (with its :data:`lowcomm.compress.COMPARE` settings), then
    :data:`VARIANTS`. Read at call time, so a method registered after import is listed."""
    from ..compress import COMPARE, COMPRESSORS
    from ..run.registry import in_one_job
    out: dict[str, list[str]] = {}

    def add(name: str, overrides: list[str], what: str) -> None:
        if name in out:
            raise ValueError(f"lowcomm compare: {what} takes the name {name!r}, which another "
                             f"comparison has already; give it another compare_name")
        out[name] = overrides
    for name, m in in_one_job().items():
        add(m.compare_name or name, [f"strategy.name={name}", *m.compare], f"method {name!r}")
    for name in COMPRESSORS:
        if name != "none":
            add(name, [f"compressor.name={name}", *COMPARE.get(name, ())], f"compressor {name!r}")
    for name, overrides in VARIANTS.items():
        add(name, list(overrides), f"variant {name!r}")
    return out


def methods_overrides(name: str) -> list[str]:
    """The overrides that select comparison ``name`` (:func:`methods`)."""
    return methods()[name]


MAIN_METHODS = ("ddp", "fp16", "int8", "topk", "ef-sign", "powersgd", "localsgd", "diloco")


def available(name: str) -> bool:
    """True when every piece the method names is registered in this installation."""
    from ..compress import COMPRESSORS
    from ..run.optimizers import OPTIMIZERS
    from ..run.registry import STRATEGIES
    for o in methods()[name]:
        key, _, value = o.partition("=")
        if (key == "compressor.name" and value not in COMPRESSORS) or \
           (key == "strategy.name" and value not in STRATEGIES) or \
           (key == "optimizer.name" and value not in OPTIMIZERS):
            return False
    return True


def resolve_methods(text: str) -> list[str]:
    """``"all"``, ``"main"`` or a comma list -> method names; unknown names are a ValueError
    listing the known ones."""
    known = methods()
    if text == "all":
        return [m for m in known if available(m)]
    if text == "main":
        return [m for m in MAIN_METHODS if available(m)]
    names = [m.strip() for m in text.split(",") if m.strip()]
    twice = sorted({m for m in names if names.count(m) > 1})
    if twice:
        raise ValueError(f"method(s) {', '.join(twice)} given more than once")
    unknown = [m for m in names if m not in known]
    if unknown or not names:
        raise ValueError(f"unknown method(s) {', '.join(unknown) or '(none given)'}; known: "
                         f"{', '.join(known)} (or 'all', 'main')")
    missing = [m for m in names if not available(m)]
    if missing:
        raise ValueError(f"method(s) {', '.join(missing)} are not available in this installation")
    return names


@contextlib.contextmanager
def over_emulated_wan(np: int, dcs: int, link: Link):
    """Bring up an emulated WAN of ``dcs`` datacenters joined by ``link`` (lowcomm/tools/wan.py, root),
    yield the launch prefix that runs ``np`` ranks over it (launchers/wan.sh), take it down."""
    from .wan import WanSpec, down, require_root, state, up
    require_root("lowcomm compare --wan DELAY_MS,RATE_MBIT")
    if state():
        raise RuntimeError("an emulated WAN is already up; 'lowcomm wan down' first (compare "
                           "brings up its own with the link it reports)")
    launcher = Path(__file__).resolve().parents[2] / "launchers" / "wan.sh"
    if not launcher.is_file():
        raise FileNotFoundError(f"lowcomm compare --wan runs its ranks with {launcher}, which is not "
                                "there: run it from a clone of the lowcomm repository")
    up(WanSpec(dcs, link.delay_ms, link.rate_mbit))
    try:
        yield [str(launcher), "--dcs", str(dcs)]
    finally:
        down(quiet=True)


def default_topology(np: int, dcs: int = 2) -> str:
    """``dc:D,rank:…`` with the ranks in D blocks as launchers/wan.sh places them."""
    counts = [np // dcs + (i < np % dcs) for i in range(dcs)]
    return f"dc:{dcs},rank:" + ("+".join(map(str, counts)) if len(set(counts)) > 1 else str(counts[0]))


def needs_topology(method: str) -> bool:
    return any(o.startswith("policy.") or o.endswith("=hierarchical") for o in methods()[method])


def mpirun_command(np: int, launcher: str | list[str] | None) -> list[str]:
    """The launch prefix: ``launcher -n np`` when given (a path, or a list: the command and
    its own options), else mpirun with this machine's flags."""
    if launcher:
        return [*([launcher] if isinstance(launcher, str) else launcher), "-n", str(np)]
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        raise RuntimeError("mpirun not found on PATH; run 'make setup' (Open MPI) first")
    cmd = [mpirun, "-n", str(np), "--oversubscribe", "--bind-to", "none",
           "-x", "OMP_NUM_THREADS=1", "-x", "LOWCOMM_NUM_THREADS=1", "-x", "PATH"]
    if os.geteuid() == 0:
        cmd.append("--allow-run-as-root")
    return cmd


@dataclass(frozen=True)
class CompareOptions:
    """What a comparison runs with (``lowcomm compare``'s arguments, resolved), checked when
    built: ``methods`` on ``np`` ranks each for ``steps`` steps (a cap under a ``budget``), into
    ``out``; the shared ``config`` and ``overrides``; ``link``, the link of the modelled
    wall-clock and of the budget; ``launcher``, the launch prefix (a path, or a command and its
    options; None: mpirun); ``timeout_s`` per run; ``dcs``, the datacenters a topology-aware
    method runs on; ``max_restarts`` per run; ``overwrite`` earlier results; ``budget``, modelled
    seconds per method (0: none); ``target``, the eval loss of the time-to-target column (None:
    ddp's final one); ``repeat``, rounds of runs, every method once a round; ``relative_to``,
    the method every wall-clock is divided by, round by round; ``tune``, ``{key: values}`` swept
    for ``tune_steps`` steps per method before its run (:mod:`lowcomm.tools.tune`)."""
    methods: tuple[str, ...]
    np: int
    steps: int
    out: Path
    config: str | None = None
    overrides: tuple[str, ...] = ()
    link: Link = Link(25, 100)
    launcher: str | tuple[str, ...] | None = None
    timeout_s: float = 3600
    progress: bool = True
    dcs: int = 2
    max_restarts: int = 0
    overwrite: bool = False
    budget: float = 0.0
    target: float | None = None
    repeat: int = 1
    relative_to: str | None = None
    tune: dict | None = None
    tune_steps: int = 0

    def __post_init__(self):
        if self.repeat < 1:
            raise ValueError(f"repeat must be >= 1, got {self.repeat}")
        if self.tune and self.tune_steps < 1:
            raise ValueError(f"tune_steps must be >= 1 with tune, got {self.tune_steps}")
        if self.relative_to and self.relative_to not in self.methods:
            raise ValueError(f"relative_to: {self.relative_to!r} is not one of the methods run "
                             f"({', '.join(self.methods)})")

    @property
    def run_overrides(self) -> tuple[str, ...]:
        """What every method's run is given: ``overrides``, then the budget's."""
        return (*self.overrides, *(budget_overrides(self.budget, self.link) if self.budget else ()))


@dataclass(frozen=True)
class Job:
    """One training run of a comparison: ``method`` for ``steps`` steps into ``folder``, with
    ``overrides`` (the comparison's), then the method's own, then ``extra`` (the values
    ``--tune`` chose); relaunched up to ``max_restarts`` times; ``round`` of ``--repeat``."""
    method: str
    folder: Path
    steps: int
    overrides: tuple[str, ...]
    extra: tuple[str, ...] = ()
    max_restarts: int = 0
    round: int = 1


def jobs(opts: CompareOptions) -> list[Job]:
    """A comparison's runs in order: every method once a round, ``repeat`` rounds (round k > 1
    into ``repeats/<k>/<method>``); a method's sweep (``--tune``) runs before its first."""
    return [Job(m, (opts.out if k == 1 else opts.out / compare_folder.REPEATS / str(k)) / m,
                opts.steps, opts.run_overrides, max_restarts=opts.max_restarts, round=k)
            for k in range(1, opts.repeat + 1) for m in opts.methods]


def run_method(job: Job, opts: CompareOptions, on_step=None) -> dict:
    """One run (:class:`Job`) on ``opts``'s ranks, launcher and config, supervised
    (:func:`lowcomm.run.supervise.supervise`: relaunched from its newest checkpoint up to
    ``job.max_restarts`` times); returns its summary (plus ``status``) or a record of its failure
    (``"failed"``, with the first line of the method's own error) or of a stop
    (``"interrupted"``); a finished run's whole summary.json is under ``"summary"``.
    ``opts.overwrite``: replace a run already in that folder (only a lowcomm run's files)."""
    run_dir = job.folder
    run_dir.mkdir(parents=True, exist_ok=True)
    own = [*methods()[job.method], *job.extra]
    sets = [*job.overrides, *own, f"steps={job.steps}"]
    launch = mpirun_command(opts.np, opts.launcher)
    args = [sys.executable, "-m", "lowcomm.cli", "train", "--quiet",
            *(["--config", opts.config] if opts.config else []),
            *[a for s in sets for a in ("--set", s)]]
    cmd = [*launch, *args, "--out", str(run_dir)]
    env, prefix = dict(os.environ), ""
    if needs_topology(job.method):
        env.setdefault("LOWCOMM_TOPOLOGY", default_topology(opts.np, opts.dcs))   # wan.sh sets the same
        prefix = f"LOWCOMM_TOPOLOGY={env['LOWCOMM_TOPOLOGY']} "
    write_text(run_dir / "command.txt", prefix + " ".join(cmd) + "\n")
    last = [0]

    def poll():
        last[0] = _progress(run_dir / "metrics.jsonl", last[0], on_step)

    result = supervise(launch, args, run_dir, Attempts(job.max_restarts, timeout_s=opts.timeout_s),
                       env=env, poll=poll, first=["--overwrite"] if opts.overwrite else [])
    poll()
    return _run_record({"method": job.method, "overrides": own}, result, run_dir / "summary.json")


def _run_record(record: dict, result: dict, summary_path: Path) -> dict:
    """A run's record from its supervisor's ``result`` and the summary it wrote."""
    if result["stopped"]:
        return {**record, "status": "interrupted", "restarts": result["restarts"],
                "error": f"stopped by {result['stopped']}"}
    if result["returncode"] != 0 or not summary_path.exists():
        f = result["failures"][-1] if result["failures"] else {"exit": result["returncode"],
                                                               "cause": "no summary written"}
        return {**record, "status": "failed", "restarts": result["restarts"],
                "error": f"exit {f['exit']}: {f['cause']}"}
    s = json.loads(summary_path.read_text())
    if not tuning.finite(s.get("eval_loss")):      # a task without held-out batches: no eval loss
        s["eval_loss"] = None
    return {**record, "status": "ok", "stopped": result["stopped"], **{k: s[k] for k in (
        "ranks", "steps", "params", "final_loss", "eval_loss", "bytes_total", "bytes_by_level",
        "wall_s", "skipped_steps", "state_sha256")}, "ranks_agree": s.get("ranks_agree"),
        "steps_done": s.get("steps_done", s["steps"]),
        "restarts": result["restarts"], "summary": s}


def _progress(metrics: Path, last: int, on_step) -> int:
    if on_step is None or not metrics.exists():
        return last
    lines = metrics.read_text().splitlines()
    if lines:
        try:
            step = json.loads(lines[-1])["step"]
        except ValueError:   # a line being written
            return last
        if step > last:
            on_step(step - last)
            return step
    return last


def budget_overrides(budget: float, link: Link) -> tuple[str, str]:
    """The ``--set`` overrides that give every method ``budget`` modelled seconds on ``link``."""
    return f"budget.seconds={budget:g}", f"budget.link={link.delay_ms:g},{link.rate_mbit:g}"


def compare(opts: CompareOptions) -> list[dict]:
    """Run every method of ``opts``, write results.json, plots and table.md; return the results
    (with the earlier results kept in ``opts.out``: :mod:`lowcomm.tools.compare_folder`, whose
    rules raise RunFolderError before anything runs). A stop (SIGINT/SIGTERM) ends the
    comparison: the finished methods' results are written, the method it stopped is marked
    ``interrupted`` and no further method starts (the CLI tells which did not run). Under a
    ``budget`` every method trains for that many modelled seconds on ``link`` (``steps`` is then
    a cap); with ``tune`` each method's sweep comes first and its runs train at the best values
    (:mod:`lowcomm.tools.tune`)."""
    out = opts.out
    plan = None
    if opts.tune:
        from ..run.api import load_config
        plan = tuning.plan(lambda o: load_config(opts.config, o),
                           {m: methods_overrides(m) for m in opts.methods}, opts.tune,
                           list(opts.overrides))
    out.mkdir(parents=True, exist_ok=True)
    busy = lock(out, f"compare:{out}", "choose another --out")
    if busy:
        raise RunFolderError(busy)
    try:
        kept = compare_folder.prepare(out, compare_folder.settings(opts), list(opts.methods),
                                      opts.overwrite)
        for r in kept:                      # the table's modelled column: this link
            summary = out / r["method"] / "summary.json"
            if r["status"] == "ok" and summary.exists():
                _costed(r, json.loads(summary.read_text()), opts.link)
        results = kept + _run_methods(opts, kept, plan)
        _write(opts, results)
        return results
    finally:
        close_run(f"compare:{out}")


def _write(opts: CompareOptions, results: list[dict]) -> None:
    """A comparison's files: results.json (with each method's time to the target and its
    wall-clock ratios), tuning.json, the plots and table.md."""
    out = opts.out
    target = add_time_to_target(out, results, opts.link, opts.target)
    add_wall_ratios(results, opts.relative_to, list(opts.methods))
    write_text(out / "results.json", json_text(results))
    if any(r.get("tuning") for r in results):
        write_text(out / "tuning.json", json_text(tuning.totals(results)))
    plot(out, results, opts.link, opts.budget, target)
    write_text(out / "table.md", table(results, opts.link, opts.budget, target) +
               tuning.table(results) + "\n")


def _costed(r: dict, summary: dict, link: Link) -> None:
    """A finished method's result gets its modelled wall-clock on ``link``."""
    r["modelled_wall_s"] = modelled_wall(summary, link)
    r["link"] = {"delay_ms": link.delay_ms, "rate_mbit": link.rate_mbit}


def _run_methods(opts: CompareOptions, kept: list[dict], plan: dict | None) -> list[dict]:
    """Run the comparison's :func:`jobs` one after another under one progress bar, results.json
    (``kept``'s results, then these) rewritten after each; a stop ends the loop after the run
    it came in. ``plan``: each method's tuning plan (None: no ``--tune``)."""
    runs = _Runs(opts, plan)
    try:
        for job in jobs(opts):
            go_on = runs.run(job)
            write_text(opts.out / "results.json", json_text(kept + list(runs.results.values())))
            if not go_on:
                break
    finally:
        runs.bar.close()
    return list(runs.results.values())


class _Runs:
    """A comparison's runs so far: the progress bar over all their steps, each method's record
    (its first round's, the later rounds added: :func:`_another_round`) and the values its sweep
    chose. A method failing in a later round is failed, with that round's error; a method's
    sweep comes before its first round, and every round runs at the values it chose."""

    def __init__(self, opts: CompareOptions, plan: dict | None):
        from tqdm import tqdm
        self.opts, self.plan = opts, plan
        swept = sum(len(plan[m]["points"]) for m in opts.methods) * opts.tune_steps if plan else 0
        self.bar = tqdm(total=opts.steps * len(opts.methods) * opts.repeat + swept, unit="step",
                        disable=not opts.progress, dynamic_ncols=True)
        self.results: dict[str, dict] = {}
        self.chosen: dict[str, tuple[str, ...]] = {}

    def run(self, job: Job) -> bool:
        """Run ``job`` and record it (a later round of a failed method is skipped); False when
        a stop came in: no further job runs."""
        if job.round > 1 and self.results[job.method]["status"] != "ok":
            self.bar.update(self.opts.steps)
            return True
        r, load = self._tuned(job)
        stopped = r.pop("stopped", None)     # it finished before the stop took
        self._add(job, r, load)
        if r["status"] == "interrupted" or stopped:
            for other in self.results.values():   # a round the others had no turn in
                if job.round > 1 and len(other.get("wall_s_runs", ())) < job.round and \
                        other["status"] == "ok":
                    other.setdefault("interrupted_round", job.round)
            return False
        return True

    def _add(self, job: Job, r: dict, load: float) -> None:
        """Round ``job.round``'s record ``r`` (run at 1-minute load ``load``) into the results."""
        k, method = job.round, job.method
        if r["status"] == "ok":
            s = r.pop("summary")
            r["compute_cpu_s"] = s["compute_cpu_s"]
            if k == 1:
                _costed(r, s, self.opts.link)
        else:
            self.bar.write(f"{method}{f' (round {k})' if k > 1 else ''} {r['status']}: {r['error']}")
        self.results[method] = r if k == 1 else _another_round(self.results[method], r, k)
        if r["status"] == "ok":
            self.results[method].setdefault("load_1m_runs", []).append(round(load, 2))

    def _tuned(self, job: Job) -> tuple[dict, float]:
        """``job``'s record, after its method's sweep in the first round, and the load when it
        started; the bar moved on by its steps."""
        method, repeat = job.method, self.opts.repeat
        tuned = None
        try:
            if self.plan and job.round == 1:
                tuned = self._sweep(method)
                self.chosen[method] = tuple(tuning.sets(tuned["chosen"] or {}))
        except KeyboardInterrupt:   # SIGINT while no job ran
            tuned = {"interrupted": True, "runs": []}
        self.bar.set_description(method if repeat == 1 else f"{method} ({job.round}/{repeat})")
        done_before, load = self.bar.n, os.getloadavg()[0]
        try:
            if tuned and tuned["interrupted"]:
                raise KeyboardInterrupt
            if tuned and tuned["chosen"] is None and tuned["runs"]:
                r = {"method": method, "overrides": methods_overrides(method),
                     "status": "failed", "error": tuning.failure(tuned)}
            else:
                r = run_method(dataclasses.replace(job, extra=self.chosen.get(method, ())),
                               self.opts, self.bar.update)
        except KeyboardInterrupt:   # SIGINT while no job ran (it had not started)
            r = {"method": method, "overrides": methods_overrides(method),
                 "status": "interrupted", "error": "stopped by SIGINT"}
        if tuned and "steps" in tuned:
            r["tuning"] = tuned
        self.bar.update(done_before + self.opts.steps - self.bar.n)
        return r, load

    def _sweep(self, method: str) -> dict:
        """``method``'s ``--tune`` sweep (:func:`lowcomm.tools.tune.sweep`), each point's run in
        ``out/tune/<method>/<point>`` with one evaluation, at its end, under the progress bar."""
        opts, steps = self.opts, self.opts.tune_steps
        sets = (*opts.overrides, "eval_every=0")

        def one(point, name):
            folder = opts.out / compare_folder.TUNE / method / name
            self.bar.set_description(f"{method} tune {name}")
            done_before = self.bar.n
            r = run_method(Job(method, folder, steps, sets, tuple(tuning.sets(point))), opts,
                           self.bar.update)
            self.bar.update(done_before + steps - self.bar.n)
            return r, folder
        return tuning.sweep(method, self.plan[method], steps, one)


def _another_round(first: dict, r: dict, k: int) -> dict:
    """The first round's record with round ``k``'s run ``r`` added: its wall-clock among
    ``wall_s_runs`` (``wall_s`` their median); its failure; or, stopped, the rounds before
    with ``interrupted_round``."""
    if r["status"] == "interrupted":
        return {**first, "interrupted_round": k}
    if r["status"] != "ok":
        return {**r, "error": f"round {k}: {r['error']}"}
    walls = [*first.get("wall_s_runs", [first["wall_s"]]), r["wall_s"]]
    cpus = [*first.get("compute_cpu_s_runs", [first["compute_cpu_s"]]), r["compute_cpu_s"]]
    return {**first, "wall_s": statistics.median(walls), "wall_s_runs": walls,
            "compute_cpu_s_runs": cpus,
            "repeats_agree": first.get("repeats_agree", True) and
            r["state_sha256"] == first["state_sha256"]}
