"""Imports flow one way: a layering test over the AST of every module in amprobe/ and dashboard/.

Layers, lowest first (a module may import its own layer and the layers below it):

    amprobe.config < amprobe.store < capture (amprobe.capture: protocol, collectors, hub,
        probe ...) < control (amprobe.control: watcher, sender, remote, launcher, autoattach,
        _bootstrap; and amprobe.api)
    amprobe.store < amprobe.analysis < amprobe.rules < amprobe.report < amprobe.cli, dashboard
    amprobe.demo may import capture and store; amprobe/__init__.py and amprobe/cli.py are top.

Four checks per module: it imports no higher layer, it is in no import cycle with other
modules (importing ``a.b.c`` runs ``a/__init__`` and ``a/b/__init__`` first, so the parent
packages of what a module imports are in the graph too), it has no function-local import except
of an optional dependency (or, in the CLI, of the capture side inside the command that needs
it, and of what a command needs inside the command's own private functions), and, on the read side (config, store, analysis, rules, report, dashboard, the CLI, the
package itself), it loads no torch at import, directly or through any module it imports, parent
packages included. Imports under ``if TYPE_CHECKING:`` count for layering only (they run no
code). A fifth, for the collectors (``amprobe.capture.collectors.*``): at import time they load
only the collector protocol, the leaf helpers (sites, patching), other collectors, the store and
the config; never the hub, the probe, discovery or control.
"""

from __future__ import annotations

import ast
import dataclasses
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("amprobe", "dashboard")

#: third-party packages amprobe works without (extras, drivers, test tools): importing them
#: inside the function that needs them is how an optional dependency stays optional.
OPTIONAL_DEPENDENCIES = {
    "dash",
    "plotly",
    "flask",
    "werkzeug",
    "selenium",
    "prometheus_client",
    "pynvml",
    "tqdm",
    "psutil",
}
#: our own modules that need an optional dependency (dashboard.app imports dash) or are an
#: optional part themselves (the CLI serves the dashboard when it is installed)
OPTIONAL_INTERNAL = {"dashboard.app", "dashboard.main"}
#: modules whose one job is to import lazily: `amprobe run`'s sitecustomize runs in every Python
#: process it starts and must import amprobe only once the program imports torch
LAZY_BY_DESIGN = {"amprobe.control._bootstrap.sitecustomize"}
#: modules that reach the capture side (which loads torch) only inside the function that needs
#: it: the CLI's demo/attach/detach commands. Only those layers, only there.
LAZY_CAPTURE = {"amprobe.cli"}
#: modules whose private functions (a command, ``_cmd_<name>``, and the ``_`` helpers it calls)
#: import the modules that command needs, of any layer, inside themselves: ``import amprobe.cli``
#: (``amprobe --help``, ``amprobe run``'s launcher process, alive as long as the job) loads
#: neither pandas nor the rules, and ``amprobe diagnose`` neither the launcher nor the writer.
#: Public functions (``main``, ``build_parser``) import nothing inside. The read side so
#: imported is checked for torch module by module; the launcher and the control channel that
#: run/attach/detach import are checked by tests/test_read_side.py (run with torch blocked).
LAZY_COMMANDS = {"amprobe.cli"}

CONFIG, STORE, CAPTURE, CONTROL = "config", "store", "capture", "control"
ANALYSIS, RULES, REPORT, DEMO, TOP = "analysis", "rules", "report", "demo", "top"
#: the layers that train or talk to a training job: they import torch
TORCH_LAYERS = {CAPTURE, CONTROL, DEMO}

#: layer -> the layers it may import (besides its own)
ALLOWED: dict[str, set[str]] = {
    CONFIG: set(),
    STORE: {CONFIG},
    CAPTURE: {CONFIG, STORE},
    CONTROL: {CONFIG, STORE, CAPTURE},
    ANALYSIS: {CONFIG, STORE},
    RULES: {CONFIG, STORE, ANALYSIS},
    REPORT: {CONFIG, STORE, ANALYSIS, RULES},
    DEMO: {CONFIG, STORE, CAPTURE},
    TOP: {CONFIG, STORE, CAPTURE, CONTROL, ANALYSIS, RULES, REPORT, DEMO},
}


