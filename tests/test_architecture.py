"""The package's shape (DESIGN.md): no import cycle among lowcomm's modules, mpi4py called
from comm.py alone (and bench.py, whose vendor rows are baselines by definition), no
function over 60 lines, and no capability of lowcomm's objects probed with getattr/hasattr.

Imports are read with ``ast``, not executed: an import inside a function counts (it is a
dependency all the same, only a late one); one under ``if TYPE_CHECKING:`` does not (it exists
for annotations only). ``from pkg import name`` counts as importing ``pkg.name`` when that is a
module, else ``pkg`` (its ``__init__``).
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "lowcomm"

# Cycles allowed to remain for now, each with the reason and who removes it. Empty: the lead's
# settings/registry rewrite removed the last ones (config.py <-> strategies/*, policy.py).
KNOWN_CYCLES: set[frozenset[str]] = set()

# Modules allowed to call mpi4py: the Comm itself (every other module goes through its
# watchdog, and its ledger for data).
MPI_MODULES = {"lowcomm.comm.comm"}
RAW_MPI = re.compile(r"\.mpi\.|MPI\.COMM_WORLD\.|\b(Isend|Irecv|Iprobe|Improbe|issend|Issend)\(")


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, for __init__)."""
    out = {}
    for f in sorted(PACKAGE.rglob("*.py")):
        parts = list(f.relative_to(PACKAGE.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = f
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for n in ast.walk(node))
    return skip


def imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package modules ``name`` imports (see the module docstring for what counts)."""
    tree = ast.parse(path.read_text(), str(path))
    is_pkg = path.name == "__init__.py"
    skip = _type_checking_nodes(tree)
    targets: list[str] = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = name.split(".") if is_pkg else name.split(".")[:-1]
                base = base[:len(base) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets += [f"{mod}.{a.name}" for a in node.names] + [mod]
    out = set()
    for t in targets:
        while t and t not in known:      # a name inside a module: the module
            t = t.rpartition(".")[0]
        if t and t != name and t.split(".")[0] == PACKAGE.name:
            out.add(t)
    return out


def graph() -> dict[str, set[str]]:
    known = modules()
    return {m: imports(m, f, known) for m, f in known.items()}


def cycles(edges: dict[str, set[str]]) -> list[frozenset[str]]:
    """Strongly connected components of more than one module (Tarjan 1972), iteratively."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[frozenset[str]] = []
    counter = 0
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            w = next(it, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = counter
                    counter += 1
                    stack.append(w)
                    on.add(w)
                    work.append((w, iter(sorted(edges[w]))))
                elif w in on:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = set()
                while True:
                    x = stack.pop()
                    on.discard(x)
                    comp.add(x)
                    if x == v:
                        break
                if len(comp) > 1:
                    out.append(frozenset(comp))
    return out


def test_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [frozenset("abc")]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_import_graph_reads_relative_and_late_imports_but_not_type_checking(tmp_path):
    known = modules()
    assert "lowcomm.comm.comm" in imports("lowcomm.comm.collectives", known["lowcomm.comm.collectives"], known)
    # topology imports Comm only for annotations
    assert "lowcomm.comm.comm" not in imports("lowcomm.comm.topology", known["lowcomm.comm.topology"], known)
    # a function-level import counts: the loop imports the servers' module where it serves
    assert "lowcomm.run.serve" in imports("lowcomm.run.loop", known["lowcomm.run.loop"], known)


def test_no_import_cycles():
    found = cycles(graph())
    unexpected = [c for c in found if c not in KNOWN_CYCLES]
    assert not unexpected, "import cycles: " + "; ".join(" <-> ".join(sorted(c)) for c in unexpected)
    gone = [c for c in KNOWN_CYCLES if c not in found]
    assert not gone, ("allow-listed cycles no longer exist; remove them from KNOWN_CYCLES: "
                      + "; ".join(" <-> ".join(sorted(c)) for c in gone))


def folder_cycles(edges: dict[str, set[str]], package: str) -> list[frozenset[str]]:
    """The cycles among ``package``'s direct members (its modules and its folders, a folder
    standing for every module inside it): a folder and a sibling module that import each other
    are one, though no two single modules are."""
    def member(m: str) -> str | None:
        if not m.startswith(package + "."):
            return None
        return package + "." + m[len(package) + 1:].split(".")[0]
    folded: dict[str, set[str]] = {}
    for m, targets in edges.items():
        if member(m) is not None:
            folded.setdefault(member(m), set()).update(
                t for t in map(member, targets) if t is not None and t != member(m))
    for targets in list(folded.values()):
        for t in targets:
            folded.setdefault(t, set())
    return cycles(folded)


def test_no_import_cycles_between_the_folders_and_modules_of_a_package():
    """A folder and its sibling modules import one way (the method families under
    ``strategies/`` import the contract beside them, never the other way round)."""
    g = graph()
    packages = [m for m, f in modules().items() if f.name == "__init__.py"]
    found = [c for p in packages for c in folder_cycles(g, p)]
    assert not found, "folders and modules importing each other: " + "; ".join(
        " <-> ".join(sorted(c)) for c in found)


def test_the_folder_cycle_check_finds_a_folder_importing_its_importer():
    edges = {"p.a": {"p.f.x"}, "p.f.x": set(), "p.f.y": {"p.a"}, "p.b": {"p.a"}}
    assert folder_cycles(edges, "p") == [frozenset({"p.a", "p.f"})]
    assert folder_cycles({**edges, "p.f.y": set()}, "p") == []


def test_parameter_server_roles_depend_on_the_protocol_only():
    g = graph()
    worker, server = "lowcomm.strategies.ps.worker", "lowcomm.strategies.ps.server"
    assert server not in g[worker] and worker not in g[server]
    assert "lowcomm.strategies.ps.protocol" in g[worker] & g[server]
    # the servers' part of a run is called by the loop, never the other way round
    assert not {"lowcomm.run.loop", "lowcomm.run.api"} & g["lowcomm.run.serve"]


def _code_lines(path: Path) -> list[tuple[int, str]]:
    """Source lines without comments and docstrings/strings (so prose may name mpi4py)."""
    tree = ast.parse(path.read_text())
    strings = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            strings.update(range(node.lineno, node.end_lineno + 1))
    return [(i, line.split("#")[0]) for i, line in enumerate(path.read_text().splitlines(), 1)
            if i not in strings]


def test_only_comm_calls_mpi4py():
    """In the package, and in the tests, experiments and scripts that drive it (their vendor
    references go through Comm too: watched, and charged to a ledger of their own)."""
    bad = []
    others = [p for d in ("tests", "experiments", "scripts") for p in (PACKAGE.parent / d).rglob("*.py")
              if p != Path(__file__).resolve()]
    for name, path in [*modules().items(), *((str(p), p) for p in others)]:
        if name in MPI_MODULES:
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            mods = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else []
            if any(m == "mpi4py" or m.startswith("mpi4py.") for m in mods):
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}: imports mpi4py")
        for i, line in _code_lines(path):
            if RAW_MPI.search(line) or "sys.modules.get(\"mpi4py" in line:
                bad.append(f"{path.relative_to(PACKAGE.parent)}:{i}: {line.strip()}")
    assert not bad, "mpi4py outside comm.py (add the call to lowcomm.comm.comm.Comm):\n" + "\n".join(bad)


#: the layers, lowest first: a module imports only from its own layer or the ones below it
#: (``lowcomm/__init__.py``, the public facade, may name anything)
LAYERS = [
    {"lowcomm.errors", "lowcomm.settings"},
    {"lowcomm.comm"},
    {"lowcomm.compress"},
    {"lowcomm.strategies", "lowcomm.tasks", "lowcomm.parallel"},
    {"lowcomm.run"},
    {"lowcomm.integrations", "lowcomm.tools"},
    {"lowcomm.cli"},
]


def layer(module: str) -> int:
    for i, names in enumerate(LAYERS):
        if any(module == n or module.startswith(n + ".") for n in names):
            return i
    raise AssertionError(f"{module} is in no layer of LAYERS: add its folder there")


def test_layers_import_downwards_only():
    bad = [f"{m} (layer {layer(m)}) imports {t} (layer {layer(t)})"
           for m, targets in graph().items() if m != "lowcomm"
           for t in sorted(targets) if t != "lowcomm" and layer(t) > layer(m)]
    assert not bad, "imports against the layers:\n" + "\n".join(bad)


def test_layer_check_catches_an_upward_import():
    assert layer("lowcomm.strategies.sync.syncdp") < layer("lowcomm.run.loop")
    assert layer("lowcomm.comm.comm") < layer("lowcomm.compress.base")


#: the longest function the package may have, in lines (decorators excluded)
MAX_FUNCTION_LINES = 60


def long_functions(source: str, name: str) -> list[str]:
    """``name:line function (N lines)`` of each function in ``source`` longer than the limit."""
    return [f"{name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(ast.parse(source))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES]


def test_no_function_is_longer_than_60_lines():
    """Long functions hide their steps: split them into named helpers or a small class."""
    bad = [line for f in sorted(PACKAGE.rglob("*.py"))
           for line in long_functions(f.read_text(), str(f.relative_to(PACKAGE.parent)))]
    assert not bad, "\n".join(bad)


def test_the_length_check_counts_a_functions_lines():
    body = "\n".join(f"        x{i} = {i}" for i in range(MAX_FUNCTION_LINES - 1))
    source = f"def short():\n    pass\n\n\nclass C:\n    def long(self):\n{body}\n"
    assert long_functions(source, "m.py") == []
    assert long_functions(source + "        return x0\n", "m.py") == \
        [f"m.py:6 long ({MAX_FUNCTION_LINES + 1} lines)"]


#: the most parameters a function may take: positional and keyword-only ones (``self``/``cls``
#: not counted, nor ``*args``/``**kwargs``). More is a group of options that belongs in one
#: object (a frozen dataclass, as ``lowcomm compare``'s CompareOptions, a fleet member's Seat,
#: the run's objects a builder passes on as a Context).
MAX_PARAMETERS = 7


def parameters(node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> int:
    """The parameters a function takes, counted as :data:`MAX_PARAMETERS` says."""
    a = node.args
    return len([x.arg for x in (*a.posonlyargs, *a.args, *a.kwonlyargs)
                if x.arg not in ("self", "cls")])


def wide_functions(source: str, module: str) -> dict[str, int]:
    """``{module:qualified name: parameters}`` of each function of ``source`` over the limit."""
    out = {}

    def visit(node, names):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if parameters(node) > MAX_PARAMETERS:
                out[f"{module}:{'.'.join([*names, node.name])}"] = parameters(node)
            names = [*names, node.name]
        elif isinstance(node, ast.Lambda) and parameters(node) > MAX_PARAMETERS:
            out[f"{module}:{'.'.join([*names, '<lambda>'])}"] = parameters(node)
        elif isinstance(node, ast.ClassDef):
            names = [*names, node.name]
        for child in ast.iter_child_nodes(node):
            visit(child, names)
    visit(ast.parse(source), [])
    return out


def test_no_function_takes_more_than_7_parameters():
    """Many parameters are options threaded through: one object carries them (e.g.
    CompareOptions, TrainOptions, RunOptions, Context, Seat, ReducerSettings)."""
    found = {k: n for m, path in modules().items() for k, n in wide_functions(path.read_text(), m).items()}
    bad = [f"{k} takes {n} parameters" for k, n in sorted(found.items())]
    assert not bad, (f"functions over {MAX_PARAMETERS} parameters (pass an options object):\n"
                     + "\n".join(bad))


def test_the_parameter_check_counts_arguments_and_keywords_not_stars():
    source = ("class C:\n    def m(self, a, b, c, d, e, f, g, *args, **kw):\n        pass\n\n"
              "    @classmethod\n    def n(cls, a, b, c, d, e, f, *, g, h):\n        pass\n\n"
              "def f(a, b, c, d, e, f, g, /, h, **kw):\n    return lambda a, b, c, d, e, f, g, h: a\n")
    assert wide_functions(source, "m") == {"m:C.n": 8, "m:f": 8, "m:f.<lambda>": 8}


# one contract, declared (DESIGN.md) ------------------------------------------------------------
#: what the loop, the fleet, snapshots, integrations and policies ask of lowcomm's objects (a
#: method, its settings, a level, the place an average goes): declared with a default on the
#: class or protocol that defines it and read directly, never probed with getattr/hasattr
CAPABILITIES = {
    "is_server", "role", "model_state_dict", "load_model_state_dict", "full_model_state_dict",
    "clip_grad_norm_", "collective_forward", "sharded", "local_shards", "memory_tensors",
    "joined", "drain", "warmup_steps", "delay", "wait_s", "on_loss", "rank_peers", "whole",
    "rounds", "per_rank", "channel", "dcs", "arrivals", "late_rounds", "link", "fragments",
    "merge", "alpha", "slot", "nesterov_every", "algorithm", "to_local", "shards_model",
}

#: the getattr/hasattr calls with a literal name the package keeps, by (module, name): how many,
#: and why (none asks a lowcomm object for a capability). A new one fails the test.
ALLOWED: dict[tuple[str, str], tuple[int, str]] = {
    ("lowcomm.cli.main", "exit_code"): (2, "click's and the loop's exceptions: only some carry one"),
    ("lowcomm.cli.main", "signum"): (1, "an exception that stopped on a signal carries one"),
    ("lowcomm.comm.collectives", "turn"): (1, "a shared window's alternating half, set on first use"),
    ("lowcomm.comm.collectives", "files_own_levels"): (1, "a marker on an all-reduce function"),
    ("lowcomm.comm.comm", "__name__"): (1, "an mpi4py callable's name (foreign)"),
    ("lowcomm.comm.comm", "__self__"): (1, "an mpi4py bound method's owner (foreign)"),
    ("lowcomm.comm.base", "sched_getaffinity"): (1, "os has it on Linux only"),
    ("lowcomm.comm.ledger", "scope"): (2, "a threading.local, unset in a new thread"),
    ("lowcomm.compress", "collective"): (2, "a compressor config that may predate the key"),
    ("lowcomm.compress.bits", "buf"): (1, "a threading.local cache"),
    ("lowcomm.compress.scratch", "bufs"): (1, "a threading.local cache"),
    ("lowcomm.integrations.lightning", "name"): (1, "Lightning's reduce op: an enum or a string"),
    ("lowcomm.integrations.transformers", "__len__"): (1, "a user's dataset: sized or iterable"),
    ("lowcomm.parallel.deferred", "__name__"): (1, "a torch function's name (foreign: some "
                                                  "callables a torch function mode sees have none)"),
    ("lowcomm.run.api", "__name__"): (1, "a task given as a module or an object"),
    ("lowcomm.run.snapshot", "shape"): (1, "a state dict's values: tensors or extra state"),
    ("lowcomm.settings", "__name__"): (1, "a type hint: a class or a typing construct"),
    ("lowcomm.strategies.wrapped", "depth"): (2, "a threading.local counter, unset in a new thread"),
    ("lowcomm.strategies.guard", "lowcomm_ranges"): (1, "a marker on a torch optimizer (foreign)"),
    ("lowcomm.strategies.wrapped", "_lowcomm_method"): (2, "a marker on a torch optimizer (foreign)"),
    ("lowcomm.strategies.sharded.fsdp", "_fsdp_param_groups"): (1, "torch's FSDP internals by version"),
    ("lowcomm.strategies.sharded.fsdp", "_fsdp_param_group"): (1, "torch's FSDP internals by version"),
    ("lowcomm.strategies.sharded.fsdp", "_orig_cls_mro_index"): (1, "torch's FSDP internals by version"),
    ("lowcomm.strategies.sharded.fsdp", "__name__"): (1, "a user's wrap policy: a callable of any kind"),
    ("lowcomm.strategies.sharded.fsdp", "policy"): (1, "a run config, or a partial one in a check"),
    ("lowcomm.strategies.sync.syncdp", "server_error"): (1, "a compressor's exchange: two-phase keeps one"),
    ("lowcomm.tools.bench", "sync_s"): (1, "a benchmark's wrapped baseline (Horovod's) may time it"),
    ("lowcomm.tools.bench", "levels"): (1, "a benchmark's function: hierarchical carries its levels"),
    ("lowcomm.tools.memory_bench", "to"): (1, "a task's batch: a tensor or a structure of them"),
}


def probes(source: str, name: str) -> list[tuple[str, str, bool]]:
    """``(where, attribute, inside)`` of each ``getattr(x, "literal", ...)`` and
    ``hasattr(x, "literal")`` in ``source`` (``where``: ``name:line``; ``inside``: the call is
    in the body of a class that defines the attribute itself)."""
    out = []

    def visit(node, classes):
        if isinstance(node, ast.ClassDef):
            classes = classes + [node]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and \
                node.func.id in ("getattr", "hasattr") and len(node.args) >= 2 and \
                isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            attr = node.args[1].value
            out.append((f"{name}:{node.lineno}", attr, any(attr in _defines(c) for c in classes)))
        for child in ast.iter_child_nodes(node):
            visit(child, classes)
    visit(ast.parse(source), [])
    return out


def _defines(cls: ast.ClassDef) -> set[str]:
    """The names a class body defines (methods, properties, class attributes)."""
    names = set()
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                names.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
    return names


def package_probes() -> list[tuple[str, str, str, bool]]:
    """``(module, where, attribute, inside)`` of every literal probe in the package."""
    return [(m, where, attr, inside) for m, path in modules().items()
            for where, attr, inside in probes(path.read_text(),
                                              str(path.relative_to(PACKAGE.parent)))]


def test_no_capability_is_probed():
    """A capability is a method or property with a default, called unconditionally: never
    ``getattr(obj, "x", default)`` or ``hasattr(obj, "x")`` outside the class defining it."""
    bad = [f"{where}: probes {attr!r}" for _, where, attr, inside in package_probes()
           if attr in CAPABILITIES and not inside]
    assert not bad, ("capabilities probed (declare them with a default on the class or protocol "
                     "and read them directly):\n" + "\n".join(bad))


def test_every_remaining_probe_is_allowed_with_its_reason():
    found: dict[tuple[str, str], list[str]] = {}
    for m, where, attr, _ in package_probes():
        found.setdefault((m, attr), []).append(where)
    bad = [f"{w}: getattr/hasattr of {k[1]!r} ({len(ws)} in {k[0]}, "
           f"{ALLOWED[k][0] if k in ALLOWED else 0} allowed)"
           for k, ws in sorted(found.items()) if len(ws) > ALLOWED.get(k, (0, ""))[0] for w in ws]
    assert not bad, ("new getattr/hasattr probes: declare the attribute (a default on its class) "
                     "and read it, or add it to ALLOWED with its reason:\n" + "\n".join(bad))
    stale = [f"{k}: {n} allowed, {len(found.get(k, []))} left" for k, (n, _) in ALLOWED.items()
             if len(found.get(k, [])) < n]
    assert not stale, "ALLOWED names probes that are gone; lower or remove them:\n" + "\n".join(stale)
    assert sum(len(ws) for ws in found.values()) == sum(n for n, _ in ALLOWED.values())


def test_the_probe_check_finds_a_probe_outside_the_class_defining_it():
    source = ("class Strategy:\n    role = 1\n    def f(self):\n        return getattr(self, 'role', 0)\n\n"
              "def g(s):\n    return hasattr(s, 'role') or getattr(s, 'x', 1) or getattr(s, y)\n")
    assert probes(source, "m.py") == [("m.py:4", "role", True), ("m.py:7", "role", False),
                                      ("m.py:7", "x", False)]