def layer_of(module: str) -> str:
    """The layer of a dotted module name (see the module docstring)."""
    parts = module.split(".")
    if parts[0] == "dashboard":
        return TOP
    if module in ("amprobe", "amprobe.cli", "amprobe.__main__"):
        return TOP
    if parts[1] == "integrations":  # framework callbacks: attach, diagnose, print the summary
        return TOP
    sub = parts[1]
    if sub in ("config", "version", "lazy", "errors"):
        return CONFIG
    if sub == "store":
        return STORE
    if sub == "capture":
        return CAPTURE
    if sub in ("control", "api"):
        return CONTROL
    if sub in ("analysis", "rules", "report", "demo"):
        return {"analysis": ANALYSIS, "rules": RULES, "report": REPORT, "demo": DEMO}[sub]
    raise AssertionError(f"{module}: no layer assigned; add it to tests/test_layering.py")


@dataclasses.dataclass(frozen=True)
class Import:
    target: str  # a module of ours, or a third-party top-level name
    line: int
    local: bool  # inside a function body
    type_only: bool  # under `if TYPE_CHECKING:`
    guarded: bool  # inside a `try:` that handles ImportError
    function: str = ""  # the module-level function (or class) it is inside, if local


def _module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _discover() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            out[_module_name(path)] = path
    return out


MODULES = _discover()


def _resolve(name: str) -> str:
    """The longest known module that ``name`` names (``amprobe.store.loader.Run`` -> loader)."""
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        candidate = ".".join(parts[:i])
        if candidate in MODULES:
            return candidate
    return parts[0]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _handles_import_error(node: ast.Try) -> bool:
    for handler in node.handlers:
        names = []
        if handler.type is None:
            return True
        elts = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
        names = [e.id for e in elts if isinstance(e, ast.Name)]
        if {"ImportError", "ModuleNotFoundError", "Exception"} & set(names):
            return True
    return False


def imports_of(module: str, source: str | None = None) -> list[Import]:
    """Every import statement of a module, resolved to our module names where they are ours."""
    path = MODULES.get(module, ROOT / (module.replace(".", "/") + ".py"))
    text = path.read_text(encoding="utf-8") if source is None else source
    tree = ast.parse(text, filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, local: bool, type_only: bool, guarded: bool, where: str = "") -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            local = True
        if not where and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            where = node.name
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.body:
                visit(child, local, True, guarded, where)
            for child in node.orelse:
                visit(child, local, type_only, guarded, where)
            return
        if isinstance(node, ast.Try) and _handles_import_error(node):
            for child in node.body:
                visit(child, local, type_only, True, where)
            for part in (node.handlers, node.orelse, node.finalbody):
                for child in part:
                    visit(child, local, type_only, guarded, where)
            return
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            if base == "__future__":
                names = []
            else:
                names = [f"{base}.{alias.name}" for alias in node.names]
        for name in names:
            found.append(
                Import(
                    _resolve(name), node.lineno, local, type_only, guarded, where if local else ""
                )
            )
        for child in ast.iter_child_nodes(node):
            visit(child, local, type_only, guarded, where)

    visit(tree, False, False, False)
    return found


IMPORTS = {module: imports_of(module) for module in MODULES}


def _ours(name: str) -> bool:
    return name in MODULES


def _parents(module: str) -> list[str]:
    """The packages Python initializes before ``module`` (``a.b.c`` -> ``a``, ``a.b``)."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in MODULES]


def upward_imports(module: str) -> list[str]:
    layer = layer_of(module)
    if module.startswith("dashboard") or module in ("amprobe.cli", "amprobe.__main__"):
        return []  # the top imports anything
    allowed = ALLOWED[layer] | {layer}
    found = [
        f"line {i.line}: {module} ({layer}) imports {i.target} ({layer_of(i.target)})"
        for i in IMPORTS[module]
        if _ours(i.target) and i.target != module and layer_of(i.target) not in allowed
    ]
    return list(dict.fromkeys(found))


def _graph() -> dict[str, set[str]]:
    """Module -> the modules of ours its import-time imports run. Importing ``a.b.c`` first runs
    ``a/__init__`` and ``a/b/__init__``: those parent packages are edges too, except the
    importing module's own ancestors (already initialized before it runs; a package's modules
    importing each other would otherwise all be in a circle with it)."""
    graph: dict[str, set[str]] = {}
    for m, imps in IMPORTS.items():
        own = set(_parents(m))
        targets: set[str] = set()
        for i in imps:
            if not _ours(i.target) or i.type_only:
                continue
            targets.update(p for p in _parents(i.target) if p not in own)
            targets.add(i.target)
        targets.discard(m)
        graph[m] = targets
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[set[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(component)

    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


CYCLES = _cycles(_graph())


def local_imports(module: str) -> list[str]:
    if module in LAZY_BY_DESIGN:
        return []
    bad = []
    for i in IMPORTS[module]:
        if not i.local or i.type_only:
            continue
        top = i.target.split(".")[0]
        if top in OPTIONAL_DEPENDENCIES or i.target in OPTIONAL_INTERNAL:
            continue
        if i.guarded and not _ours(i.target):
            continue  # try: import x / except ImportError: an optional third-party package
        if module in LAZY_CAPTURE and _ours(i.target) and layer_of(i.target) in TORCH_LAYERS:
            continue
        if module in LAZY_COMMANDS and _ours(i.target) and i.function.startswith("_"):
            continue
        message = f"line {i.line}: {module} imports {i.target} inside a function"
        if message not in bad:
            bad.append(message)
    return bad


#: the collectors' package: its modules depend on the collector protocol, never on what drives it
COLLECTORS = "amprobe.capture.collectors"
#: what a collector may import besides other collectors, amprobe.store and amprobe.config: the
#: protocol and the leaf helpers. Never the hub, the probe, discovery or control: the hub imports
#: collectors (and so runs their package's ``__init__``), so a collector that imported it back
#: would close a circle, and a collector would reach past the protocol it is given.
COLLECTOR_MAY_IMPORT = (
    "amprobe.capture.protocol",
    "amprobe.capture.sites",
    "amprobe.capture.patching",
)
COLLECTOR_MAY_IMPORT_PACKAGES = (COLLECTORS, "amprobe.store", "amprobe.config")


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def collector_imports(module: str) -> list[str]:
    """The imports of a module under amprobe.capture.collectors that the protocol rule refuses.
    Type-only imports (a ``Probe`` or ``Hub`` annotation of the object the protocol hands in)
    run no code and are allowed."""
    if not _within(module, COLLECTORS):
        return []
    bad = []
    for i in IMPORTS[module]:
        if not _ours(i.target) or i.type_only or i.target in COLLECTOR_MAY_IMPORT:
            continue
        if any(_within(i.target, p) for p in COLLECTOR_MAY_IMPORT_PACKAGES):
            continue
        message = f"line {i.line}: {module} imports {i.target}"
        if message not in bad:
            bad.append(message)
    return bad


def _is_read_side(module: str) -> bool:
    """Modules that must load without torch: everything but capture, control, demo and the
    framework integrations (which run inside a training job), and dashboard.demo (it records
    runs for the tests and benchmarks; the served dashboard never imports it)."""
    if module.startswith("amprobe.integrations") or module == "dashboard.demo":
        return False
    return module.startswith("dashboard") or layer_of(module) not in TORCH_LAYERS


def torch_paths(module: str) -> list[str]:
    """Chains of import-time imports from ``module`` to torch (empty: importing it loads no
    torch). Function-local and type-only imports run no code at import; a guarded
    ``try: import torch`` still loads torch where it is installed, so it counts."""
    seen: dict[str, str | None] = {module: None}
    queue = [module]
    found = []
    while queue:
        current = queue.pop(0)
        steps = [(p, "parent") for p in _parents(current)]
        steps += [
            (i.target, f"line {i.line}")
            for i in IMPORTS[current]
            if not i.local and not i.type_only
        ]
        for target, how in steps:
            if target.split(".")[0] == "torch":
                chain, node = [f"{current} ({how}) -> torch"], current
                while seen[node] is not None:
                    parent = seen[node]
                    chain.insert(0, f"{parent} -> {node}")
                    node = parent
                found.append(", ".join(chain))
            elif _ours(target) and target not in seen:
                seen[target] = current
                queue.append(target)
    return found


def _params(check: str) -> Iterator[object]:
    for module in sorted(MODULES):
        yield pytest.param(module, id=module)


@pytest.mark.parametrize("module", list(_params("downward")))
def test_imports_flow_downward(module: str) -> None:
    assert upward_imports(module) == []


@pytest.mark.parametrize("module", list(_params("cycle")))
def test_in_no_import_cycle(module: str) -> None:
    cycle = next((c for c in CYCLES if module in c), set())
    assert not cycle, f"{module} is in an import cycle with {sorted(cycle - {module})}"


@pytest.mark.parametrize("module", list(_params("local")))
def test_no_function_local_import(module: str) -> None:
    assert local_imports(module) == []


@pytest.mark.parametrize("module", [m for m in sorted(MODULES) if _within(m, COLLECTORS)])
def test_collectors_import_only_the_protocol_and_leaves(module: str) -> None:
    assert collector_imports(module) == []


@pytest.mark.parametrize("module", [m for m in sorted(MODULES) if _is_read_side(m)])
def test_read_side_loads_no_torch(module: str) -> None:
    assert torch_paths(module) == []


# -- the checker itself -------------------------------------------------------------------------


def test_every_module_has_a_layer() -> None:
    assert {"amprobe.analysis", "amprobe.rules.engine", "amprobe.store.loader"} <= set(MODULES)
    for module in MODULES:
        layer_of(module)


def test_the_checker_sees_upward_local_and_cyclic_imports(monkeypatch) -> None:
    code = (
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "from amprobe.rules.engine import Finding\n"
        "if TYPE_CHECKING:\n    from amprobe.report import render_text\n"
        "def f():\n    import amprobe.cli\n    try:\n        import dash\n"
        "    except ImportError:\n        pass\n"
    )
    name = "amprobe.analysis._layering_probe"
    monkeypatch.setitem(IMPORTS, name, imports_of(name, code))
    upward = upward_imports(name)
    assert [u.split(" imports ")[1] for u in upward] == [
        "amprobe.rules.engine (rules)",
        "amprobe.report (report)",  # a type-only import still counts for layering
        "amprobe.cli (top)",
    ]
    assert local_imports(name) == [f"line 7: {name} imports amprobe.cli inside a function"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [{"a", "b", "c"}]


def test_the_checker_sees_a_circle_through_a_package_init(monkeypatch) -> None:
    """The circle once reported: the hub imports a module of the collectors' package, whose
    ``__init__`` imports a collector that imports the hub. No module imports its successor
    directly by the name of the package, yet Python runs ``collectors/__init__`` first."""
    hub, package = "amprobe.capture.hub", COLLECTORS
    compiled, compute = f"{COLLECTORS}.compiled", f"{COLLECTORS}.compute"
    sources = {
        hub: "from amprobe.capture.collectors.compiled import CompileCollector\n",
        package: "from amprobe.capture.collectors.compute import ComputeCollector\n",
        compute: "from amprobe.capture.hub import Hub\n",
        compiled: "import torch\n",
    }
    for name, code in sources.items():
        monkeypatch.setitem(IMPORTS, name, imports_of(name, code))
    graph = _graph()
    assert package in graph[hub]  # the parent package of the module imported
    assert {hub, package, compute} in _cycles(graph)
    # within a package, its modules importing each other do not count its own __init__
    monkeypatch.setitem(IMPORTS, compute, imports_of(compute, sources[hub]))
    graph = _graph()
    assert graph[compute] == {compiled}
    assert not [c for c in _cycles(graph) if hub in c]


def test_the_checker_sees_a_collector_reaching_past_the_protocol(monkeypatch) -> None:
    name = f"{COLLECTORS}._layering_probe"
    code = (
        "from typing import TYPE_CHECKING\n"
        "from amprobe.capture.protocol import Collector\n"
        "from amprobe.capture.sites import dtype_name\n"
        "from amprobe.capture.patching import patch\n"
        "from amprobe.capture.collectors.sharded import user_module_name\n"
        "from amprobe.store.fields import fields_of\n"
        "from amprobe.config import ConfigError\n"
        "import torch\n"
        "if TYPE_CHECKING:\n    from amprobe.capture.hub import Hub\n"
        "from amprobe.capture.hub import Hub\n"
        "from amprobe.capture.discovery import find_root_modules\n"
        "from amprobe.capture import probe\n"
        "import amprobe.control.launcher\n"
    )
    monkeypatch.setitem(IMPORTS, name, imports_of(name, code))
    assert [b.split(" imports ")[1] for b in collector_imports(name)] == [
        "amprobe.capture.hub",
        "amprobe.capture.discovery",
        "amprobe.capture.probe",
        "amprobe.control.launcher",
    ]
    assert collector_imports("amprobe.capture.hub") == []  # the rule is the collectors' only


def test_the_checker_sees_torch_through_parents_and_imports(monkeypatch) -> None:
    assert _is_read_side("amprobe.store.loader") and _is_read_side("dashboard.app")
    assert _is_read_side("amprobe") and _is_read_side("amprobe.cli")
    assert not _is_read_side("amprobe.capture.probe") and not _is_read_side("amprobe.demo")
    assert not _is_read_side("dashboard.demo")
    # a package __init__ that imports the capture side puts torch under every read module in it
    init = "from amprobe.config import Config\nfrom amprobe.api import attach\n"
    monkeypatch.setitem(IMPORTS, "amprobe", imports_of("amprobe", init))
    paths = torch_paths("amprobe.store.loader")
    assert paths and paths[0].startswith("amprobe.store.loader -> amprobe")
    assert paths[0].endswith("amprobe.api (line 9) -> torch")
    # a function-local or type-only import of the capture side loads nothing at import
    lazy = (
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from amprobe.capture.probe import Probe\n"
        "def f():\n    from amprobe.api import attach\n"
    )
    monkeypatch.setitem(IMPORTS, "amprobe", imports_of("amprobe", lazy))
    assert torch_paths("amprobe.store.loader") == []
    # the CLI may import the capture side inside a command, and nothing else
    cli = "def run():\n    from amprobe.control import launcher\ndef f():\n    import amprobe.report\n"
    monkeypatch.setitem(IMPORTS, "amprobe.cli", imports_of("amprobe.cli", cli))
    assert local_imports("amprobe.cli") == [
        "line 4: amprobe.cli imports amprobe.report inside a function"
    ]


def test_the_checker_lets_only_the_clis_private_functions_import_late(monkeypatch) -> None:
    """A command of the CLI (a private function, at any depth inside it) may import what it
    needs when it runs; the CLI's public functions, and any other module's, may not."""
    cli = (
        "def _cmd_diagnose(args):\n    from amprobe.report import render_text\n"
        "    def helper():\n        import amprobe.rules\n"
        "def _load(path):\n    from amprobe.report.summary import collector_errors\n"
        "def main(argv=None):\n    import amprobe.store.loader\n"
    )
    monkeypatch.setitem(IMPORTS, "amprobe.cli", imports_of("amprobe.cli", cli))
    assert [i.function for i in IMPORTS["amprobe.cli"]] == ["_cmd_diagnose"] * 2 + ["_load", "main"]
    assert local_imports("amprobe.cli") == [
        "line 8: amprobe.cli imports amprobe.store.loader inside a function"
    ]
    name = "amprobe.report._layering_probe"
    monkeypatch.setitem(IMPORTS, name, imports_of(name, "def _f():\n    import amprobe.rules\n"))
    assert local_imports(name) == [f"line 2: {name} imports amprobe.rules inside a function"]


@pytest.mark.parametrize(
    "module",
    [
        "amprobe.capture.hub",
        "amprobe.capture.probe",
        "amprobe.capture.discovery",
        "amprobe.capture.collectors",
        "amprobe.capture.collectors.syncs",
    ],
)
def test_capture_module_imports_first_in_a_fresh_interpreter(module: str) -> None:
    """``import amprobe.capture.hub`` as a program's first amprobe import must not fail halfway (a
    collector that imported the hub back did, once ``amprobe`` stopped loading it eagerly)."""
    proc = subprocess.run(
        [sys.executable, "-c", f"import {module}"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
